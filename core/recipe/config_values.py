"""One run config key's value against its schema (core.recipe.config.section_schema): its type, coerced where
YAML is ambiguous (2e-4 read as a string), its choices, its range (config_keys.RANGES) and the checks particular
to a key (paths, image sizes, data columns, target modules...). Each gives one problem in a few words, which
core.recipe.config.field_errors puts after the key's path.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from core.recipe import distributed, vision
from core.recipe.config_keys import COLUMN_KEYS, EXTRA_VALUES, RANGES


def check_value(path: str, value: Any, spec: dict) -> tuple[Any, str | None]:
    """(the value, coerced where YAML is ambiguous, or the problem)."""
    kinds, choices = spec.get("kinds") or ["any"], spec.get("choices")
    extra = EXTRA_VALUES.get(path, ())
    if value in extra and not isinstance(value, bool):
        return value, None
    if value is None:
        return (
            (None, None)
            if "none" in kinds or "any" in kinds
            else (None, "must be set (it has no 'none' value)")
        )
    if "any" in kinds:
        return value, None
    if isinstance(value, bool):
        if "bool" in kinds:
            return value, None
        return value, "must not be true/false" + (
            f": one of {', '.join(map(str, choices))}" if choices else ""
        )
    if isinstance(value, int) and ("int" in kinds or "float" in kinds):
        return value, None  # a whole number stays one (logging_steps: 10, not 10.0)
    if isinstance(value, float):
        if not math.isfinite(value):
            return value, "must be a finite number"
        if "float" in kinds:
            return value, None
        if "int" in kinds:
            return value, "must be a whole number"
    if isinstance(value, str):
        # YAML 1.1 reads 2e-4 (no dot) as a string: take it as the number it is
        if "float" in kinds and "str" not in kinds:
            try:
                number = float(value)
            except ValueError:
                return value, "must be a number"
            return (number, None) if math.isfinite(number) else (value, "must be a finite number")
        if "str" in kinds:
            if choices and value not in choices:
                near = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.6)
                hint = f" Did you mean {near[0]!r}?" if near else ""
                listed = ", ".join(map(str, choices[:12])) + (
                    f", ... ({len(choices)} in all)" if len(choices) > 12 else ""
                )
                return value, f"must be one of {listed}.{hint}"
            return value, None
    if isinstance(value, list) and "list" in kinds:
        return value, None
    if isinstance(value, dict) and "dict" in kinds:
        return value, None
    wanted = {
        "bool": "true or false",
        "int": "a whole number",
        "float": "a number",
        "str": "a string",
        "list": "a list",
        "dict": "a mapping",
    }
    words = [wanted[k] for k in kinds if k in wanted]
    return value, "must be " + " or ".join(words or ["a value of another type"])


def check_range(path: str, value: Any) -> str | None:
    if path not in RANGES or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    lo, hi, *mode = RANGES[path]
    mode = mode[0] if mode else "closed"
    lo_open, hi_open = mode in ("open", "left-open"), mode in ("open", "right-open")
    bad = (value <= lo if lo_open else value < lo) or (
        hi is not None and (value >= hi if hi_open else value > hi)
    )
    if not bad:
        return None
    if hi is None:
        return f"must be {'above' if lo_open else 'at least'} {lo}"
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    return f"must be in {left}{lo}, {hi}{right}"


def special_checks(path: str, value: Any) -> str | None:
    if path in ("model.path", "data.split") and not (isinstance(value, str) and value.strip()):
        return "must be a non-empty string"
    if path == "data.image_size" and vision.image_size(value) is None:
        return "must be WIDTHxHEIGHT in pixels, two whole numbers above 0 such as 1024x768"
    if path == "data.path":
        ok = (isinstance(value, str) and value.strip()) or (
            isinstance(value, list) and value and all(isinstance(p, str) and p.strip() for p in value)
        )
        return None if ok else "must be a file/folder path or a non-empty list of file paths"
    if path == "data.columns":
        for k, col in value.items():
            if k not in COLUMN_KEYS:
                return f"has unknown key {k!r}: the expected columns are {', '.join(COLUMN_KEYS)}"
            if not isinstance(col, str) or not col:
                return f"maps {k!r} to {col!r}: give the name of a column in your data"
    if path == "lora.target_modules" and not (
        (isinstance(value, str) and value.strip())
        or (isinstance(value, list) and value and all(isinstance(m, str) and m for m in value))
    ):
        return "must be 'all-linear' or a non-empty list of module names such as [q_proj, v_proj]"
    if path == "training.max_steps" and not (value == -1 or value >= 1):
        return "must be -1 (use num_train_epochs) or at least 1"
    if path.startswith("distributed."):
        return distributed.field_problem(path, value)
    if path == "training.warmup_steps" and not (value >= 0 and (value < 1 or float(value).is_integer())):
        return "must be a fraction of the steps (0 to <1) or a whole number of steps"
    return None
