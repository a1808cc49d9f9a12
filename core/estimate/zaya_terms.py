"""ZAYA's layer (transformers 5.25 models/zaya/modeling_zaya.py: ZayaDecoderLayer, ZayaAttention, ZayaCCAProjection,
ZayaQKNorm, ZayaRouter, ZayaRouterMLP, ZayaExperts), from its code: what autograd saves for backward. Its attention
and its router are its own, so the whole layer is planned here; the experts use transformers' grouped implementation
(core.estimate.moe_terms builds their terms, as for every such family). core.estimate.moe_terms dispatches to it
(MoeFacts.router_hidden > 0).

What a layer runs for T tokens (rows of L), hidden h, q = heads x head_dim, kv = kv_heads x head_dim, router width R:
- the residual stream is fp32 between layers (`residual_in_fp32`): each RMSNorm reads `residual.to(weight dtype)`
  and upcasts it (its fp32 copy and rstd saved); ZayaResidualScaling's frozen scales and biases save nothing.
- compressed convolutional attention (ZayaCCAProjection): q_proj and k_proj (their LoRA inputs, as any Linear's),
  cat, padded by cca_time0 - 1 + cca_time1 - 1 positions (the padded q + k, kept by the depthwise conv), the
  depthwise conv's output (kept by the grouped conv); the query and key with their residual paths added (kept by
  the L2 normalisation, ZayaQKNorm: the norm, its reciprocal and the scale factor per head, each kept); the value
  half from this token (v_proj_current) and half from the previous one (v_proj_delayed, also run on one zero
  position per row); RoPE on part of the head (cat: q and k as sdpa keeps them), sdpa's q, k, v, output and
  log-sum-exp, o_proj's input.
- the router (ZayaRouter): down_proj to R, the previous layer's router state added through a frozen scale (nothing
  saved), an RMSNorm over R, fc1 and fc2 each followed by GELU (which keeps their outputs), out_proj to the experts
  and one skip class, a softmax over them (kept); top-k (its indices kept by the gather) and the skip mask (kept by
  masked_fill). A pair that picks the skip class runs expert 0 with weight 0: the grouped experts run all T x k.
"""

from __future__ import annotations

import json

from core.estimate.activation_terms import (
    LayerTerms,
    checkpointing_on,
    first_layer_unsaved,
    outside_layers_saved_bytes,
    step_dtypes,
)
from core.estimate.moe import MoeFacts
from core.estimate.plan import DTYPE_BYTES, Plan, packed_sequences


def _cca_kernels(spec) -> tuple[int, int]:
    config = json.loads(spec.config_json)
    config = config.get("text_config") or config
    return int(config.get("cca_time0") or 2), int(config.get("cca_time1") or 2)


