"""Small file helpers every capability uses: atomic writes and tolerant reads of files another process rewrites."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str, parents: bool = True) -> Path:
    """Write `text` to a temp file beside `path`, then rename: a reader never sees half a file. parents=False:
    FileNotFoundError when the folder is gone, instead of making it again."""
    p = Path(path)
    if parents:
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


MAX_YAML_BYTES = 1_000_000  # a run config is a few hundred bytes; anything huge is not one


class YamlError(ValueError):
    """A YAML file that cannot be a run config; the message says what and where."""


def read_yaml(path: str | os.PathLike, where: str | None = None) -> Any:
    """The one reader of run-config YAML files (config.yaml, run.yaml): a regular file only (never a FIFO or a
    device), at most MAX_YAML_BYTES, UTF-8, YAML without anchors or aliases. Raises YamlError."""
    p = Path(path)
    where = where or str(p)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise YamlError(f"{where} cannot be read ({exc.strerror}).") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise YamlError(f"{where} is not a regular file: give the path of a YAML file.")
        if st.st_size > MAX_YAML_BYTES:
            raise YamlError(
                f"{where} is {st.st_size:,} bytes: a run config is a few hundred bytes; give the right file."
            )
        data = os.read(fd, MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise YamlError(f"{where} cannot be read ({exc.strerror}).") from None
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise YamlError(f"{where} is not a text file (not UTF-8): give a YAML run config.") from None
    return parse_yaml(text, where)


def parse_yaml(text: str, where: str = "the run config") -> Any:
    """yaml.safe_load without anchors/aliases: a 400-byte file of nested aliases expands to gigabytes."""
    import yaml  # light, but only the config readers need it

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise YamlError(
                    f"{where} uses a YAML alias (*{event.anchor}) at line {event.start_mark.line + 1}: "
                    "aliases are not accepted in run configs; write the values out."
                )
            return super().compose_node(parent, index)

    try:
        return yaml.load(text, Loader=NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "a syntax error"
        raise YamlError(f"{where} is not valid YAML{at} ({problem}).") from None
    except RecursionError:
        raise YamlError(f"{where} is nested too deeply to be a run config.") from None


def read_yaml_mapping(path: str | os.PathLike) -> dict | None:
    """A run directory's config.yaml as a mapping, for readers that must not fail (the Monitor, diagnosis, merge
    discovery): None when it is missing, hostile or not a mapping. Never writes."""
    try:
        data = read_yaml(path)
    except YamlError:
        return None
    return data if isinstance(data, dict) else None
