"""Layers that differ in shape, each planned with its own (Gemma 4): sliding layers with one head_dim and KV head
count, full-attention layers with another (global_head_dim, num_global_key_value_heads) and possibly K = V
(attention_k_eq_v: no v_proj), the last num_kv_shared_layers layers reusing the K/V of an earlier layer (no
k_proj / v_proj / k_norm / v_norm of their own), a per-layer MLP width (use_double_wide_mlp), and per-layer input
embeddings (PLE: a second embedding table plus a projection of the input embeddings, one slice fed to a small
gated block at the end of every layer). Gemma 4's mixture of experts (a router and experts beside the dense MLP:
core.estimate.gemma_moe_terms) and Gemma 3n's text decoder (per-layer MLP widths, AltUp's copies of the hidden
stream, Laurel blocks, activation sparsity: core.estimate.gemma3n_terms) are read the same way.

The shapes are read from the meta model's modules (`shapes_json`, recorded in the spec), not from the config,
whose per-layer fields transformers refuses to give as globals. The terms follow transformers'
models/gemma4/modeling_gemma4.py (Gemma4TextAttention, Gemma4TextDecoderLayer, Gemma4TextModel). A spec of a model
whose layers all share one plain shape records "" and plans exactly as before."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from core.estimate import gemma3n_terms, gemma_moe_terms


@dataclass(frozen=True)
class LayerShape:
    heads: int
    head_dim: int
    kv_heads: int  # 0: the layer reuses an earlier layer's K/V (KV sharing)
    v_proj: bool  # False with K = V (attention_k_eq_v): the values are the key projection's output
    v_norm: bool  # Gemma 4 normalises the values too (an RMSNorm without weight)
    window: int  # the sliding window (0: full attention)
    inter: int  # the MLP's width (0: the spec's intermediate_size)
    ple: int  # the per-layer input's width (0: none)
    store: bool  # transformers keeps this layer's K/V in shared_kv_states for the layers that reuse them
    # (defaults: a spec cached before these fields reads as before)
    router: int = 0  # experts a Linear router of the layer scores beside its dense MLP (Gemma 4 MoE), 0: none
    altup: int = 0  # copies of the hidden stream AltUp keeps (Gemma 3n's altup_num_inputs), 0: none
    laurel: int = 0  # the Laurel block's rank (Gemma 3n), 0: none
    sparse: bool = False  # the MLP's gate goes through a gaussian top-k first (activation_sparsity > 0)
    coef_clip: bool = False  # AltUp clamps correction_coefs' weight in training: its LoRA never runs

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def _shape(layer) -> LayerShape | None:
    attn = getattr(layer, "self_attn", None)
    q = getattr(attn, "q_proj", None)
    head_dim = getattr(attn, "head_dim", None)
    if q is None or not head_dim or not hasattr(q, "out_features"):
        return None
    k, v = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
    gate = getattr(getattr(layer, "mlp", None), "gate_proj", None)
    ple = getattr(layer, "per_layer_input_gate", None)
    router = getattr(getattr(layer, "router", None), "proj", None)
    altup = getattr(getattr(layer, "altup", None), "correction_coefs", None)
    laurel = getattr(getattr(layer, "laurel", None), "linear_left", None)
    return LayerShape(
        heads=q.out_features // head_dim,
        head_dim=head_dim,
        kv_heads=k.out_features // head_dim if k is not None else 0,
        v_proj=v is not None,
        v_norm=getattr(attn, "v_norm", None) is not None,
        window=int(getattr(attn, "sliding_window", None) or 0),
        inter=gate.out_features if gate is not None else 0,
        ple=ple.out_features if ple is not None else 0,
        store=bool(getattr(attn, "store_full_length_kv", False)),
        router=getattr(router, "out_features", 0),
        altup=getattr(altup, "in_features", 0),
        laurel=getattr(laurel, "out_features", 0),
        sparse=float(getattr(getattr(layer, "mlp", None), "activation_sparsity", 0) or 0) > 0,
        coef_clip=altup is not None and layer.altup.config.altup_coef_clip is not None,
    )


def shapes_json(layers) -> str:
    """The spec's record of every layer's shape, or "" when the layers share one plain shape (every model
    before Gemma 4: their plans stay as they were)."""
    shapes = [_shape(layer) for layer in layers]
    if any(s is None for s in shapes):
        return ""
    plain = all(
        s.kv_heads and s.v_proj and not (s.v_norm or s.ple or s.store or s.altup or s.laurel or s.sparse)
        for s in shapes
    )
    if plain and len({(s.heads, s.head_dim, s.kv_heads, s.inter) for s in shapes}) == 1:
        return ""
    return json.dumps([list(s.__dict__.values()) for s in shapes])


@lru_cache(maxsize=64)
def _parse(text: str) -> tuple[LayerShape, ...]:
    return tuple(LayerShape(*row) for row in json.loads(text))


def shapes_of(spec) -> tuple[LayerShape | None, ...]:
    """Every layer's own shape; None for each layer of a model whose layers share the spec's one shape."""
    if getattr(spec, "shapes_json", ""):
        return _parse(spec.shapes_json)
    return (None,) * spec.num_layers


def kv_cache_per_byte(spec) -> int | None:
    """K and V per token per byte of element size over the layers that cache their own (None: no shapes)."""
    if not getattr(spec, "shapes_json", ""):
        return None
    return sum(2 * s.kv_width for s in shapes_of(spec))


def source_kv_heads(spec, shape: LayerShape) -> int:
    """The KV heads of the layer whose K/V a sharing layer reuses: the last storing one of its kind (window)."""
    return next((s.kv_heads for s in reversed(shapes_of(spec)) if s.store and s.window == shape.window), 0)


def sdpa_repeats_kv(t, kv_width: int, q_width: int, head_dim: int, shape: LayerShape) -> bool:
    """transformers' sdpa hands grouped-query attention to torch (enable_gqa) only without a mask and with
    head_dim <= 256 (integrations/sdpa_attention.py use_gqa_in_sdpa); else repeat_kv copies K and V out to every
    query head and sdpa saves the copies."""
    return kv_width < q_width and (sliding_masked(t, shape) or head_dim > 256)


def sliding_masked(t, shape: LayerShape | None) -> bool:
    """A sliding layer attends through a (T x T) mask once the row reaches its window (masking_utils: kv_length
    >= the window); below it transformers skips the mask (is_causal)."""
    return bool(shape and shape.window and t.plan.attn == "sdpa" and t.plan.seq_len >= shape.window)


def attention_extras(t, shape: LayerShape, p: int) -> None:
    """What a Gemma 4 attention block saves beyond the usual one: the value RMSNorm's fp32 input and rstd (a layer
    with its own K/V), and the float copy of the sliding-window mask sdpa makes and saves in every call; in a MoE
    layer, the router's extras and the per-layer input block too (see below)."""
    if shape.kv_heads and shape.v_norm:
        t.saved["v_norm.fp32_input"] = 4 * shape.kv_width
        t.saved["v_norm.rstd"] = 4 * shape.kv_heads
    if sliding_masked(t, shape):
        t.saved["sliding_mask_copy"] = t.plan.seq_len * p  # (T x T) per layer, T per token
    # a Gemma 4 MoE layer: core.estimate.moe_terms bills its experts and dense MLP in place of the layer's MLP
    # block, which would close with the per-layer input block: that and the router's own extras are added here
    if shape.router:
        gemma_moe_terms.router_saved(t)
        if shape.ple:
            ple_block(t, shape)


