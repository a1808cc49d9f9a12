"""JetMoE's layer (transformers 5.25 models/jetmoe/modeling_jetmoe.py: JetMoeDecoderLayer, JetMoeAttention,
JetMoeMoA, JetMoeMoE, JetMoeTopKGating, JetMoeParallelExperts), from its code: what autograd saves for backward, the
forward's temporaries and backward's gradients. Its attention is a mixture of experts too, so the whole layer is
planned here; core.estimate.moe_terms dispatches to it (core.estimate.moe.SPLIT_LINEAR).

What a layer runs for T tokens, E experts, top-k k (S = T x k routed pairs), hidden h, attention experts a wide
(kv_channels x num_key_value_heads), MLP experts w wide, k x num_key_value_heads heads of kv_channels:
- each of its two routers (JetMoeTopKGating, the attention's and the MLP's): an nn.Linear `layer` (h -> E, the one
  Linear all-linear adapts there), `.float()`, top-k (its indices saved), softmax over the k in fp32 (saved),
  `.type_as(hidden_states)`; the pairs sorted by expert (`sort`: its indices, saved by the gathers and the
  scatters) and `div` by k (each pair's token, `batch_index`, saved likewise); the gates gathered per pair
  (`batch_gates`, saved by the multiply that weighs the outputs). The fp32 logits are returned, for the
  load-balancing loss TRL never turns on here (the config names its weight aux_loss_coef, not
  router_aux_loss_coef).
- the experts (JetMoeParallelExperts): the routed pairs split per expert, one F.linear per expert, torch.cat. A
  frozen expert weight keeps no input (LoRA cannot wrap these 3-D weights through all-linear), so a linear's
  output is saved only where the next op needs it: the MLP's gate_up output (`chunk`: silu keeps the gate, the
  multiply the up, both views of it) and silu's output; the output experts' result (kept by `* batch_gates`) and
  the weighted result (kept by `index_add`, whose autograd formula reads its source).
- the attention (JetMoeAttention): the query experts' output scattered back per pair (`index_add`, its source
  kept), kv_proj (an nn.Linear, 2 x a), RoPE, then K and V `repeat`ed k times (copies, one per query head group);
  sdpa keeps q, the repeated K and V, its output and the log-sum-exp (eager: the fp32 probabilities and their
  cast); the output gathered per pair into the output experts, weighed and summed back like the MLP's.
transformers refuses gradient checkpointing on JetMoE (JetMoePreTrainedModel.supports_gradient_checkpointing is
False: Trainer's activation_checkpointing_enable raises before the first step): a plan with it is counted as asked
(every layer's input kept, one layer recomputed) and says so (`checkpointing_warning`).
"""

from __future__ import annotations

from core.estimate.activation_terms import (
    LayerTerms,
    checkpointing_on,
    outside_layers_saved_bytes,
    step_dtypes,
)
from core.estimate.moe import MoeFacts
from core.estimate.plan import DTYPE_BYTES, Plan, PlanError

_ATTENTION = ".self_attention."  # the module paths of JetMoeDecoderLayer's two blocks
_MLP = ".mlp."


def checkpointing_warning(spec, facts: MoeFacts, plan: Plan) -> str:
    """The plan's warning when it asks for gradient checkpointing on a model transformers cannot checkpoint."""
    if not (checkpointing_on(plan) and not facts.checkpointing):
        return ""
    return (
        f"transformers cannot checkpoint {spec.model_type} (its supports_gradient_checkpointing is False: the "
        "trainer's activation_checkpointing_enable raises before the first step), so train it with "
        "training.gradient_checkpointing: false and plan that (--no-gradient-checkpointing); this plan counts "
        "the checkpointed step as asked."
    )


def jetmoe_refusals(spec, facts: MoeFacts, plan: Plan, targets) -> None:
    """PlanError for what this plan does not count: LoRA on JetMoE's experts."""
    if any(s.experts for s in targets):
        raise PlanError(
            f"{spec.model_type}: LoRA on its experts (target_parameters) is not planned yet: its 3-D expert weights "
            "run a forward of their own (one matmul per expert); leave target_parameters empty (all-linear adapts "
            "kv_proj and the routers)."
        )


