"""Safetensors (and PyTorch .bin) shard I/O: the base checkpoint read one tensor or one block of rows at a time,
and output shards written by streaming each tensor's bytes (the header is known from the plan up front)."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from core import files
from core.merge.errors import MergeError, load_json

MB = 1024**2

BASE_FIX = "copy or download the base model again."

COPY_BLOCK = 64 * MB

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
DTYPE_ARGS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass
class TensorInfo:
    key: str
    code: str  # safetensors dtype code
    shape: tuple
    file: Path
    offset: int = 0  # absolute byte offset in `file` (safetensors only)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.code)


def itemsize(code: str) -> int:
    return torch.empty((), dtype=ST_DTYPES[code]).element_size()


def read_safetensors_header(path: Path, fix: str = "copy or download it again.") -> tuple[dict, int]:
    """(header dict, byte offset where data starts), through core.files' one reader. A file that is truncated or
    whose header is corrupt is a MergeError naming it and `fix`, checked before any tensor is read: a shard cut
    short by a failed copy must not surface halfway through a merge, nor as the safetensors library's own trace."""
    try:
        h = files.read_safetensors_header(path)
    except files.BadFile as e:
        said = e.what if e.truncated else "has a corrupt safetensors header"
        raise MergeError(f"{path} {said} ({e.detail}): {fix}") from None
    except files.NotRegularFile as e:  # a FIFO or a folder: never opened for reading
        raise MergeError(f"{e}: {fix}") from None
    except OSError as e:
        raise MergeError(f"{path} cannot be read ({e.strerror or e}): {fix}") from None
    return h.header, h.data_start


