"""Granite 4.0-H's MoE block (transformers 5.25 models/granitemoehybrid/modeling_granitemoehybrid.py:
GraniteMoeHybridMoE, GraniteMoeHybridTopKRouter, GraniteMoeHybridExperts, GraniteMoeHybridMLP), from its code: the
router's saved tensors. core.estimate.moe_terms builds the rest of the layer, as for every other family whose experts
use transformers' shared implementation.

What the block runs for T tokens, E experts, top-k k (S = T x k routed pairs):
- the router (a bare weight, not an nn.Linear): `F.linear(x, weight).float()` -- the logits T x E in the
  projections' dtype, cast to an fp32 copy (the cast's backward keeps nothing; a frozen weight keeps no input);
  top-k of the fp32 logits (its indices T x k saved for the scatter of the gradient back); softmax over those k in
  fp32 (its output T x k saved); `.type_as(hidden_states)`: the routing weights in the residual stream's dtype.
  The router returns the fp32 logits, which TRL's load-balancing loss collects: they stay alive until the forward
  ends, and its softmax of them is saved (fp32).
- the experts: GraniteMoeHybridExperts is decorated with `use_experts_implementation` (transformers 5.25 replaced
  the GraniteMoeHybridParallelExperts / TopKGating pair of earlier releases with it): 3-D gate_up_proj / down_proj,
  the grouped forward every other family runs (core.estimate.moe_terms), the routing weights gathered per pair in
  their own dtype. peft's target_parameters wraps them as it wraps every family's (ParamWrapper).
- the shared MLP `shared_mlp` (input_linear, a fused gate and up, then output_linear) sits beside the block in the
  layer and sees every token: a dense SwiGLU MLP of shared_intermediate_size (core.estimate.moe reads its width).
"""

from __future__ import annotations

from core.estimate.activation_terms import step_dtypes
from core.estimate.moe import MoeFacts
from core.estimate.plan import Plan

FP32_TOPK_SOFTMAX = "fp32_topk_softmax"


def granite_router(facts: MoeFacts, plan: Plan, tokens: int) -> dict[str, int]:
    """Saved bytes by tensor of Granite's router for `tokens` tokens, and the routing weights the grouped experts
    keep (gathered per pair, in the residual stream's dtype after `type_as`)."""
    k = facts.top_k
    return {
        "router.topk_indices": tokens * k * 8,
        "router.softmax": tokens * k * 4,  # over the k fp32 logits
        "experts.routing_weights": tokens * k * step_dtypes(plan).hidden,
    }
