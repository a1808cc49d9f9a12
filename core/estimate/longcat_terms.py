"""LongCat-Flash's layer (transformers 5.25 models/longcat_flash/modeling_longcat_flash.py: LongcatFlashDecoderLayer,
LongcatFlashMoE, LongcatFlashTopkRouter, LongcatFlashExperts, LongcatFlashMLA), from its code. core.estimate.moe_terms
dispatches to it (MoeFacts.sublayers > 1) and builds the MoE block as for every family whose experts use
transformers' grouped implementation.

One decoder layer is two sublayers and a shortcut MoE:
- each sublayer: input_layernorm[i], an MLA attention (core.estimate.mla_terms: LongCat's LoRA scalings multiply q
  and the kv latent by Python floats, which save nothing), post_attention_layernorm[i], a dense SwiGLU MLP (mlps[i])
  -- the usual attention + MLP layer, planned by core.estimate.activation_terms twice;
- the MoE reads the first sublayer's post-attention norm output and its output is added at the end of the second
  (`residual + hidden_states + shortcut_mlp_output`): alive, unsaved, through the whole second sublayer.
- its router (an nn.Linear `classifier` it multiplies by hand, `classifier.weight.type(torch.float32)`: a LoRA on
  it never runs) scores the routed experts and `zero_expert_num` zero-computation experts with an fp32 softmax; the
  top-k are gathered from it. A pair that picks a zero expert passes its token through: `identity_mask` (`>=`,
  kept by `masked_fill`, and its negation, kept by the other `masked_fill`), the identity weights summed per token
  (T x 1 fp32) and `hidden_states * identity_weights`, which keeps both; the pair itself is redirected to a routed
  expert with weight 0, so the grouped experts still run all T x k pairs.
"""

from __future__ import annotations

from dataclasses import replace

from core.estimate.activation_terms import (
    checkpointing_on,
    first_layer_unsaved,
    layer_saved_tensors,
    outside_layers_saved_bytes,
    step_dtypes,
)
from core.estimate.moe import MoeFacts
from core.estimate.plan import Plan


def zero_expert_terms(spec, facts: MoeFacts, plan: Plan, tokens: int) -> dict[str, int]:
    """Bytes LongCat's zero-computation experts keep for backward for `tokens` tokens (the MoE input the identity
    multiply keeps is the first sublayer's norm output: counted here unless that sublayer saves it already)."""
    return {
        "zero.masks": 2 * tokens * facts.top_k,  # identity_mask and ~identity_mask (bool)
        "zero.weights": 4 * tokens,  # identity_weights: T x 1, fp32 like the router's weights
        "zero.input": tokens * spec.hidden_size * step_dtypes(plan).hidden,
    }


def _sublayer_targets(targets, i: int) -> list:
    return [s for s in targets if f".self_attn.{i}." in s.name or f".mlps.{i}." in s.name]


def longcat_layer(spec, facts: MoeFacts, plan: Plan, targets, tokens: int, moe: dict) -> dict[str, int]:
    """Bytes one LongCat-Flash decoder layer saves for `tokens` tokens, by tensor: its sublayers' (attention + MLP,
    prefixed sub0. / sub1.) and `moe`, the MoE block's (core.estimate.moe_terms.moe_layer's saved tensors)."""
    out: dict[str, int] = {}
    # each sublayer has its own input and post-attention norm (the spec counts every norm of the decoder layer,
    # the MLA latents' and the other sublayer's too)
    sub = replace(spec, norms_per_layer=2)
    for i in range(facts.sublayers):
        part = layer_saved_tensors(sub, plan, _sublayer_targets(targets, i))
        out.update({f"sub{i}.{name}": int(v * tokens) for name, v in part.items()})
    out.update(moe)
    if "sub0.mlp_norm_out" in out:  # the identity multiply keeps the tensor sublayer 0's MLP saved already
        out.pop("zero.input", None)
    return out


def longcat_activation_bytes(
    spec, facts: MoeFacts, plan: Plan, targets, tokens: int, moe: dict
) -> tuple[int, int, int]:
    """(saved activations alive at the end of forward, one layer recomputed in backward with checkpointing, 0),
    as core.estimate.activation_terms.activation_bytes gives them for the other families."""
    layer = longcat_layer(spec, facts, plan, targets, tokens, moe)
    per_layer = sum(layer.values())
    outside = int(tokens * outside_layers_saved_bytes(spec, plan))
    if checkpointing_on(plan):
        inputs = spec.num_layers * tokens * spec.hidden_size * step_dtypes(plan).hidden
        return inputs + outside, per_layer, 0
    first = 0
    if plan.tuning != "full":  # layer 0's input (the frozen embedding's output) needs no gradient
        sub0 = {k[len("sub0.") :]: v for k, v in layer.items() if k.startswith("sub0.")}
        first = int(first_layer_unsaved(sub0, targets))
    return spec.num_layers * per_layer - first + outside, 0, 0