class BaseCheckpoint:
    """The base model's weights on disk: sharded or single safetensors, or PyTorch .bin (loaded whole)."""

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        self.tensors: dict[str, TensorInfo] = {}
        self.warnings: list[str] = []
        self.kind = "safetensors"
        self._bin: dict[Path, dict] = {}
        files = self._weight_files()
        for file in files:
            if self.kind == "safetensors":
                header, data_start = read_safetensors_header(file, BASE_FIX)
                entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
                for key, v in sorted(entries, key=lambda kv: kv[1]["data_offsets"][0]):
                    if v["dtype"] not in ST_DTYPES:
                        raise MergeError(
                            f"{file.name}: tensor {key} has dtype {v['dtype']} this merge cannot read."
                        )
                    self.tensors[key] = TensorInfo(
                        key, v["dtype"], tuple(v["shape"]), file, data_start + v["data_offsets"][0]
                    )
            else:
                for key, t in self._load_bin(file).items():
                    if t.dtype not in TORCH_TO_ST:
                        raise MergeError(
                            f"{file.name}: tensor {key} has dtype {t.dtype} this merge cannot read."
                        )
                    self.tensors[key] = TensorInfo(key, TORCH_TO_ST[t.dtype], tuple(t.shape), file)
        self.largest_file_bytes = max(f.stat().st_size for f in files)
        self.total_bytes = sum(t.nbytes for t in self.tensors.values())

    def _weight_files(self) -> list[Path]:
        d = self.dir
        for index_name, single, kind in (
            ("model.safetensors.index.json", "model.safetensors", "safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin", "bin"),
        ):
            self.kind = kind
            if (d / index_name).is_file():
                weight_map = load_json(d / index_name, BASE_FIX).get("weight_map")
                if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()
                ):
                    raise MergeError(f"{d / index_name} has no valid weight_map: {BASE_FIX}")
                names = list(dict.fromkeys(weight_map.values()))
                missing = [n for n in names if not (d / n).is_file()]
                if missing:
                    raise MergeError(
                        f"Base model {d} is incomplete: {index_name} lists {missing[0]}, which is missing."
                    )
                files = [d / n for n in names]
            elif (d / single).is_file():
                files = [d / single]
            else:
                continue
            if kind == "bin":
                self.warnings.append(
                    f"The base model is stored as PyTorch .bin ({len(files)} file(s)): each file is loaded whole "
                    "(not streamed), so RAM use is about the largest .bin file. Safetensors bases merge with less RAM."
                )
            return files
        raise MergeError(
            f"No model weights in {d}: expected model.safetensors, model.safetensors.index.json or "
            "pytorch_model.bin. Point --base at the folder of the original (unquantized) base model."
        )

    def _load_bin(self, file: Path) -> dict:
        if file not in self._bin:
            self._bin.clear()  # keep one .bin file in memory at a time
            try:
                try:
                    sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:
                    sd = torch.load(
                        file, map_location="cpu", weights_only=True
                    )  # legacy non-zip format: no mmap
            except Exception as e:  # truncated zip, pickle errors, ...
                raise MergeError(f"{file} cannot be read ({type(e).__name__}: {e}): {BASE_FIX}") from e
            if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
                raise MergeError(f"{file} does not hold a dict of tensors: {BASE_FIX}")
            self._bin[file] = sd
        return self._bin[file]

    def read_rows(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor, in its stored dtype, as a fresh tensor. Safetensors are read with plain file reads of
        exactly those bytes (no mmap kept open), so the process's RSS grows only by the rows read."""
        info = self.tensors[key]
        if self.kind == "bin":
            t = self._load_bin(info.file)[key]
            return (t if not info.shape else t[start:stop]).clone()  # callers add in place: never a view
        if not info.shape:
            start, stop, row_shape = 0, 1, ()
        else:
            stop = info.shape[0] if stop is None else stop
            row_shape = info.shape[1:]
        t = torch.empty((stop - start) * math.prod(row_shape), dtype=ST_DTYPES[info.code])
        if t.numel():
            buf = t.view(torch.uint8).numpy()  # read straight into the tensor's memory: no extra copy
            with open(info.file, "rb") as f:
                f.seek(info.offset + start * buf.nbytes // (stop - start))
                if f.readinto(buf) != buf.nbytes:
                    raise MergeError(f"{info.file} is truncated: cannot read tensor {key}.")
        return t.reshape(info.shape if not info.shape else (stop - start, *row_shape))

    def read_flat_bytes(self, key: str, start: int, stop: int) -> bytes:
        """The stored bytes of elements [start, stop) of a tensor in row-major order (for its fingerprint)."""
        info = self.tensors[key]
        if self.kind == "bin":
            return bytes(tensor_bytes(self._load_bin(info.file)[key].reshape(-1)[start:stop]))
        size = itemsize(info.code)
        with open(info.file, "rb") as f:
            f.seek(info.offset + start * size)
            data = f.read((stop - start) * size)
        if len(data) != (stop - start) * size:
            raise MergeError(f"{info.file} is truncated: cannot read tensor {key}.")
        return data

    def raw_blocks(self, key: str) -> Iterator[bytes]:
        """The stored bytes of a tensor, in blocks (for tensors copied unchanged)."""
        info = self.tensors[key]
        if self.kind == "bin":
            yield tensor_bytes(self._load_bin(info.file)[key])
            return
        left, pos = info.nbytes, info.offset
        with open(info.file, "rb") as f:
            f.seek(pos)
            while left:
                block = f.read(min(COPY_BLOCK, left))
                if not block:
                    raise MergeError(f"{info.file} is truncated: cannot read tensor {key}.")
                left -= len(block)
                yield block


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_shard(
    path: Path,
    tensors: list,
    stream: Callable[[object], Iterable[memoryview | bytes]],
    on_tensor: Callable[[object, int], None],
) -> None:
    """Write one safetensors file, streaming each tensor's bytes: the header is known up front from the plan,
    so no output shard is ever held in memory. `tensors` are planned tensors (out_key, out_code, shape, nbytes);
    `stream(t)` yields their bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.out_key] = {
            "dtype": t.out_code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # safetensors pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for t in tensors:
            written = 0
            for chunk in stream(t):
                f.write(chunk)
                written += len(chunk)
            if written != t.nbytes:
                raise MergeError(
                    f"Internal error: {t.out_key} produced {written} bytes, expected {t.nbytes}."
                )
            on_tensor(t, written)
        f.flush()
        os.fsync(f.fileno())
