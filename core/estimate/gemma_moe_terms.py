"""Gemma 4's mixture-of-experts layer (transformers 5.25 models/gemma4/modeling_gemma4.py, config enable_moe_block:
Gemma4TextDecoderLayer, Gemma4TextRouter, Gemma4TextExperts): what its router saves beyond what core.estimate.moe_terms
bills for every MoE family. The rest of the layer is moe_terms' own:

- the experts (Gemma4TextExperts, decorated with `use_experts_implementation`: fused 3-D gate_up_proj / down_proj,
  transformers' grouped forward, top_k_experts of num_experts per token), which peft's target_parameters wraps as
  it wraps every family's;
- the dense MLP (`mlp`, gate / up / down) the layer runs beside the experts on every token: a shared expert
  (core.estimate.moe reads its width), its output normed by post_feedforward_layernorm_1, the experts' input by
  pre_feedforward_layernorm_2 and their output by post_feedforward_layernorm_2, the two summed and normed by
  post_feedforward_layernorm -- every norm a module of the layer, counted with its norms;
- the router: RMSNorm of the residual (no weight), `* scale * hidden**-0.5` (a frozen parameter: the multiply keeps
  only it), `proj` (an nn.Linear hidden -> experts), softmax over every expert in fp32, top-k, the top-k weights
  renormalised in place (`/= sum`) -- moe_terms' softmax_topk router, renormalising.

What this module adds, from that code: LoRA on `router.proj` (all-linear takes it: an nn.Linear returning a tensor)
keeps its input like any adapted Linear; and `top_k_weights * self.per_expert_scale[top_k_index]` keeps the gathered
scales (tokens x top-k, in the weights' dtype) for the routing weights' gradient."""

from __future__ import annotations

from core.estimate.moe import moe_of
from core.estimate.plan import DTYPE_BYTES


def router_saved(t) -> None:
    """Add, per token, what one Gemma 4 MoE layer's router keeps beyond moe_terms' router (`t`: a LayerTerms of the
    layer, core.estimate.activation_terms)."""
    facts = moe_of(t.spec)
    if facts is None:
        return
    # the router's input: RMSNorm(residual) * scale * hidden**-0.5, a tensor of its own in the stream's dtype
    t.linear_input("router.proj", t.spec.hidden_size, t.d.hidden, "router_input", "proj")
    t.saved["router.per_expert_scale"] = facts.top_k * DTYPE_BYTES[t.plan.load_dtype]
