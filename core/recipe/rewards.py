"""The reward functions of a GRPO run: the run config's `rewards` list, checked, built and scored.

    rewards:
      - type: match            # the completion's answer against a column of the row (exact, or numeric)
        column: answer
        extract: last_number   # none | last_number | answer_tag | boxed | regex (with pattern)
        numeric: true
      - type: format           # the completion matches a regex (e.g. reasoning and answer tags)
        pattern: "(?s)<think>.*</think>\\s*<answer>.*</answer>"
      - type: length           # closeness to a target length in tokens, or a penalty beyond a maximum
        max: 256
      - type: python           # the user's own function, opt-in like trust_remote_code
        path: my_rewards.py
        function: reward
        trust_code: true

Each entry becomes one function with TRL's reward signature (`prompts`, `completions`, `completion_ids` and the
row's other columns as keyword arguments; one float per completion), named after its `name` or its type, which
is how TRL logs it (`rewards/<name>/mean`). Their weights are TRL's own `training.reward_weights`. Every preset
scores 0 to 1. A user function is imported only by `build(..., allow_code=True)`, in the trainer process, and by
preflight in a child process of its own (core.recipe.reward_code), never in the app's. A function that raises stops
the run with its name, the row and the error, never a silent 0.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from core.fmt import error_line
from core.recipe.reward_code import RewardError, label, load_function

TYPES = ("match", "format", "length", "python")
EXTRACTIONS = ("none", "last_number", "answer_tag", "boxed", "regex")
# the keys each type takes (besides type and name), with their kinds
KEYS: dict[str, dict[str, tuple[type, ...]]] = {
    "match": {"column": (str,), "extract": (str,), "pattern": (str,), "numeric": (bool,)},
    "format": {"pattern": (str,)},
    "length": {"target": (int,), "max": (int,)},
    "python": {"path": (str,), "function": (str,), "trust_code": (bool,)},
}
DEFAULT_COLUMN = "answer"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


# ---- checking the config --------------------------------------------------------------------------------------


def problems(rewards: Any) -> dict[str, str]:
    """{key path: one sentence} for every problem of a `rewards` list (a GRPO run's)."""
    if not isinstance(rewards, list) or not rewards:
        return {
            "rewards": "rewards must be a non-empty list of reward functions, e.g. [{type: match, column: answer}] "
            f"(types: {', '.join(TYPES)})."
        }
    out: dict[str, str] = {}
    for i, spec in enumerate(rewards):
        where = f"rewards[{i}]"
        if not isinstance(spec, dict):
            out[where] = f"{where} must be a mapping such as {{type: match, column: answer}}."
            continue
        kind = spec.get("type")
        if kind not in TYPES:
            out[f"{where}.type"] = f"{where}.type must be one of {', '.join(TYPES)} (got {kind!r})."
            continue
        allowed = KEYS[kind]
        for key, value in spec.items():
            if key in ("type", "name"):
                continue
            if key not in allowed:
                out[f"{where}.{key}"] = (
                    f"{where}.{key}: a {kind} reward has no such key; it takes {', '.join(allowed)}."
                )
            elif not isinstance(value, allowed[key]) or (type(value) is bool and bool not in allowed[key]):
                out[f"{where}.{key}"] = f"{where}.{key} must be {_kind_words(allowed[key])} (got {value!r})."
        name = spec.get("name")
        if name is not None and not (isinstance(name, str) and re.fullmatch(r"[A-Za-z_][\w-]{0,63}", name)):
            out[f"{where}.name"] = (
                f"{where}.name must be a short word (letters, digits, _ or -), got {name!r}."
            )
        problem = _type_problem(kind, spec, where)
        if problem:
            out[problem[0]] = problem[1]
    names = [name_of(s, i, rewards) for i, s in enumerate(rewards) if isinstance(s, dict)]
    if len(set(names)) != len(names):
        out["rewards"] = (
            f"rewards: two reward functions are named alike ({', '.join(names)}): give each a name."
        )
    return out


def _kind_words(kinds: tuple[type, ...]) -> str:
    return {str: "a string", int: "a whole number", bool: "true or false"}[kinds[0]]


def _type_problem(kind: str, spec: dict, where: str) -> tuple[str, str] | None:
    pattern = spec.get("pattern")
    if kind == "match":
        extract = spec.get("extract", "none")
        if extract not in EXTRACTIONS:
            return (
                f"{where}.extract",
                f"{where}.extract must be one of {', '.join(EXTRACTIONS)} (got {extract!r}).",
            )
        if (extract == "regex") != bool(pattern):
            return (
                f"{where}.pattern",
                f"{where}.pattern goes with extract: regex, and extract: regex needs one.",
            )
    if kind == "format" and not pattern:
        return f"{where}.pattern", f"{where}.pattern is needed: the regex a completion must match."
    if pattern:
        try:
            re.compile(pattern)
        except re.error as exc:
            return f"{where}.pattern", f"{where}.pattern is not a valid regex ({exc})."
    if kind == "length":
        target, most = spec.get("target"), spec.get("max")
        if (target is None) == (most is None):
            return (
                where,
                f"{where}: a length reward takes target (tokens to aim at) or max (tokens allowed), one.",
            )
        if (target or most or 0) < 1:
            return where, f"{where}: target / max must be at least 1 token."
    if kind == "python":
        if not spec.get("path") or not spec.get("function"):
            return where, f"{where}: a python reward needs path (a .py file) and function (its name)."
        if spec.get("trust_code") is not True:
            return (
                f"{where}.trust_code",
                f"{where} runs the code of {spec['path']} in the trainer: tick 'Run my reward code' "
                f"(set {where}.trust_code: true) if you trust that file.",
            )
        path = Path(spec["path"]).expanduser()
        if not path.is_file() or path.suffix != ".py":
            return (
                f"{where}.path",
                f"{where}.path: {path} is not a .py file; give the file with your function.",
            )
    return None


def name_of(spec: dict, index: int, rewards: list) -> str:
    """The function's name as TRL logs it: its `name`, or its type (numbered when the type repeats)."""
    if isinstance(spec.get("name"), str):
        return spec["name"]
    kind = spec.get("type", "reward")
    same = [
        i
        for i, s in enumerate(rewards)
        if isinstance(s, dict) and s.get("type") == kind and not s.get("name")
    ]
    return kind if len(same) == 1 else f"{kind}_{same.index(index) + 1}"


def names(rewards: list) -> list[str]:
    return [name_of(s, i, rewards) for i, s in enumerate(rewards)]


def answer_columns(rewards: list) -> list[str]:
    """The row columns the match rewards compare against (each row must have them)."""
    return list(dict.fromkeys(s.get("column", DEFAULT_COLUMN) for s in rewards if s.get("type") == "match"))


# ---- the presets ---------------------------------------------------------------------------------------------


def completion_text(completion) -> str:
    """A completion as text: TRL passes a string (standard prompts) or a list of messages (conversational)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion if completion is not None else "")


def extract(text: str, how: str, pattern: str | None = None) -> str | None:
    """The answer part of a completion; None when it has none (no number, no tag, no match)."""
    if how == "none":
        return text.strip()
    if how == "last_number":
        found = _NUMBER.findall(text)
        return found[-1] if found else None
    if how == "answer_tag":
        found = _ANSWER_TAG.findall(text)
        return found[-1].strip() if found else None
    if how == "boxed":
        return _last_boxed(text)
    found = list(re.finditer(pattern or "", text))
    if not found:
        return None
    last = found[-1]
    return (last.group(1) if last.groups() else last.group(0)).strip()


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def as_number(text) -> float | None:
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    found = _NUMBER.findall(str(text or "").replace("$", ""))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def match_score(completion, answer, spec: dict) -> float:
    got = extract(completion_text(completion), spec.get("extract", "none"), spec.get("pattern"))
    if got is None or answer is None:
        return 0.0
    if spec.get("numeric"):
        a, b = as_number(got), as_number(answer)  # the answer's last number: GSM8K's "... #### 72" reads 72
        return (
            1.0 if a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) else 0.0
        )
    return 1.0 if " ".join(got.split()) == " ".join(completion_text(answer).split()) else 0.0


def format_score(completion, spec: dict) -> float:
    return 1.0 if re.fullmatch(spec["pattern"], completion_text(completion).strip(), re.S) else 0.0


def length_score(n_tokens: int, spec: dict) -> float:
    if spec.get("target"):
        target = spec["target"]
        return max(0.0, 1.0 - abs(n_tokens - target) / target)
    most = spec["max"]
    return 1.0 if n_tokens <= most else max(0.0, 1.0 - (n_tokens - most) / most)


def ideal_completion(answer, spec: dict) -> str:
    """A completion that states the row's own answer the way the match reward reads it: what must score 1."""
    text = completion_text(answer)
    return {"answer_tag": f"<answer>{text}</answer>", "boxed": f"\\boxed{{{text}}}"}.get(
        spec.get("extract", "none"), text
    )


# ---- building the functions ------------------------------------------------------------------------------------


def build(rewards: list, allow_code: bool = False, where_of=None) -> list:
    """One TRL reward function per entry. allow_code: import the python rewards (the trainer process only).
    where_of(prompt) -> "row N" names the row of a prompt in a failure."""
    return [build_one(rewards, i, allow_code, where_of) for i in range(len(rewards))]


def build_one(rewards: list, index: int, allow_code: bool = False, where_of=None):
    """The function of rewards[index], named and numbered as within the whole list (a check of one reward says
    the same name and editor row as the run would)."""
    spec = rewards[index]
    name = name_of(spec, index, rewards)
    if spec["type"] == "python":
        if not allow_code:
            raise RewardError(f"{label(index)} ({name}): user code is loaded in the trainer process only.")
        inner = load_function(spec, index)
    else:
        inner = _preset(spec)
    return _guarded(inner, name, spec, where_of)


def _preset(spec: dict):
    kind = spec["type"]
    if kind == "match":
        column = spec.get("column", DEFAULT_COLUMN)

        def match(completions, **kwargs):
            if column not in kwargs:
                raise RewardError(
                    f"the rows have no column {column!r} (they have {', '.join(_columns(kwargs)) or 'none'})"
                )
            return [match_score(c, a, spec) for c, a in zip(completions, kwargs[column], strict=True)]

        return match
    if kind == "format":
        return lambda completions, **kwargs: [format_score(c, spec) for c in completions]

    def length(completions, completion_ids=None, **kwargs):
        sizes = (
            [len(ids) for ids in completion_ids]
            if completion_ids
            else [len(completion_text(c)) for c in completions]
        )
        return [length_score(n, spec) for n in sizes]

    return length


def _columns(kwargs: dict) -> list[str]:
    return [k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric", "environments")]


def _guarded(inner, name: str, spec: dict, where_of):
    """TRL's reward signature around `inner`, named `name` (TRL logs rewards/<name>/...): an exception, a wrong
    number of scores or a non-number stops the run with the function's name, the row and the error."""

    def reward(prompts=None, completions=None, **kwargs):
        try:
            scores = inner(prompts=prompts, completions=completions, **kwargs)
        except RewardError as exc:
            raise RewardError(f"reward {name!r} failed on {_where(where_of, prompts, 0)}: {exc}") from None
        except Exception as exc:
            row = _where(where_of, prompts, _culprit(inner, prompts, completions, kwargs))
            raise RewardError(
                f"reward {name!r} ({_origin(spec)}) raised {type(exc).__name__} on {row}: {error_line(exc)}"
            ) from None
        scores = list(scores) if scores is not None else []
        if len(scores) != len(completions or []):
            raise RewardError(
                f"reward {name!r} ({_origin(spec)}) returned {len(scores)} scores for {len(completions or [])} "
                "completions: return one number (or None) per completion."
            )
        for i, s in enumerate(scores):
            if s is not None and not (
                isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
            ):
                raise RewardError(
                    f"reward {name!r} ({_origin(spec)}) returned {s!r} on {_where(where_of, prompts, i)}: "
                    "return a finite number (or None) per completion."
                )
        return scores

    reward.__name__ = reward.__qualname__ = name
    return reward


def _culprit(inner, prompts, completions, kwargs) -> int:
    """Which completion of a batch the function fails on: it is called again on each alone (the run is failing
    anyway; this names the row to look at). 0 when none fails alone."""
    per_row = {k: v for k, v in kwargs.items() if isinstance(v, list) and len(v) == len(completions or [])}
    for i in range(len(completions or [])):
        one = {**kwargs, **{k: [v[i]] for k, v in per_row.items()}}
        try:
            inner(prompts=[prompts[i]] if prompts else prompts, completions=[completions[i]], **one)
        except Exception:
            return i
    return 0


def _origin(spec: dict) -> str:
    return f"{spec['path']}:{spec['function']}" if spec["type"] == "python" else f"the {spec['type']} preset"


def _where(where_of, prompts, i: int) -> str:
    if where_of is not None and prompts:
        found = where_of(prompts[min(i, len(prompts) - 1)])
        if found:
            return found
    return "a batch of completions"