def zaya_layer(spec, facts: MoeFacts, plan: Plan, targets, tokens: int, experts: dict) -> dict[str, int]:
    """Bytes one ZAYA decoder layer saves for `tokens` tokens, by tensor; `experts`: the grouped experts' terms
    (core.estimate.moe_terms.moe_layer's "experts.*" tensors)."""
    d = step_dtypes(plan)
    g, p, pa = d.hidden, d.proj, d.attn
    h, heads, kv_heads, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, kv, r, k = heads * hd, kv_heads * hd, facts.router_hidden, facts.top_k
    length = max(int(plan.seq_len), 1)
    t0, t1 = _cca_kernels(spec)
    pad = (t0 - 1) + (t1 - 1)
    t = LayerTerms(spec, plan, targets)
    t.norm("input_layernorm")
    for m in ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed"):
        t.linear_input(m, h, g, "attn_norm_out")
    saved = t.saved
    # v_proj_delayed runs once more per row on a zero position: its LoRA input copy and lora_A's output
    if "v_proj_delayed" in t.adapted:
        saved["cca.v_state_lora"] = (h * t.ad + plan.lora_r * t.lora_bytes) / length
    saved["cca.padded_qk"] = (q + kv) * p * (length + pad) / length  # kept by conv_qk_depthwise
    saved["cca.depthwise_out"] = (q + kv) * p * (length + pad - (t0 - 1)) / length  # kept by conv_qk_grouped
    saved["cca.query"] = q * p  # with its residual path: kept by ZayaQKNorm's norm and multiply
    saved["cca.key"] = kv * p
    saved["cca.qk_norm_stats"] = 3 * (heads + kv_heads) * p  # the norm, its reciprocal, the scale factor
    repeat = plan.attn == "eager" or (plan.attn == "sdpa" and packed_sequences(plan) and kv < q)
    saved["cca.q_rotary"] = q * pa
    saved["cca.k_rotary"] = (q if repeat else kv) * pa  # repeat_kv's copies where the kernel gets them
    saved["cca.v"] = (q if repeat else kv) * pa
    if plan.attn == "eager":
        saved["cca.probs_fp32"] = heads * length * 4
        if pa != 4:
            saved["cca.probs_cast"] = heads * length * pa
    else:
        saved["cca.out"] = q * pa
        saved["cca.logsumexp"] = heads * 4
    # o_proj reads the output's `transpose(1, 2).contiguous()` copy (sdpa_attention_forward), not sdpa's own
    t.linear_input("o_proj", q, pa, "cca.out_contiguous")
    t.norm("post_attention_layernorm")
    t.linear_input("router.down_proj", h, g, "mlp_norm_out", leaf="down_proj")
    t.norm("router.norm", r)
    t.linear_input("router.fc1", r, p, "router.norm_out", leaf="fc1")
    saved["router.fc1_out"] = r * p  # kept by GELU
    t.linear_input("router.fc2", r, p, "router.gelu1_out", leaf="fc2")
    saved["router.fc2_out"] = r * p
    t.linear_input("router.out_proj", r, p, "router.gelu2_out", leaf="out_proj")
    saved["router.softmax"] = (facts.experts + 1) * p  # over the experts and the skip class
    saved["router.topk_indices"] = k * 8
    saved["router.skip_mask"] = k  # bool
    out = {name: int(v * tokens) for name, v in saved.items()}
    out.update({name: v for name, v in experts.items() if name.startswith("experts.")})
    out["experts.routing_weights"] = tokens * k * p  # gathered from a softmax in the logits' dtype
    # under autocast over fp32 weights the convs' 16-bit weight copies, kept for their input's gradient
    if d.autocast and DTYPE_BYTES[plan.load_dtype] == 4:
        channels = q + kv
        out["cca.autocast_conv_weights"] = DTYPE_BYTES[plan.compute_dtype] * (
            channels * t0 + channels * channels // (heads + kv_heads) * t1 + 2 * channels
        )
    return out


def zaya_activation_bytes(
    spec, facts: MoeFacts, plan: Plan, targets, tokens: int, experts: dict
) -> tuple[int, int, int]:
    """(saved activations alive at the end of forward, one layer recomputed in backward with checkpointing, 0), as
    core.estimate.activation_terms.activation_bytes gives them for the other families: with checkpointing each
    layer keeps its inputs, the fp32 residual stream and (past the first) the router state the layer before passed."""
    layer = zaya_layer(spec, facts, plan, targets, tokens, experts)
    per_layer = sum(layer.values())
    outside = int(tokens * outside_layers_saved_bytes(spec, plan))
    if checkpointing_on(plan):
        n = spec.num_layers
        inputs = tokens * (n * spec.hidden_size * 4 + (n - 1) * facts.router_hidden * step_dtypes(plan).proj)
        return inputs + outside, per_layer, 0
    # layer 0's input (the frozen embedding's, scaled) needs no gradient: its input norm saves nothing
    first = 0 if plan.tuning == "full" else int(first_layer_unsaved(layer, targets))
    return spec.num_layers * per_layer - first + outside, 0, 0
