"""The fit search: the largest batch size and sequence length a plan's card holds, and memory curves."""

from __future__ import annotations

import math
from dataclasses import replace

from core.estimate.bill import estimate
from core.estimate.plan import FIT_LIMIT, Plan, eval_generations, generates, generation_batch, validate
from core.estimate.specs import ModelSpec, load_spec
from core.estimate.vlm import image_tokens, vlm_of


def image_tokens_per_row(plan: Plan, spec: ModelSpec) -> int:
    """The tokens a VLM row's images take (0 for a language model)."""
    facts = vlm_of(spec)
    return image_tokens(facts, plan).tokens * plan.images_per_row if facts else 0


def resized(plan: Plan, name: str, value: int) -> Plan:
    """`plan` with `name` (batch_size, seq_len, or a generating plan's completion_len) set to `value`, every row
    full. A generating plan (GRPO) keeps its shape: a batch keeps its steps per generation (the generation batch
    follows it), a sequence its prompt (the completion follows it), a completion its prompt."""
    change = {name: value, "batch_tokens": 0}
    if generates(plan):
        prompt = plan.seq_len - plan.completion_len
        if name == "batch_size":
            change["generation_batch"] = value * (generation_batch(plan) // plan.batch_size)
        elif name == "seq_len":
            change["completion_len"] = value - prompt
        elif name == "completion_len":
            change["seq_len"] = prompt + value
    return replace(plan, **change)


def batch_unit(plan: Plan) -> int:
    """The batch sizes a plan can take are multiples of this: a generating plan's generation batch (batch x steps
    per generation x GPUs) must divide by num_generations."""
    if not generates(plan):
        return 1
    steps = generation_batch(plan) // plan.batch_size * plan.gpus
    return plan.num_generations // math.gcd(plan.num_generations, steps)


def eval_unit(plan: Plan) -> int:
    """Eval batch sizes are multiples of this: a generating plan's eval batch (x GPUs) must divide by the
    completions per prompt an evaluation asks for."""
    if not generates(plan):
        return 1
    groups = eval_generations(plan)
    return groups // math.gcd(groups, plan.gpus)


def largest_eval_batch(plan: Plan, spec: ModelSpec | None = None, limit: float = FIT_LIMIT) -> int:
    """The largest per-device eval batch (<= 4096) whose evaluation keeps the plan within `limit` of the card;
    0 when even the smallest does not (or the training step alone does not)."""
    spec = spec or load_spec(plan.model)
    unit = eval_unit(plan)
    return largest(plan, spec, "eval_batch_size", 4096 // unit * unit, step=unit, limit=limit)


def largest(plan: Plan, spec: ModelSpec, name: str, hi: int, step: int = 1, limit: float = FIT_LIMIT) -> int:
    """The largest value of `name` (a multiple of `step`, <= hi) whose device total stays within `limit` of the
    card; 0 if none. A VLM's sequence is searched from the first length its images leave text room in."""

    def ok(v: int) -> bool:
        e = estimate(resized(plan, name, v), spec)
        return e.device_total_bytes <= limit * e.gpu_bytes

    first = max(1, -(-(image_tokens_per_row(plan, spec) + 1) // step)) if name == "seq_len" else 1
    lo_units, hi_units = 0, hi // step  # invariant: lo fits (0 = nothing), hi+1 does not
    if first > hi_units or not ok(first * step):
        return 0
    lo_units = first
    while lo_units < hi_units:
        mid = (lo_units + hi_units + 1) // 2
        if ok(mid * step):
            lo_units = mid
        else:
            hi_units = mid - 1
    return lo_units * step


def fit_search(plan: Plan, spec: ModelSpec | None = None, limit: float = FIT_LIMIT) -> dict:
    """The largest batch size (at this seq len) and seq len (at this batch size) that stay within `limit` of the
    card (90%: the verdict's "fits"), both at the max_length bound (every row full). A generating plan (GRPO):
    the batch in multiples its generation batch allows, and the longest completion after its prompt
    (max_completion_len; max_seq_len is the prompt plus it)."""
    validate(plan)
    spec = spec or load_spec(plan.model)
    max_seq = max(spec.max_position_embeddings or 0, plan.seq_len)
    unit = batch_unit(plan)
    batch = largest(plan, spec, "batch_size", 4096 // unit * unit, step=unit, limit=limit)
    if generates(plan):
        prompt = plan.seq_len - plan.completion_len
        room = max_seq - prompt
        completion = largest(plan, spec, "completion_len", room, step=16 if room >= 16 else 1, limit=limit)
        seq, length = (prompt + completion if completion else 0), ("completion_len", completion)
    else:
        seq = largest(plan, spec, "seq_len", max_seq, step=64 if max_seq >= 64 else 1, limit=limit)
        length = ("seq_len", seq)
    out = {"max_batch_size": batch, "max_seq_len": seq, "seq_len_cap": max_seq}
    if generates(plan):
        out["max_completion_len"] = length[1]
    for key, (name, value) in (("batch_fraction", ("batch_size", batch)), ("seq_fraction", length)):
        out[key] = estimate(resized(plan, name, value), spec).fraction if value else None
    if plan.eval_batch_size:  # a run that evaluates: the largest eval batch next to this training step
        out["max_eval_batch_size"] = largest_eval_batch(plan, spec, limit)
    return out


def memory_curve(plan: Plan, name: str, values: list[int], spec: ModelSpec | None = None) -> list[dict]:
    """Device total (and tensor peak) as `name` (batch_size or seq_len) takes each of `values`."""
    spec = spec or load_spec(plan.model)
    rows = []
    for v in values:
        e = estimate(resized(plan, name, v) if generates(plan) else replace(plan, **{name: v}), spec)
        rows.append(
            {name: v, "device_total_bytes": e.device_total_bytes, "tensor_peak_bytes": e.tensor_peak_bytes}
        )
    return rows


def eval_batch_for_config(cfg: dict, gpu_gb: float, device: str) -> int | None:
    """The largest per_device_eval_batch_size a run of `cfg` (a validated run config) can evaluate with on this
    card without running out of memory at its first evaluation (at least 1: where nothing fits, the verdict says
    so); None for a run that does not evaluate. What the Train form proposes where the config leaves it unset
    (TrainingArguments' 8 is what runs out of memory: Unsloth PR #5168)."""
    from core.estimate.from_config import evaluates, plan_for_config

    if not evaluates(cfg):
        return None
    plan = plan_for_config(cfg, gpu_gb, device)
    return max(largest_eval_batch(plan), eval_unit(plan))