def _mm_bytes(plan: Plan) -> int:
    """Bytes of an expert matmul's output: F.linear runs in the compute dtype under autocast, else in the weight's
    (fp32 after peft's kbit preparation, which upcasts every weight left out of 4-bit)."""
    d = step_dtypes(plan)
    if d.autocast:
        return DTYPE_BYTES[plan.compute_dtype]
    return 4 if plan.tuning == "qlora" and plan.prepare_kbit else DTYPE_BYTES[plan.load_dtype]


def _router(saved: dict, name: str, k: int, gates: int) -> None:
    """JetMoeTopKGating's saved tensors per token (its Linear's are LayerTerms')."""
    saved[f"{name}.topk_indices"] = k * 8
    saved[f"{name}.softmax"] = k * 4  # softmax over the k fp32 logits
    saved[f"{name}.sorted_pairs"] = k * 8  # index_sorted_experts (sort's indices)
    saved[f"{name}.batch_index"] = k * 8  # each pair's token
    saved[f"{name}.gates"] = k * gates  # batch_gates, kept by `expert_outputs * batch_gates[:, None]`


def jetmoe_layer(spec, facts: MoeFacts, plan: Plan, targets, tokens: int) -> dict[str, int]:
    """Bytes one JetMoE decoder layer saves for backward for `tokens` tokens, by tensor (a middle layer: its input
    needs a gradient)."""
    d = step_dtypes(plan)
    m, g = _mm_bytes(plan), d.hidden
    weighted = max(m, g)  # the experts' output times the gates (type_as(hidden_states)): promoted
    k, a, w, h = facts.top_k, facts.attention_width, facts.width, spec.hidden_size
    q_width = spec.num_heads * spec.head_dim  # k x a: each pair's query is one group of heads
    full = plan.tuning == "full"
    t = LayerTerms(spec, plan, [s for s in targets if _ATTENTION in s.name])
    t.norm("input_layernorm")
    t.linear_input("attention_router", h, g, "attn_norm_out", leaf="layer")
    t.linear_input("kv_proj", h, g, "attn_norm_out")
    saved = t.saved
    _router(saved, "attention_router", k, g)
    saved["moa.query_experts_out"] = k * a * m  # index_add's source (JetMoeMoA.map)
    p = d.attn
    saved["moa.q_rotary"] = q_width * p
    saved["moa.k_repeated"] = q_width * p  # key_states.repeat(1, top_k, 1, 1): a copy
    saved["moa.v_repeated"] = q_width * p
    if plan.attn == "eager":
        saved["moa.attn_probs_fp32"] = spec.num_heads * plan.seq_len * 4
        if p != 4:
            saved["moa.attn_probs_cast"] = spec.num_heads * plan.seq_len * p
    else:
        saved["moa.attn_out"] = q_width * p
        saved["moa.attn_logsumexp"] = spec.num_heads * 4
    saved["moa.output_experts_out"] = k * h * m  # kept by the multiply with the gates (JetMoeMoA.reduce)
    saved["moa.weighted_out"] = k * h * weighted  # index_add's source
    # the expert weights train (full fine-tuning): each F.linear keeps its input (autocast's copy if it casts)
    if full:
        saved["moa.query_experts_in"] = k * h * m
        saved["moa.output_experts_in"] = k * a * m
    mlp = LayerTerms(spec, plan, [s for s in targets if _MLP in s.name])
    mlp.norm("post_attention_layernorm")
    mlp.linear_input("router", h, g, "mlp_norm_out", leaf="layer")
    saved.update(mlp.saved)
    _router(saved, "router", k, g)
    # chunk's two views of it: silu keeps the gate, the multiply the up
    saved["experts.gate_up_out"] = k * (2 if facts.gated else 1) * w * m
    saved["experts.act_gate"] = k * w * m  # silu's output, kept by the multiply
    saved["experts.down_out"] = k * h * m  # output_linear's, kept by the multiply with the gates
    saved["experts.weighted_out"] = k * h * weighted  # index_add's source
    if full:
        saved["experts.input"] = k * h * m
        saved["experts.product"] = k * w * m
    out = {name: int(v * tokens) for name, v in saved.items()}
    if d.autocast and DTYPE_BYTES[plan.load_dtype] == 4:
        # each expert's F.linear casts weight[i] to the compute dtype and keeps the copy for its input's gradient
        per_layer = facts.expert_params // max(facts.moe_layers, 1)
        out["experts.autocast_weights"] = per_layer * DTYPE_BYTES[plan.compute_dtype]
    return out


