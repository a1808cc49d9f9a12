"""What a failed run's diagnosis reads (Evidence), what it says (Diagnosis), and the shape of a rule (Rule)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from core.monitor.tail import RunSeries

_UNITS = {
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
}


@dataclass
class Evidence:
    """Everything a rule may look at. Any part may be missing (a run that died before writing it)."""

    stderr: str = ""
    status: dict | None = None
    series: RunSeries | None = None
    plan: dict | None = None
    config: dict | None = None

    @property
    def state(self) -> str | None:
        return (self.status or {}).get("state")

    @property
    def reason(self) -> str:
        return str((self.status or {}).get("reason") or "")

    def training(self) -> dict:
        return ((self.config or {}).get("training") or {}) if isinstance(self.config, dict) else {}


@dataclass
class Diagnosis:
    rule: str
    title: str
    cause: str
    fixes: list[str]
    details: list[str] = field(default_factory=list)  # figures drawn from the evidence
    evidence: list[str] = field(default_factory=list)  # the stderr lines that matched

    def to_dict(self) -> dict:
        return asdict(self)

    def markdown(self) -> str:
        parts = [f"**{self.title}**", "", self.cause]
        if self.details:
            parts += [""] + [f"- {d}" for d in self.details]
        parts += ["", "**What to change**", ""] + [f"{i}. {f}" for i, f in enumerate(self.fixes, 1)]
        if self.evidence:
            parts += ["", "```", *self.evidence, "```"]
        return "\n".join(parts)


Explain = Callable[[Evidence], tuple[list[str], list[str]]]  # -> (details, specific fixes first)


@dataclass
class Rule:
    name: str
    title: str
    signs: str  # how it is recognised, in words (for the docs)
    cause: str
    fix: list[str]
    patterns: tuple[str, ...] = ()  # regexes searched in stderr (multiline); any one matches
    test: Callable[[Evidence], bool] | None = None  # evidence beyond stderr; used when no pattern matched
    explain: Explain | None = None

    def match(self, ev: Evidence) -> list[str] | None:
        """The matched stderr lines ([] when matched on other evidence), or None."""
        # The status reason counts too: the trainer writes the exception text there when it fails cleanly.
        for text in (ev.stderr, ev.reason):
            for pat in self.patterns:
                if re.search(pat, text, re.MULTILINE):
                    return _matched_lines(text, pat)
        if self.test is not None and _safe(self.test, ev):
            return []
        return None


def _safe(fn, ev) -> bool:
    try:
        return bool(fn(ev))
    except Exception:  # a rule must never break the diagnosis panel
        return False


def _matched_lines(text: str, pat: str, limit: int = 3) -> list[str]:
    rx = re.compile(pat)
    lines = [ln.strip() for ln in text.splitlines() if rx.search(ln)]
    # Device asserts repeat once per GPU thread: show a few distinct ones.
    seen, out = set(), []
    for ln in lines:
        key = re.sub(r"\[\d+,\d+,\d+\]", "", ln)
        if key not in seen:
            seen.add(key)
            out.append(ln[:600])
    return out[:limit]


def _bytes(text: str | None) -> float | None:
    if not text:
        return None
    m = re.match(r"([\d.]+)\s*([KMGT]?i?B)", text.strip())
    if not m or m.group(2) not in _UNITS:
        return None
    return float(m.group(1)) * _UNITS[m.group(2)]


def _search(pat: str, text: str) -> re.Match | None:
    found = None
    for found in re.finditer(pat, text):  # noqa: B007 - the last occurrence is the failure that ended the run
        pass
    return found
