"""Write a GGUF file in one pass: header, metadata and tensor table first, then tensor data one tensor at a
time straight from the source's memory map. Also the small progress file a page can poll."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from core.files import read_json_object
from core.gguf.source import Source
from core.gguf.tensors import TensorJob, encoded_blocks
from core.gguf.vocab import VocabInfo, write_vocab


class ProgressFile:
    """`FILE.gguf.progress.json`: phase, tensors done/total, bytes done/total, pid; replaced atomically. Once
    another export's file is at `target` (two exports to one path: the first to finish wins), this one writes the
    file no more: the sidecars belong to the export whose file is there (`won`)."""

    def __init__(
        self,
        path: Path | None,
        callback: Callable[[dict], None] | None = None,
        every_s: float = 0.25,
        target: Path | None = None,
    ):
        self.path, self.callback, self.every_s, self.target = path, callback, every_s, target
        self.state: dict = {"pid": os.getpid(), "started": time.time()}
        self._last = 0.0
        self.won = False

    def update(self, force: bool = False, **fields) -> None:
        self.state.update(fields, updated=time.time())
        if self.callback is not None:
            self.callback(dict(self.state))
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.every_s):
            return
        if self.target is not None and not self.won and self.target.exists():
            return  # another export's file is in place: its progress is not ours to overwrite
        self._last = now
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.state))
            os.replace(tmp, self.path)
        except OSError:  # progress is advisory; never fail an export over it, nor leave its temporary behind
            tmp.unlink(missing_ok=True)


def read_progress(out: str | os.PathLike) -> dict | None:
    """The progress of the export whose target is `out` (None when there is none)."""
    # bounded, never a FIFO or a device, None when missing or torn
    return read_json_object(progress_path(Path(out)))


def progress_path(out: Path) -> Path:
    return out.with_name(out.name + ".progress.json")


def add_model_metadata(
    w: gguf.GGUFWriter, src: Source, file_type: int, name: str, n_vocab: int | None = None
) -> None:
    c = src.config
    if name == "mistral":
        # transformers' GGUF loader switches to a "mistral" architecture that gguf-py does not know when
        # general.name is exactly this; llama.cpp itself does not care.
        name = "mistral-model"
    w.add_name(name)
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(int(c.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(c["hidden_size"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_block_count(src.n_layers)
    w.add_head_count(src.n_head)
    w.add_head_count_kv(src.n_kv_head)
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(n_vocab or c["vocab_size"]))  # the GGUF's rows: the source's plus any byte tokens
    rp = src.rope_parameters
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_rope_dimension_count(src.head_dim)
    if src.head_dim != int(c["hidden_size"]) // src.n_head:
        w.add_key_length(src.head_dim)
        w.add_value_length(src.head_dim)
    if rp.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))


def _ti_dtype(job: TensorJob):
    if job.qtype == Q.F32:
        return job.shape, np.float32, None
    if job.qtype == Q.F16:
        return job.shape, np.float16, None
    return job.byte_shape, np.uint8, job.qtype


def write_gguf(
    path: Path,
    src: Source,
    jobs: list[TensorJob],
    vocab: VocabInfo,
    file_type: int,
    name: str,
    on_tensor: Callable[[TensorJob, int], None] | None = None,
) -> int:
    """Write the whole file to `path` (fsynced); returns its size."""
    w = gguf.GGUFWriter(path, src.arch)
    try:
        add_model_metadata(w, src, file_type, name, len(vocab.tokens))
        write_vocab(w, vocab)
        for job in jobs:
            shape, dtype, raw = _ti_dtype(job)
            w.add_tensor_info(job.name, shape, np.dtype(dtype), job.nbytes, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        for job in jobs:
            written = 0
            for block in encoded_blocks(job):
                data = memoryview(np.ascontiguousarray(block)).cast("B")
                fout.write(data)
                written += len(data)
                del block, data
            if written != job.nbytes:
                raise RuntimeError(f"{job.name}: wrote {written} bytes, the tensor table says {job.nbytes}.")
            w.write_padding(fout, written)
            if on_tensor is not None:
                on_tensor(job, written)
        fout.flush()
        os.fsync(fout.fileno())
        return fout.tell()
    finally:
        w.close()
