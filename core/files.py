"""Small file helpers every capability uses: atomic writes and tolerant reads of files another process rewrites."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to a temp file beside `path`, then rename: a reader never sees half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


_FLOAT_MAX = int(sys.float_info.max)


def _float_range_int(text: str) -> int:
    value = int(text)
    if not -_FLOAT_MAX <= value <= _FLOAT_MAX:
        raise ValueError(f"an integer of {len(text)} digits is beyond float range")
    return value


def loads_json(text: str | bytes):
    """json.loads for files other processes write (run logs, status): an integer no float can hold (a 400-digit
    step) is a ValueError like any other malformed input, so a reader skips and counts it rather than letting
    every later float() of that figure raise OverflowError. NaN/Infinity are kept: a diverged loss is evidence."""
    return json.loads(text, parse_int=_float_range_int)


def read_json_object(path: str | os.PathLike) -> dict | None:
    """A JSON object from a file another process may be rewriting: None when missing, torn, not an object or
    holding a number beyond float range."""
    try:
        data = loads_json(Path(path).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError, RecursionError):
        return None
