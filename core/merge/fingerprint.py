"""Which base weights an adapter was trained on: a fingerprint recorded beside the adapter, compared at merge.

Two fine-tunes of one model (Llama-3.1-8B and Llama-3.1-8B-Instruct) have the same config.json, the same tensor
names and shapes: only their values differ. The fingerprint is cheap and deterministic without reading whole
weights: a hash of every tensor's name, dtype and shape (the layout), and a hash of a few KiB read at the start,
middle and end of every tensor (the values). A fine-tune changes every weight matrix, so each window differs;
a copy, a move, another sharding or the .bin form of the same weights has the same fingerprint. Reading three
4 KiB windows a tensor is a few MB for an 8B model (a fraction of a second on a local disk).

The trainer calls record_base() when it saves the adapter; the merge's compatibility check (compat.py) compares
the recorded fingerprint with the base it is given.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from core.files import BadFile, load_json_object
from core.merge.errors import MergeError
from core.merge.shards import BaseCheckpoint, itemsize

FINGERPRINT_FILE = "base_fingerprint.json"
FORMAT = 1
WINDOW = 4096  # bytes read at the start, middle and end of each tensor
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Fingerprint:
    layout: str  # sha256 over every tensor's name, dtype and shape
    values: str  # sha256 over the sampled bytes of every tensor
    tensors: int

    def differs_from(self, other: Fingerprint) -> str | None:
        """How `other` differs, as words for a sentence; None when it is the same."""
        if self.layout != other.layout:
            return "other tensor names, shapes or dtypes"
        if self.values != other.values:
            return "the same tensor names and shapes with other values: another fine-tune or version of that model"
        return None


def locate_base(name: str) -> Path | None:
    """The folder of a base named as training saw it: a local folder (relative ones from the current folder or
    the repo, where the cockpit trains), else a Hugging Face hub id's snapshot in the local cache."""
    p = Path(name).expanduser()
    for cand in [p] if p.is_absolute() else [Path.cwd() / p, _REPO_ROOT / p]:
        if (cand / "config.json").is_file():
            return cand.resolve()
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid hub id: nothing to find
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _windows(n_elements: int, size: int) -> list[tuple[int, int]]:
    """Element ranges [start, stop) of about WINDOW bytes at the start, middle and end of a tensor."""
    w = max(1, WINDOW // size)
    if n_elements <= 3 * w:
        return [(0, n_elements)] if n_elements else []
    mid = n_elements // 2 - w // 2
    return [(0, w), (mid, mid + w), (n_elements - w, n_elements)]


def fingerprint_of(base: BaseCheckpoint) -> Fingerprint:
    """The fingerprint of a base checkpoint's weights (safetensors or .bin, sharded or not)."""
    layout, values = hashlib.sha256(), hashlib.sha256()
    for key in sorted(base.tensors):
        info = base.tensors[key]
        layout.update(json.dumps([key, info.code, list(info.shape)]).encode() + b"\n")
        values.update(key.encode() + b"\n")
        for start, stop in _windows(math.prod(info.shape), itemsize(info.code)):
            values.update(base.read_flat_bytes(key, start, stop))
    return Fingerprint(layout.hexdigest(), values.hexdigest(), len(base.tensors))


def fingerprint(base_dir: str | os.PathLike) -> Fingerprint:
    return fingerprint_of(BaseCheckpoint(Path(base_dir)))


def record_base(adapter_dir: str | os.PathLike, base: str | os.PathLike) -> Path | None:
    """Write ADAPTER_DIR/base_fingerprint.json: the base the adapter was trained on (as named, and the folder it
    resolved to) and its weights' fingerprint. Returns the file, or None when the base's weights cannot be read
    here (nothing is written: the merge then compares config.json only, with a note)."""
    folder = locate_base(str(base))
    if folder is None:
        return None
    try:
        fp = fingerprint(folder)
    except (MergeError, OSError):
        return None
    path = Path(adapter_dir) / FINGERPRINT_FILE
    record = {
        "format": FORMAT,
        "base": str(base),
        "base_dir": str(folder),
        "layout": fp.layout,
        "values": fp.values,
        "tensors": fp.tensors,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class RecordedBase:
    base: str  # as training named it
    base_dir: str  # the folder it resolved to then
    fingerprint: Fingerprint


def read_recorded_base(adapter_dir: Path) -> RecordedBase | None:
    """The base recorded beside an adapter; None when there is no record (older runs, adapters from elsewhere).
    A record that does not read is a MergeError naming the file (the caller turns it into a note)."""
    path = adapter_dir / FINGERPRINT_FILE
    if not os.path.lexists(path):
        return None
    try:  # core.files' bounded reader: never a FIFO or a device, never a huge file
        data = load_json_object(path)
    except BadFile as e:
        raise MergeError(f"{path} cannot be read: it {e.why}") from None
    fields = ("base", "base_dir", "layout", "values")
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not all(isinstance(data.get(f), str) for f in fields)
    ):
        raise MergeError(f"{path} is not a base fingerprint this version knows")
    fp = Fingerprint(data["layout"], data["values"], int(data.get("tensors") or 0))
    return RecordedBase(data["base"], data["base_dir"], fp)
