"""The delta math: each merged weight computed in fp32 from the base rows and the adapter, rounded once.

LoRA/rsLoRA (scale from the adapter), DoRA (per-output-feature norm), GPT-2 Conv1D (stored transposed),
embedding LoRA (transposed delta), lora_bias, and modules_to_save / tied-embedding copies (replacements).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from core.merge.adapter import LoraModule
from core.merge.errors import MergeError
from core.merge.mapping import TensorPlan
from core.merge.shards import MB, ST_DTYPES, BaseCheckpoint, tensor_bytes

# Rows are processed in blocks of at most this many fp32 bytes: a 128k x 8k embedding (~4 GB in fp32) never
# materialises whole.
CHUNK_BYTES = 256 * MB


def _add_delta_(w: torch.Tensor, mod: LoraModule, start: int, stop: int) -> torch.Tensor:
    """Add rows [start, stop) of the scaled LoRA delta to `w` (fp32, stored orientation), in place: one fused
    matmul-add, no full-size temporary."""
    if mod.kind == "param":  # a wrapped parameter's rows (core.merge.experts)
        return w.add_(mod.rows(start, stop).to(w.device))
    A, B = mod.A.to(w.device), mod.B.to(w.device)
    if mod.kind == "linear":
        return w.addmm_(B[start:stop], A, alpha=mod.scale)  # W (out, in) += s * B A
    # Conv1D stores W^T; embedding LoRA is applied as A^T B^T
    return w.addmm_(A[:, start:stop].T, B.T, alpha=mod.scale)


def merged_blocks(plan: TensorPlan, base: BaseCheckpoint, device="cpu") -> Iterator[torch.Tensor]:
    """The output tensor as row blocks in the output dtype (fp32 math, one rounding)."""
    out_dtype = ST_DTYPES[plan.out_code]
    rows = plan.shape[0] if plan.shape else 1
    row_elems = math.prod(plan.shape[1:]) if plan.shape else 1
    mod = plan.lora
    whole = (
        mod is not None and mod.magnitude is not None and mod.kind == "conv1d"
    )  # DoRA norm is per column here
    step = rows if whole else max(1, CHUNK_BYTES // max(1, row_elems * 4))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if plan.replacement is not None:
            w = plan.replacement[start:stop] if plan.shape else plan.replacement
            # a copy: the in-place add below must never touch the adapter's own tensor
            w = w.to(device=device, dtype=torch.float32, copy=True)
        else:
            w = base.read_rows(plan.src_key, start, stop).to(device=device, dtype=torch.float32)
        if mod is not None:
            w = _add_delta_(w, mod, start, stop)
            if mod.magnitude is not None:  # DoRA: W' = m / ||W + dW|| (per output feature) * (W + dW)
                mag = mod.magnitude.to(device)
                if mod.kind == "linear":
                    w = w * (mag[start:stop] / torch.linalg.norm(w, dim=1)).unsqueeze(1)
                else:
                    w = w * (mag / torch.linalg.norm(w, dim=0)).unsqueeze(0)
        if plan.bias_of is not None:
            w = w + plan.bias_of.bias.to(device)[start:stop] * plan.bias_of.scale
        # Inputs were checked to be finite (adapter at load); only fp16 can overflow on the way out.
        if out_dtype == torch.float16 and w.abs().max().item() > torch.finfo(torch.float16).max:
            raise MergeError(
                f"The merged tensor {plan.out_key} overflows float16: export with --dtype bf16 or fp32."
            )
        yield w.to(out_dtype).to("cpu")


def tensor_stream(plan: TensorPlan, base: BaseCheckpoint, device) -> Iterator[memoryview | bytes]:
    src = base.tensors[plan.src_key]
    if not plan.changed and src.code == plan.out_code:
        yield from base.raw_blocks(plan.src_key)  # unchanged: copy the stored bytes
    else:
        for block in merged_blocks(plan, base, device):
            yield tensor_bytes(block)


def recompute_rows(t: TensorPlan, base: BaseCheckpoint, start: int, stop: int) -> torch.Tensor:
    """Expected output rows [start, stop), recomputed from the base and the adapter (not from the written file)."""
    if t.lora is not None and t.lora.magnitude is not None and t.lora.kind == "conv1d":
        return next(merged_blocks(t, base))[start:stop].float()  # DoRA on Conv1D needs whole columns
    if t.replacement is not None:
        w = (t.replacement[start:stop] if t.shape else t.replacement).float()
    else:
        w = base.read_rows(t.src_key, start, stop).float()
    if t.lora is not None and t.lora.kind == "param":
        w = w.clone() + t.lora.rows(start, stop)
    elif t.lora is not None:
        w = (
            w.clone()
            + (
                t.lora.B[start:stop] @ t.lora.A
                if t.lora.kind == "linear"
                else t.lora.A[:, start:stop].T @ t.lora.B.T
            )
            * t.lora.scale
        )
        if t.lora.magnitude is not None:
            w = w * (t.lora.magnitude[start:stop] / torch.linalg.norm(w, dim=1)).unsqueeze(1)
    if t.bias_of is not None:
        w = w + t.bias_of.bias[start:stop] * t.bias_of.scale
    return w.to(ST_DTYPES[t.out_code]).float()
