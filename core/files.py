"""Small file helpers every capability uses: atomic writes and tolerant reads of files another process rewrites."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
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


def disk_needed(payload: int) -> int:
    """The free disk an export of `payload` bytes asks for before it writes (the merge's and the GGUF export's one
    rule): the bytes, plus a margin for the small files beside them and the filesystem's rounding; a few percent,
    at least 1 MiB, at most 64 MiB (not a flat 64 MiB on a 1 MiB export)."""
    return payload + min(64 << 20, max(1 << 20, payload // 50))


def disk_shortfall(
    folder: str | os.PathLike, needed: int, what: str = "the export"
) -> tuple[int, str | None]:
    """(free bytes at `folder`, the sentence saying so when `needed` bytes do not fit there; else None)."""
    from core.fmt import disk

    free = shutil.disk_usage(folder).free
    if needed <= free:
        return free, None
    return free, (
        f"Not enough free disk at {folder}: {what} needs {disk(needed)}, {disk(free)} is free; free some space "
        "there, or write it elsewhere."
    )


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


class NotRegularFile(OSError):
    """A path that names a FIFO, a device, a socket or a folder where a file was expected."""


class FileTooLarge(OSError):
    """A regular file larger than its reader accepts."""


MAX_JSON_BYTES = (
    16 << 20
)  # status.json, plan.json, smoke.json, a job's files: a few KiB; a model config.json < 1 MiB


# tokenizer.json: the largest (260k-token vocabularies, Gemma's) are ~35 MB; this bounds what json.loads may build
MAX_TOKENIZER_JSON_BYTES = 256 << 20


def open_regular(path: str | os.PathLike) -> int:
    """An O_RDONLY descriptor of `path` when it is a regular file (after symlinks); NotRegularFile otherwise.
    Opening never blocks (a FIFO with no writer) and a device is never read (/dev/zero never ends)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes: NotRegularFile for a FIFO, a device or a folder,
    FileTooLarge beyond `limit` (nothing read), OSError when it cannot be opened."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise FileTooLarge(f"{path} is {size:,} bytes (at most {limit:,} expected)")
        chunks, got = [], 0
        while got <= limit:  # a file growing while it is read stops at the limit too
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise FileTooLarge(f"{path} grew past {limit:,} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


class BadFile(ValueError):
    """A file its reader cannot take. `why` says so after the file's path ("is not valid JSON (...)", "is truncated
    (...)"); the caller puts the path in front and its own fix after, in its own sentence."""

    def __init__(self, what: str, detail: str = "", truncated: bool = False):
        self.what, self.detail = (
            what,
            detail,
        )  # "is truncated", "its tensors need 80 bytes of data, 20 follow"
        self.why = f"{what} ({detail})" if detail else what
        super().__init__(self.why)
        self.truncated = truncated  # cut short (a copy or a save that stopped), rather than garbage


_KINDS = {list: "a list", str: "a string", bool: "true/false", type(None): "null"}


def load_json_object(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in `path` (a model's config.json, an index, an adapter config): a regular file of at most
    `limit` bytes (never a FIFO or a device), UTF-8 JSON, an object. Raises BadFile."""
    try:
        data = loads_json(read_bounded(path, limit))
    except (NotRegularFile, FileTooLarge) as exc:
        raise BadFile(str(exc).removeprefix(f"{path} ")) from None
    except OSError as exc:
        raise BadFile("cannot be read", str(exc.strerror or exc)) from None
    except RecursionError:
        raise BadFile("is nested too deeply to be read") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a number beyond float range
        raise BadFile("is not valid JSON", str(exc) or type(exc).__name__) from None
    if not isinstance(data, dict):
        raise BadFile("does not hold a JSON object", f"it holds {_KINDS.get(type(data), 'a number')}")
    return data


def read_json_object(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> dict | None:
    """load_json_object for files another process may be rewriting (status, plan, a job's record), and for
    readers that must not fail: None when missing, torn, not an object, not a regular file (a FIFO, /dev/zero),
    larger than `limit` or holding a number beyond float range. Never blocks, never reads more than `limit`."""
    try:
        return load_json_object(path, limit)
    except BadFile:
        return None


MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on the header's JSON
MAX_DIMS = 64  # numpy's; a longer shape is a hostile header (its product alone would take minutes)
NOT_SAFETENSORS = "is not a valid safetensors file"
# bytes per element of the safetensors dtypes: a header whose shape and data size disagree is refused
ST_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


@dataclass
class SafetensorsHeader:
    header: dict  # as stored: tensor name -> {dtype, shape, data_offsets}, and "__metadata__" when present
    data_start: int  # the byte where the tensor data begins (8 + the header's length)
    size: int  # the file's size

    @property
    def tensors(self) -> dict[str, dict]:
        return {k: v for k, v in self.header.items() if k != "__metadata__"}

    @property
    def data_end(self) -> int:
        """The byte after the last tensor's data: the file's size when it is whole."""
        return self.data_start + max((v["data_offsets"][1] for v in self.tensors.values()), default=0)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of a safetensors file, checked as safetensors checks it, without reading any tensor data: a
    regular file (never a FIFO), a header length that fits the file and the format's limit, a JSON object of
    entries with a dtype, a shape and data offsets inside the file, each shape as large as its data. Raises BadFile
    (truncated=True for a file cut short), so no caller meets the library's trace halfway through its work."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise BadFile(
                "is truncated", f"{size} bytes, shorter than its 8-byte header length", truncated=True
            )
        n = int.from_bytes(head, "little")
        if n > MAX_SAFETENSORS_HEADER:
            raise BadFile(NOT_SAFETENSORS, f"a header length of {n:,} bytes, beyond the format's 100 MiB")
        if 8 + n > size:
            raise BadFile(
                "is truncated", f"its header length says {n:,} bytes, {size - 8:,} follow", truncated=True
            )
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadFile(NOT_SAFETENSORS, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise BadFile(NOT_SAFETENSORS, "its header is not a JSON object")
    data = size - 8 - n
    end = 0
    for key, v in header.items():
        if key == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not (
            isinstance(v.get("dtype") if isinstance(v, dict) else None, str)
            and isinstance(v.get("shape"), list)
            and len(v["shape"]) <= MAX_DIMS
            and all(_whole(d) for d in v["shape"])
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(_whole(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise BadFile(NOT_SAFETENSORS, f"its header does not describe tensors: entry {key!r}")
        itemsize = ST_ITEMSIZE.get(v["dtype"])
        if itemsize is not None and math.prod(v["shape"]) * itemsize != offsets[1] - offsets[0]:
            raise BadFile(
                NOT_SAFETENSORS,
                f"tensor {key}'s shape {v['shape']} does not match its {offsets[1] - offsets[0]:,} data bytes",
            )
        end = max(end, offsets[1])
    if end > data:
        raise BadFile(
            "is truncated", f"its tensors need {end:,} bytes of data, {data:,} follow", truncated=True
        )
    return SafetensorsHeader(header, 8 + n, size)


def iter_jsonl_objects(path: str | os.PathLike, max_line: int = 1 << 20, chunk: int = 4 << 20):
    """The JSON objects of a JSONL file, one per complete line, streamed: a regular file only (nothing from a FIFO
    or a device), a line longer than `max_line` skipped without being held in memory, a torn last line left out.
    Yields nothing when the file is missing or unreadable."""
    try:
        fd = open_regular(path)
    except OSError:
        return
    with os.fdopen(fd, "rb") as fh:
        buf, skipping = b"", False
        while True:
            block = fh.read(chunk)
            if not block:
                return  # what is left in buf has no newline yet: a line still being written
            buf += block
            lines = buf.split(b"\n")
            buf = lines.pop()
            for line in lines:
                if skipping:  # the end of an over-long line
                    skipping = False
                    continue
                if len(line) > max_line or not line.strip():
                    continue
                try:
                    rec = loads_json(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(rec, dict):
                    yield rec
            if len(buf) > max_line:
                buf, skipping = b"", True


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
    except YamlError:  # the alias refusal above: already the sentence to show
        raise
    except ValueError:  # an integer of more digits than Python converts (sys.set_int_max_str_digits)
        digits = sys.get_int_max_str_digits()
        raise YamlError(
            f"{where} holds a number of more than {digits:,} digits: write a real value."
        ) from None


def read_yaml_mapping(path: str | os.PathLike) -> dict | None:
    """A run directory's config.yaml as a mapping, for readers that must not fail (the Monitor, diagnosis, merge
    discovery): None when it is missing, hostile or not a mapping. Never writes."""
    try:
        data = read_yaml(path)
    except YamlError:
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def quiet_datasets():
    """datasets' progress bars and its own error log ("Failed to load JSON ... in row 1") off while it reads: they
    would precede, and contradict, the one sentence that names the bad line."""
    import datasets
    from datasets.utils import logging as datasets_logging

    bars, level = datasets.is_progress_bar_enabled(), datasets_logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


# transformers writes the floats JSON cannot hold as {"__float__": "Infinity"} (PreTrainedConfig's
# _encode_special_floats: Mamba-2's time_step_limit is [0.0, inf]) and decodes them on load; so must we
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_config_floats(value):
    """`value` (a config.json's parsed fields) with transformers' tagged floats decoded, as
    PreTrainedConfig._decode_special_floats does: a dict whose one key is "__float__" with a known tag becomes
    that float; anything else is kept. Iterative, so a deeply nested hostile file cannot exhaust the stack."""
    root = [value]
    stack = [(root, 0)]
    while stack:
        holder, key = stack.pop()
        item = holder[key]
        if isinstance(item, dict):
            tag = item.get("__float__") if len(item) == 1 else None
            if isinstance(tag, str) and tag in _FLOAT_TAGS:
                holder[key] = _FLOAT_TAGS[tag]
                continue
            item = holder[key] = dict(item)  # a copy: the caller's object (a cached preset) stays as it was
            stack.extend((item, k) for k in item)
        elif isinstance(item, list):
            item = holder[key] = list(item)
            stack.extend((item, i) for i in range(len(item)))
    return root[0]
