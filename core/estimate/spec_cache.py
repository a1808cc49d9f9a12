"""The planner's disk cache of model specs and LoRA target lists: one small JSON file per entry, named by a hash
of what it was computed from, in a folder per installed library version and planner code (core.estimate.specs)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from core.files import atomic_write_text

CACHE_FORMAT = 2  # bump when the cached files' shape changes (2: LoRA on parameters, MoE facts)
CACHE_PACKAGES = ("torch", "transformers", "peft")  # what the counts come from
# the code the counts come from is the planner's package and what it reads through (core.recipe.peft_targets picks
# the LoRA targets, core.files decodes the config): a change to any file of core/ rebuilds every entry. Keyed on
# core/estimate alone, a day's cache kept target lists an edit of peft_targets had changed.


@lru_cache(maxsize=1)
def cache_dir() -> Path | None:
    """The cache folder for the installed library versions and this file's code; None without a home folder."""
    versions = {}
    for pkg in CACHE_PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "missing"
    try:
        core = Path(__file__).resolve().parent.parent
        code = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(core.rglob("*.py")))).hexdigest()
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-cockpit"
    except (OSError, RuntimeError):  # no readable source or no home folder: nothing is cached on disk
        return None
    key = hashlib.sha1(json.dumps([CACHE_FORMAT, versions, code], sort_keys=True).encode()).hexdigest()[:16]
    return root / f"model-specs-{key}"


def _cache_path(kind: str, key: list) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    return root / f"{kind}-{hashlib.sha1(json.dumps(key).encode()).hexdigest()[:24]}.json"


def _read_entry(path: Path | None, key: list, decode):
    """The decoded value of a cache entry written for exactly `key`; None when missing or unusable."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key)):
            return None
        return decode(data["value"])
    # unreadable, truncated, hand-edited or of another shape: the entry is rebuilt, never a traceback
    except Exception:
        return None


def _write_entry(path: Path | None, key: list, value) -> None:
    if path is None:
        return
    with contextlib.suppress(
        OSError
    ):  # a read-only or full cache folder: the spec is rebuilt next time, nothing else changes
        atomic_write_text(path, json.dumps({"key": key, "value": value}))


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an int: {value!r}")
    return value


def _typed(value, kind: type):
    if kind is int:
        return _int(value)
    if not isinstance(value, kind):
        raise TypeError(f"not a {kind.__name__}: {value!r}")
    return value
