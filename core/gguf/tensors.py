"""HF tensor -> GGUF tensor: names, output types, llama.cpp's q/k row permutation, and chunked encoding.

Every tensor is read in blocks of rows through a memory-mapped `safe_open` slice, converted and written block
by block, so no tensor is ever held whole in fp32. Quantized formats are row-wise (blocks of 32 along a row),
so encoding row blocks separately gives the same bytes as encoding the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from core.gguf.source import BadInput, Source, SourceTensor

MB = 1024**2
CHUNK_BYTES = 32 * MB  # fp32 bytes of one row block: bounds the numpy quantizers' temporaries too

# --type -> (type of 2-D weights, general.file_type)
TYPES = {
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q5_0": (Q.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
    "q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}
# K-quants need llama.cpp's own quantizer (importance-aware mixes); gguf-py cannot write them all.
K_TYPES = {
    "q2_k": "Q2_K",
    "q3_k_m": "Q3_K_M",
    "q4_k_s": "Q4_K_S",
    "q4_k_m": "Q4_K_M",
    "q5_k_s": "Q5_K_S",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
}
ARCH_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


@dataclass
class TensorJob:
    name: str  # GGUF name
    qtype: Q
    shape: tuple[int, ...]  # logical numpy shape (rows, cols)
    src: SourceTensor | None = None  # None: generated (rope_freqs)
    permute_heads: int = 0  # >0: apply llama.cpp's rotary permutation with this many heads
    data: np.ndarray | None = None  # generated tensors only (tiny)
    extra_rows: int = 0  # rows appended after the source's (byte tokens of a character-level vocabulary) ...
    extra_row_source: int = 0  # ... each a copy of this source row

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return gguf.quant_shape_to_byte_shape(self.shape, self.qtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.byte_shape)


def _weight_type(name: str, shape: tuple[int, ...], base: Q, tied: bool) -> Q:
    if len(shape) == 1:
        return Q.F32  # norms and biases stay F32, as llama.cpp's converter keeps them
    block, _ = gguf.GGML_QUANT_SIZES[base]
    if shape[-1] % block:
        return Q.F16  # rows that do not split into quant blocks (llama.cpp falls back the same way)
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    if head and base in (Q.Q4_0, Q.Q5_0):
        # The output head is the most quantization-sensitive tensor; llama-quantize gives it Q6_K in these
        # mixes. gguf-py has no Q6_K quantizer, so Q8_0 is the closest we can write.
        return Q.Q8_0
    return base


def llama3_rope_factors(src: Source) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama-3.1-style ('llama3') RoPE scaling."""
    rp = src.rope_parameters
    dim, base = src.head_dim, float(rp["rope_theta"])
    factor = float(rp.get("factor", 8.0))
    low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    old_ctx = float(rp.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


VOCAB_ROWS = ("token_embd.weight", "output.weight")


def plan_tensors(
    src: Source, out_type: str, skip_qk_permute: bool = False, extra_rows: int = 0, extra_row_source: int = 0
) -> list[TensorJob]:
    """The GGUF tensors in write order; BadInput for a checkpoint tensor that has no GGUF name.

    `extra_rows`: rows appended to the embedding and output head (copies of row `extra_row_source`), for tokens
    the GGUF vocabulary adds after the model's own (core/gguf/vocab.py: byte tokens)."""
    base = TYPES[out_type][0]
    name_map = gguf.get_tensor_name_map(ARCH_ENUM[src.arch], src.n_layers)
    jobs: list[TensorJob] = []
    for key, t in src.tensors.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by every runtime
        if key == "lm_head.weight" and src.tied:
            continue  # tied: llama.cpp and transformers reuse token_embd
        stem, _, suffix = key.rpartition(".")
        name = name_map.get_name(stem)
        if name is None:
            raise BadInput(f"Tensor {key} has no GGUF counterpart for {src.hf_arch}.")
        name = f"{name}.{suffix}"
        heads = 0
        if src.permute_qk and not skip_qk_permute:
            if stem.endswith("self_attn.q_proj"):
                heads = src.n_head
            elif stem.endswith("self_attn.k_proj"):
                heads = src.n_kv_head
        shape = t.shape
        extra = extra_rows if name in VOCAB_ROWS else 0
        if extra:
            shape = (shape[0] + extra, *shape[1:])
        job = TensorJob(name, _weight_type(name, shape, base, src.tied), shape, t, heads)
        job.extra_rows, job.extra_row_source = extra, extra_row_source
        jobs.append(job)
    if not src.tied and not any(j.name == "output.weight" for j in jobs):
        raise BadInput(
            "The config says the embeddings are not tied, but the checkpoint has no lm_head.weight."
        )
    if src.rope_parameters.get("rope_type") == "llama3":
        factors = llama3_rope_factors(src)
        jobs.append(TensorJob("rope_freqs.weight", Q.F32, factors.shape, data=factors))

    def order(j: TensorJob):
        # token_embd, blk.0 ... blk.N, then the rest: the order llama.cpp's converter writes
        parts = j.name.split(".")
        if parts[0] == "blk":
            return (1, int(parts[1]), j.name)
        return (0 if parts[0] == "token_embd" else 2, 0, j.name)

    return sorted(jobs, key=order)


def permute_rows(rows, n_head: int):
    """llama.cpp's `LlamaModel.permute` on a block of whole heads (torch or numpy, 2-D or 1-D).

    HF stores each head's rotary pairs as two halves; GGML's rope wants them interleaved.
    """
    shape = rows.shape
    return rows.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def encode(block, qtype: Q, key: str) -> np.ndarray:
    """A torch row block -> the bytes GGUF stores for it (as a numpy array)."""
    import torch

    if qtype in (Q.F16, Q.BF16, Q.F32):
        # torch converts in one pass; a value that turns infinite was NaN/inf already or is out of range.
        out = block.to(
            {Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.F32: torch.float32}[qtype]
        ).contiguous()
        if not bool(torch.isfinite(out).all()):
            if not bool(torch.isfinite(block).all()):
                raise ValueError(
                    f"Tensor {key} contains NaN or infinite values; the source checkpoint is broken."
                )
            raise ValueError(f"Tensor {key} has values beyond float16's range; export as bf16 instead.")
        return out.view(torch.int16).numpy() if qtype == Q.BF16 else out.numpy()
    arr = block.to(torch.float32).contiguous().numpy()
    if not np.isfinite(arr).all():
        raise ValueError(f"Tensor {key} contains NaN or infinite values; the source checkpoint is broken.")
    return gguf.quants.quantize(arr, qtype)


def encoded_blocks(job: TensorJob) -> Iterator[np.ndarray]:
    """The tensor's GGUF bytes in row blocks, read from a fresh memory map that is closed afterwards."""
    if job.src is None:
        yield job.data.astype(np.float32)
        return
    from safetensors import safe_open

    rows = job.shape[0] - job.extra_rows
    cols = math.prod(job.shape[1:]) if len(job.shape) > 1 else 1
    unit = rows // job.permute_heads if job.permute_heads else 1  # permute whole heads only
    step = max(unit, (CHUNK_BYTES // (4 * cols)) // unit * unit)
    # One map per tensor: pages touched through it leave the process's RSS when it closes.
    with safe_open(str(job.src.file), framework="pt") as f:
        sl = f.get_slice(job.src.key)
        for start in range(0, rows, step):
            block = sl[start : min(rows, start + step)]
            if job.permute_heads:
                block = permute_rows(block, (block.shape[0]) // unit)
            yield encode(block, job.qtype, job.src.key)
            del block
        if job.extra_rows:
            row = sl[job.extra_row_source : job.extra_row_source + 1]
            yield encode(row.expand(job.extra_rows, *row.shape[1:]).contiguous(), job.qtype, job.src.key)
