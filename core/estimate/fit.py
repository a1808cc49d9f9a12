"""The fit search: the largest batch size and sequence length a plan's card holds, and memory curves."""

from __future__ import annotations

from dataclasses import replace

from core.estimate.bill import estimate
from core.estimate.plan import FIT_LIMIT, Plan, validate
from core.estimate.specs import ModelSpec, load_spec


def largest(plan: Plan, spec: ModelSpec, name: str, hi: int, step: int = 1, limit: float = FIT_LIMIT) -> int:
    """The largest value of `name` (a multiple of `step`, <= hi) whose device total stays within `limit` of the
    card; 0 if none."""

    def ok(v: int) -> bool:
        e = estimate(replace(plan, **{name: v, "batch_tokens": 0}), spec)
        return e.device_total_bytes <= limit * e.gpu_bytes

    lo_units, hi_units = 0, hi // step  # invariant: lo fits (0 = nothing), hi+1 does not
    if not ok(step):
        return 0
    lo_units = 1
    while lo_units < hi_units:
        mid = (lo_units + hi_units + 1) // 2
        if ok(mid * step):
            lo_units = mid
        else:
            hi_units = mid - 1
    return lo_units * step


def fit_search(plan: Plan, spec: ModelSpec | None = None, limit: float = FIT_LIMIT) -> dict:
    """The largest batch size (at this seq len) and seq len (at this batch size) that stay within `limit` of the
    card (90%: the verdict's "fits"), both at the max_length bound (every row full)."""
    validate(plan)
    spec = spec or load_spec(plan.model)
    max_seq = max(spec.max_position_embeddings or 0, plan.seq_len)
    batch = largest(plan, spec, "batch_size", 4096, limit=limit)
    seq = largest(plan, spec, "seq_len", max_seq, step=64 if max_seq >= 64 else 1, limit=limit)
    out = {"max_batch_size": batch, "max_seq_len": seq, "seq_len_cap": max_seq}
    for key, name, value in (("batch_fraction", "batch_size", batch), ("seq_fraction", "seq_len", seq)):
        out[key] = (
            estimate(replace(plan, **{name: value, "batch_tokens": 0}), spec).fraction if value else None
        )
    return out


def memory_curve(plan: Plan, name: str, values: list[int], spec: ModelSpec | None = None) -> list[dict]:
    """Device total (and tensor peak) as `name` (batch_size or seq_len) takes each of `values`."""
    spec = spec or load_spec(plan.model)
    rows = []
    for v in values:
        e = estimate(replace(plan, **{name: v}), spec)
        rows.append(
            {name: v, "device_total_bytes": e.device_total_bytes, "tensor_peak_bytes": e.tensor_peak_bytes}
        )
    return rows
