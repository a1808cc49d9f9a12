"""Autocast's 16-bit copies of fp32 weights in the bill: which weights are fp32 in a step, and how long the copies
that matmuls make under bf16 / fp16 autocast stay alive."""

from __future__ import annotations

from core.estimate.activation_terms import checkpointing_on, step_dtypes
from core.estimate.plan import DTYPE_BYTES, Plan
from core.estimate.specs import ModelSpec
from core.estimate.static_terms import adapter_bytes


def autocast_weight_copies(spec: ModelSpec, plan: Plan, trainable: int) -> tuple[int, int]:
    """(alive at the end of forward, alive at the start of backward): 16-bit copies of fp32 weights that
    matmuls make under bf16/fp16 autocast.

    Which weights are fp32: all of them for an fp32 load; the LoRA adapters (peft keeps them fp32) unless
    TRL cast them to bf16 (QLoRA); with QLoRA and prepare_model_for_kbit_training the lm_head (or the tied
    embedding it reuses) -- but only on the plain path: TRL's fused head casts its weight chunks itself
    (`weight[start:end].to(compute_dtype)`), outside autocast's cache.
    bitsandbytes 4-bit Linears dequantize straight to the compute dtype: no copy.
    How long a copy lives: autocast caches the casts of trainable leaf weights until forward leaves the
    autocast region, and a matmul saves its weight copy for backward unless the layer is checkpointed. So
    inside checkpointed layers the copies are gone when backward starts; the lm_head, outside the layers,
    keeps its copy until its own backward.
    """
    if not step_dtypes(plan).autocast:
        return 0, 0
    head = spec.lm_head_params or spec.embedding_params
    fp32_load = DTYPE_BYTES[plan.load_dtype] == 4
    head_copy = head if (fp32_load or (plan.tuning == "qlora" and plan.prepare_kbit)) else 0
    if plan.fused_lm_head:
        head_copy = 0
    c = DTYPE_BYTES[plan.compute_dtype]
    if plan.tuning != "full":
        trainable_in_layers = trainable if adapter_bytes(plan) != c else 0
    else:
        trainable_in_layers = spec.linear_params if fp32_load else 0
    frozen_in_layers = spec.linear_params if (plan.tuning == "lora" and fp32_load) else 0
    if checkpointing_on(plan):
        return (head_copy + trainable_in_layers) * c, head_copy * c
    both = (head_copy + trainable_in_layers + frozen_in_layers) * c
    return both, both