def ple_block(t, shape: LayerShape) -> None:
    """The per-layer input block closing a Gemma 4 layer: per_layer_input_gate (hidden -> p), the activation,
    the product with this layer's slice of the per-layer inputs, per_layer_projection (p -> hidden), an RMSNorm.
    The slice is a view of one tensor computed before the layers (outside_saved counts it once)."""
    d, p = t.d, shape.ple
    t.linear_input("per_layer_input_gate", t.spec.hidden_size, d.hidden, "ple_gate_input")
    t.saved["ple_gate"] = p * d.proj  # the activation's input
    t.saved["ple_act"] = p * d.proj  # the product's other factor
    t.linear_input("per_layer_projection", p, d.proj, "ple_product")
    t.norm("post_per_layer_input_norm")
    if shape.altup:  # Gemma 3n: its AltUp, Laurel and sparse-MLP tensors, with the rest of its layer's
        gemma3n_terms.altup_layer(t, shape)


def outside_saved(t, checkpointing: bool) -> float:
    """Per token, saved outside the layers of a model with per-layer shapes: the per-layer inputs (one tensor,
    every layer's slice of it saved), the RMSNorm over them and LoRA on per_layer_model_projection; with
    checkpointing, the K/V that shared_kv_states holds for the layers that reuse them (the checkpoints keep the
    dict, and so its tensors, alive until their backward), the sliding layers' boolean mask, the rotary tables,
    and Gemma 3n's AltUp (core.estimate.gemma3n_terms). `t`: a LayerTerms of the model
    (core.estimate.activation_terms, which imports this module)."""
    spec, plan, d = t.spec, t.plan, t.d
    shapes = [s for s in shapes_of(spec) if s is not None]
    if not shapes:
        return 0.0
    b = 0.0
    width = sum(s.ple for s in shapes)  # the packed table: num_layers * hidden_size_per_layer_input
    if width:
        b += width * d.proj + 4 * width + 8 * len(shapes)  # per_layer_inputs; the norm's fp32 input, rstd
        t.adapted = t.every_adapted  # a module outside the layers: not among layer 0's
        t.linear_input("per_layer_model_projection", spec.hidden_size, d.hidden, "inputs_embeds")
        b += sum(v for k, v in t.saved.items() if k != "inputs_embeds")
    if checkpointing:
        b += sum(2 * s.kv_width * d.attn for s in shapes if s.store)
    # the rotary cos and sin of each kind of layer (its own head_dim), computed once before the layers in the
    # stream's dtype: every layer's rotary multiply keeps them (position_embeddings[layer_type])
    kinds = {(s.window > 0, s.head_dim) for s in shapes}
    b += sum(2 * head_dim * d.hidden for _, head_dim in kinds)
    if plan.attn == "sdpa" and any(s.window and plan.seq_len >= s.window for s in shapes):
        b += plan.seq_len  # the (T x T) boolean sliding-window mask, T per token
    return b + gemma3n_terms.altup_outside(t, shapes, checkpointing)