def _first_layer_unsaved(layer: dict[str, int], targets) -> int:
    """What layer 0 does not save when its input (the frozen embedding's output) needs no gradient: its input norm
    and the query experts' output; with nothing adapted in its attention, the whole attention block and what the
    MLP computes from its output before the gates (only the routers' adapters make anything there need one)."""
    if any(f".0{_ATTENTION}" in s.name for s in targets):
        skip = ("input_layernorm.", "moa.query_experts_out")
    else:
        skip = ("input_layernorm.", "attention_router.", "kv_proj.", "moa.", "post_attention_layernorm.")
        skip += ("experts.gate_up_out", "experts.act_gate")
    return sum(v for name, v in layer.items() if name.startswith(skip))


def jetmoe_activation_bytes(spec, facts: MoeFacts, plan: Plan, targets, tokens: int) -> tuple[int, int, int]:
    """(saved activations alive at the end of forward, one layer recomputed in backward with checkpointing, 0) of a
    JetMoE model, as core.estimate.activation_terms.activation_bytes gives them for the other families."""
    jetmoe_refusals(spec, facts, plan, targets)
    layer = jetmoe_layer(spec, facts, plan, targets, tokens)
    per_layer = sum(layer.values())
    outside = int(tokens * outside_layers_saved_bytes(spec, plan))
    if checkpointing_on(plan):  # as asked, though transformers refuses it today (checkpointing_warning)
        inputs = spec.num_layers * tokens * spec.hidden_size * step_dtypes(plan).hidden
        return inputs + outside, per_layer, 0
    # the embedding's output needs a gradient only when the embedding trains (full fine-tuning)
    first = 0 if plan.tuning == "full" else _first_layer_unsaved(layer, targets)
    return spec.num_layers * per_layer - first + outside, 0, 0


def jetmoe_forward_temporaries(spec, facts: MoeFacts, plan: Plan, tokens: int) -> int:
    """Bytes alive beside the saved tensors while the last layer's MLP experts run, not saved: the residual stream
    (the layer's input, `residual`, the model's inputs_embeds) and the norm's output, the router's fp32 logits
    (returned, alive until JetMoeMoE.forward returns), the gathered pairs (`expert_inputs`, a local), and the
    larger of input_linear's per-expert outputs before torch.cat joins them and, at output_linear's cat, the
    gated product and the per-expert outputs."""
    d = step_dtypes(plan)
    m, g = _mm_bytes(plan), d.hidden
    k, w, h = facts.top_k, facts.width, spec.hidden_size
    stream = (4 if spec.num_layers > 1 else 3) * h * g
    up = (2 if facts.gated else 1) * w
    gathered = 0 if plan.tuning == "full" else k * h * g  # a full fine-tune saves it (experts.input)
    per_token = stream + facts.experts * 4 + gathered + max(k * up * m, k * w * m + k * h * m)
    # the last layer's weighted output, counted among the saved tensors, is made only after these
    return int(tokens * (per_token - k * h * max(m, g)))


def jetmoe_backward_peak(spec, facts: MoeFacts, plan: Plan, tokens: int) -> int:
    """Bytes alive beyond the saved tensors while backward goes through one JetMoE MLP block, the largest of its
    stages: output_linear's (the gradient of the weighted output, the per-expert input gradients and their
    concatenation by split's backward), the gate's (the product's, silu's and up's gradients and chunk's
    concatenation of them) and input_linear's (the gate_up gradient, the per-expert input gradients and their
    concatenation)."""
    m, g = _mm_bytes(plan), step_dtypes(plan).hidden
    k, w, h = facts.top_k, facts.width, spec.hidden_size
    up = (2 if facts.gated else 1) * w
    down = k * h * max(m, g) + 2 * k * w * m
    gate = 4 * k * w * m
    gate_up = k * (up + 2 * h) * m
    return int(tokens * max(down, gate, gate_up))
