"""The bill's mixture-of-experts terms: the experts' weights in the dtype they really have after loading, LoRA on
the experts (peft's target_parameters), the activations of the routed tokens, the router's and the load-balancing
loss's -- from the code of transformers 5.24 (integrations/moe.py `grouped_mm_experts_forward`, each family's
router), peft 0.21 (tuners/lora/layer.py `ParamWrapper`) and trl 1.16 (SFTTrainer's aux loss).

What one MoE layer runs, for T tokens and S = T x top-k routed token-expert pairs (the grouped forward processes
every pair, whatever the routing: no term depends on which experts the router picks):
- the router: logits (T x experts), its softmax / sigmoid and top-k (their saved outputs and indices);
- the experts: the tokens gathered per pair (S x hidden), gate_up (S x 2 width), the gate (SwiGLU: silu(gate) x up;
  gpt-oss: clamped, sigmoid(alpha x gate), (up + 1)), down (S x hidden), scaled by the routing weights and summed
  back per token. Autograd keeps the gate_up output and the gate's intermediates, the down output (for the routing
  weights' gradient) and three index tensors; a frozen expert keeps no input.
- LoRA on the experts (ParamWrapper): every forward folds the adapter into a merged copy of the whole stack,
  W + scale x B A (torch.baddbmm in the weight's dtype), which the grouped matmuls then use. That copy, one per
  targeted parameter, is saved for backward (the matmul's gradient needs it), and backward makes a gradient as
  large as it: an adapter on the experts costs a full copy of each layer's expert weights per layer saved.
- the load-balancing loss (on whenever the config has a router_aux_loss_coef, TRL's SFTTrainer): every layer's
  router logits stay alive until the forward ends, and its softmax is saved for backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.estimate.activation_terms import (
    LayerTerms,
    activation_bytes,
    checkpointing_on,
    layer_saved_tensors,
    step_dtypes,
)
from core.estimate.granite_moe_terms import FP32_TOPK_SOFTMAX, granite_router
from core.estimate.jetmoe_terms import (
    checkpointing_warning,
    jetmoe_activation_bytes,
    jetmoe_backward_peak,
    jetmoe_forward_temporaries,
    jetmoe_layer,
)
from core.estimate.llama4_moe_terms import llama4_backward_peak, llama4_routed
from core.estimate.longcat_terms import longcat_activation_bytes, longcat_layer, zero_expert_terms
from core.estimate.moe import REPEAT_BMM, SPLIT_LINEAR, MoeFacts, moe_of, routed_rows
from core.estimate.plan import DTYPE_BYTES, Plan
from core.estimate.specs import ModelSpec
from core.estimate.static_terms import adapter_bytes, trainable_tensors
from core.estimate.zaya_terms import zaya_activation_bytes, zaya_layer

# The dense layer's MLP entries of layer_saved_tensors (the MoE block replaces them)
_MLP_NAMES = ("mlp_norm_out", "gate", "up", "gate_up", "act_gate", "gated_product")
_MLP_PREFIXES = ("gate_proj.", "up_proj.", "gate_up_proj.", "down_proj.")


def linear_targets(targets) -> tuple:
    """The nn.Linear targets (what the dense layer terms see)."""
    return tuple(s for s in targets if not s.experts)


def expert_targets(targets, facts: MoeFacts) -> dict[str, object]:
    """{"gate_up_proj" / "down_proj" / "router": one layer's target} among peft's parameter targets."""
    out = {}
    for s in targets:
        if not s.experts:
            continue
        module, param = s.name.rsplit(".", 1)
        if module.endswith(facts.experts_path) and param in ("gate_up_proj", "up_proj", "down_proj"):
            out.setdefault("down_proj" if param == "down_proj" else "gate_up_proj", s)
        elif facts.router_path and module.endswith(facts.router_path):
            out.setdefault("router", s)
    return out


def expert_dtype(plan: Plan) -> tuple[str, str]:
    """(dtype name, why) of the experts' weights as the run holds them."""
    load = plan.load_dtype
    if plan.tuning == "qlora" and plan.quantize_experts:
        return "nf4", (
            "quantized on load (4-bit NF4 blocks of 64): what axolotl's quantize_moe_experts does; this engine "
            "cannot yet (transformers 5.24 gives bitsandbytes only nn.Linear layers), so this is a plan, not a run"
        )
    if plan.tuning == "qlora" and plan.prepare_kbit:
        return "fp32", (
            "bitsandbytes 4-bit quantizes nn.Linear layers only and the experts are fused 3-D parameters, and "
            "peft's prepare_model_for_kbit_training (the plain-Trainer QLoRA path) upcasts every weight left out of "
            "4-bit to fp32"
        )
    if plan.tuning == "qlora":
        return load, (
            "bitsandbytes 4-bit quantizes nn.Linear layers only and the experts are fused 3-D parameters, so they "
            f"stay {load} next to the 4-bit attention"
        )
    return load, "loaded in the model's dtype like every other weight"


def mxfp4_note(spec: ModelSpec) -> str | None:
    """A checkpoint whose experts are stored MXFP4 (gpt-oss): what training gets from it."""
    import json

    quant = json.loads(spec.config_json).get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() != "mxfp4":
        return None
    return (
        "The checkpoint stores its experts in MXFP4; transformers 5.24 keeps MXFP4 only for inference (Triton "
        "and the kernels package on a GPU: its quantizer is not trainable) and dequantizes them to bf16 "
        "otherwise, so training holds them in bf16 (Mxfp4Config(dequantize=True), as the engine loads them)."
    )


@dataclass(frozen=True)
class MoeLayer:
    """Bytes of one MoE layer's MLP block for the step's tokens."""

    saved: dict[str, int]  # saved for backward by the router, the experts and the shared experts
    merged: int  # peft's merged expert copies (W + BA) of one layer (inside `saved` when saved)
    outside: int  # per layer, saved outside the (checkpointed) layer: the load-balancing loss's softmax
    logits: int  # per layer, the router logits the loss keeps alive until the forward ends
    temporaries: int = 0  # alive in forward while the experts run, not saved (Llama 4's routed rows)


def moe_layer(spec: ModelSpec, facts: MoeFacts, plan: Plan, targets, tokens: int) -> MoeLayer:
    """What one MoE layer's MLP block saves for backward, by tensor, for `tokens` tokens."""
    d = step_dtypes(plan)
    h, width, e, k = spec.hidden_size, facts.width, facts.experts, facts.top_k
    pairs = tokens * k
    p = DTYPE_BYTES[plan.load_dtype]  # grouped_mm runs in the experts' dtype (it casts its input to it)
    # the logits the loss keeps: fp32 where the router computes in fp32 or casts them (Granite's `.float()`)
    logit = 4 if facts.router_fp32_weight or facts.router == FP32_TOPK_SOFTMAX else d.proj
    lora = expert_targets(targets, facts)
    rows = e + facts.zero_experts  # the router scores LongCat-Flash's zero-computation experts too
    # the loss's softmax of the layer's logits, and the top-k indices its routing counts take
    outside = tokens * (rows * logit + k * 8) if facts.aux_loss else 0
    logits = tokens * rows * logit if facts.aux_loss else 0
    if facts.implementation == SPLIT_LINEAR:  # JetMoE: the whole layer, its attention too (jetmoe_terms)
        saved = jetmoe_layer(spec, facts, plan, targets, tokens)
        return MoeLayer(saved, 0, outside, logits, jetmoe_forward_temporaries(spec, facts, plan, tokens))
    if facts.implementation == REPEAT_BMM:  # Llama 4: every token through every expert (llama4_moe_terms)
        saved, merged, temporaries = llama4_routed(h, facts, plan, lora, tokens)
        saved.update(_shared_experts(spec, facts, plan, targets, tokens))
        return MoeLayer(saved, merged, outside, logits, temporaries)
    saved: dict[str, int] = {}
    # router
    if facts.router == FP32_TOPK_SOFTMAX:  # Granite 4.0-H (core.estimate.granite_moe_terms)
        saved.update(granite_router(facts, plan, tokens))
    elif facts.router == "topk_softmax":
        saved["router.topk_indices"] = tokens * k * 8
        saved["router.softmax"] = tokens * k * logit
    else:
        scores = "router.sigmoid" if facts.router == "sigmoid_group" else "router.softmax"
        saved[scores] = tokens * rows * 4
        saved["router.topk_indices"] = tokens * k * 8
        if facts.renormalise:  # the in-place division keeps its result and the divisor
            saved["router.renormalised"] = tokens * k * 4
            saved["router.sum"] = tokens * 4
    if facts.router == "sigmoid_group" and facts.groups:
        # the group scores' top-2 and the groups' top-k indices, and the mask of the experts left out
        saved["router.group_indices"] = tokens * (facts.groups * 2 + facts.topk_groups) * 8
        saved["router.group_mask"] = tokens * e
    if "router" in lora:  # peft folds the adapter into the router weight; the matmul keeps it and its input
        saved["router.merged_weight"] = rows * h * logit  # (cast to fp32 by an fp32 router: that copy)
        if facts.router_fp32_weight and d.hidden != 4:
            saved["router.fp32_input"] = tokens * h * 4  # `hidden_states.type(torch.float32)`, its own copy
        else:
            saved["mlp_norm_out"] = tokens * h * d.hidden
    elif facts.router_fp32_weight and plan.load_dtype != "fp32":
        saved["router.fp32_weight"] = rows * h * 4  # `weight.type(torch.float32)`: a copy the matmul keeps
    # the routed pairs (grouped_mm_experts_forward)
    saved["experts.indices"] = 3 * pairs * 8  # the gather, the routing weights' and the un-permute's
    saved["experts.offsets"] = e * 4
    saved.setdefault("experts.routing_weights", pairs * (4 if facts.routing_fp32 else logit))
    saved["experts.gate_up_out"] = pairs * (2 if facts.gated else 1) * width * p
    if facts.clamped_gate:  # gpt-oss: clamp(gate), sigmoid(alpha * gate), up + 1, and their product
        saved["experts.gate"] = 4 * pairs * width * p
    elif facts.gated:
        saved["experts.act_gate"] = pairs * width * p
    saved["experts.down_out"] = pairs * h * p
    merged = 0
    ad = adapter_bytes(plan)
    for name, fan_in, fan_out in (
        ("gate_up_proj", h, (2 if facts.gated else 1) * width),
        ("down_proj", width, h),
    ):
        s = lora.get(name)
        if s is None:
            continue
        saved[f"experts.{name}.input"] = pairs * fan_in * p
        merged += e * fan_in * fan_out * p
        if ad != p:  # the factors cast to the weight's dtype for baddbmm, kept for its backward
            saved[f"experts.{name}.factors"] = e * plan.lora_r * s.rank * (fan_in + fan_out) * p
    if merged:
        saved["experts.merged_weights"] = merged
    saved.update(_shared_experts(spec, facts, plan, targets, tokens))
    if facts.zero_experts:  # LongCat-Flash (core.estimate.longcat_terms)
        saved.update(zero_expert_terms(spec, facts, plan, tokens))
    return MoeLayer(saved, merged, outside, logits)


def _shared_experts(spec: ModelSpec, facts: MoeFacts, plan: Plan, targets, tokens: int) -> dict[str, int]:
    if not facts.shared_width:
        return {}
    shared = replace(spec, intermediate_size=facts.shared_width)  # a dense SwiGLU MLP of the shared width
    dense = _mlp_part(layer_saved_tensors(shared, plan, linear_targets(targets)))
    out = {f"shared.{k}" if k != "mlp_norm_out" else k: int(v * tokens) for k, v in dense.items()}
    if facts.shared_gate:  # sigmoid(gate(x)) * shared: the product keeps both
        d = step_dtypes(plan)
        out["shared.gate_sigmoid"] = tokens * d.proj
        out["shared.output"] = tokens * spec.hidden_size * d.proj
        if any(s.name.endswith("shared_expert_gate") for s in linear_targets(targets)):
            # its LoRA (a 1-output Linear "all-linear" takes): lora_A's output, and peft's cast of the input
            ad, compute = adapter_bytes(plan), DTYPE_BYTES[plan.compute_dtype]
            out["shared.gate.lora_A_out"] = tokens * plan.lora_r * (compute if d.autocast else ad)
            if d.hidden != ad or d.autocast:
                out["shared.gate.lora_input_copy"] = (
                    tokens * spec.hidden_size * (compute if d.autocast else ad)
                )
    return out


def _is_mlp(name: str) -> bool:
    return name in _MLP_NAMES or name.startswith(_MLP_PREFIXES)


def _mlp_part(saved: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in saved.items() if _is_mlp(k)}


def layer_kinds(spec: ModelSpec, facts: MoeFacts, plan: Plan, targets, tokens: int) -> dict[str, int]:
    """Saved bytes of one layer of each kind ("moe", "dense") for `tokens` tokens."""
    linear = linear_targets(targets)
    saved = layer_saved_tensors(spec, plan, linear)
    attention = sum(v for k, v in saved.items() if not _is_mlp(k)) * tokens
    moe = moe_layer(spec, facts, plan, targets, tokens)
    if facts.implementation == SPLIT_LINEAR:  # JetMoE's layer is planned whole, its attention included
        attention = 0
    if facts.sublayers > 1:  # LongCat-Flash: two attention + MLP sublayers and the shortcut MoE
        return {"moe": sum(longcat_layer(spec, facts, plan, targets, tokens, moe.saved).values())}
    if facts.router_hidden:  # ZAYA: its attention and its router are its own
        return {"moe": sum(zaya_layer(spec, facts, plan, linear, tokens, moe.saved).values())}
    kinds = {"moe": int(attention + sum(moe.saved.values()))}
    if facts.dense_layers:
        dense = layer_saved_tensors(replace(spec, intermediate_size=facts.dense_width), plan, linear)
        kinds["dense"] = int(sum(dense.values()) * tokens)
    return kinds


def moe_activation_bytes(spec: ModelSpec, plan: Plan, targets, tokens: int) -> tuple[int, int]:
    """(saved activations alive at the end of forward, one layer's backward moment) of a MoE model: its layers as
    each is (core.estimate.layer_kinds: a MoE or a dense block after its mixers), the load-balancing loss's saved
    softmax of every MoE layer outside them."""
    facts = moe_of(spec)
    if facts.implementation == SPLIT_LINEAR:  # JetMoE (core.estimate.jetmoe_terms)
        return jetmoe_activation_bytes(spec, facts, plan, targets, tokens)
    linear = linear_targets(targets)
    layer = moe_layer(spec, facts, plan, targets, tokens)
    if facts.sublayers > 1:  # LongCat-Flash (core.estimate.longcat_terms)
        return longcat_activation_bytes(spec, facts, plan, linear, tokens, layer.saved)
    if facts.router_hidden:  # ZAYA (core.estimate.zaya_terms)
        return zaya_activation_bytes(spec, facts, plan, linear, tokens, layer.saved)
    post_norm = {
        k: v for k, v in layer_saved_tensors(spec, plan, linear, mixers=()).items() if not _is_mlp(k)
    }
    ffn = {"moe": sum(post_norm.values()) + sum(layer.saved.values()) / tokens}
    if facts.dense_layers:
        dense = layer_saved_tensors(
            replace(spec, intermediate_size=facts.dense_width), plan, linear, mixers=()
        )
        ffn["mlp"] = sum(dense.values())
    outside = facts.moe_layers * layer.outside / tokens
    return activation_bytes(
        spec,
        plan,
        linear,
        tokens,
        ffn,
        outside,
        {"moe": _beside_the_mixer(spec, plan, facts, layer, targets, tokens)},
    )


def _beside_the_mixer(
    spec: ModelSpec, plan: Plan, facts: MoeFacts, layer: MoeLayer, targets, tokens: int
) -> float:
    """Per token: what a MoE block after a recurrent mixer holds that is not alive at the mixer's moments
    (activation_terms.beside_the_mixer, a dense MLP's): its post-mixer norm and saved tensors, and with
    checkpointing the gradients of its experts' backward, which moe_moments puts next to the recomputed layer."""
    norm = LayerTerms(spec, plan, targets)
    norm.norm("post_attention_layernorm")
    out = sum(norm.saved.values()) + sum(layer.saved.values()) / tokens
    if checkpointing_on(plan):
        out += expert_backward_peak(spec, facts, plan, targets, tokens) / tokens
    return out


# ----------------------------------------------------------------------------------------------------------
# the moments of a MoE step and its record


def moe_moments(t, forward_moment, backward_moment) -> dict[str, dict]:
    """The forward and backward moments of a MoE model's step (`t`: the bill's StepTerms): the dense ones with no
    dense MLP (the MoE block replaces it), next to the moments inside an experts block."""
    facts = moe_of(t.spec)
    spec = replace(t.spec, intermediate_size=facts.dense_width if facts.dense_layers else 0)
    base = replace(t, spec=spec, targets=linear_targets(t.targets))
    forward, backward = forward_moment(base), backward_moment(base)
    plan, h = t.plan, t.spec.hidden_size
    layer = moe_layer(t.spec, facts, plan, t.targets, t.tokens)
    hidden = step_dtypes(plan).hidden
    routed = sum(
        v for k, v in layer.saved.items() if k.startswith("experts.") and k != "experts.merged_weights"
    )
    grads = expert_backward_peak(t.spec, facts, plan, t.targets, t.tokens)
    # by then the routing weights' backward has run: the down output it kept is freed (grouped_mm; Llama 4 scales
    # the rows before the experts, so nothing of theirs is freed yet)
    freed = layer.saved.get("experts.down_out", 0) + (
        0 if facts.implementation == REPEAT_BMM else layer.saved.get("experts.routing_weights", 0)
    )
    # JetMoE: the weighted output index_add kept and the gates the multiply kept (router.gates) go first
    freed += layer.saved.get("experts.weighted_out", 0) + layer.saved.get("router.gates", 0)
    # ... and this layer's own expert adapters have no gradient yet
    own = sum(trainable_tensors(t.spec, plan, [s for s in t.targets if s.experts])) // max(
        facts.moe_layers, 1
    )
    static = t.static
    # Inside an experts block in forward: both merged copies (peft caches each for the whole block) and the
    # routed pairs' tensors next to everything saved so far; with checkpointing none of them is kept after it.
    inside = {
        **static,
        "autocast_weight_copies": t.autocast_fwd,
        "activations": t.saved + (layer.merged + routed if checkpointing_on(plan) else 0) + layer.temporaries,
    }
    # Backward through an experts block: the gradient of a merged copy (as large as the copy) and the routed
    # gradients next to the layer's saved tensors -- first in the last layer (everything else still saved),
    # last in the first layer (all other gradients made, the recomputed layer alone held).
    first = {
        **static,
        "autocast_weight_copies": t.autocast_bwd,
        "activations": t.saved + t.recompute - freed,
        "logits_loss": t.tokens * h * hidden + grads,  # the flowing gradients, as the dense moments name them
        "gradients": 0,
    }
    kinds = layer_kinds(t.spec, facts, plan, t.targets, t.tokens)
    last = {
        **static,
        "autocast_weight_copies": 0,
        "activations": (t.recompute or kinds["moe"]) - freed,
        "logits_loss": 2 * t.tokens * h * hidden + grads,
        "gradients": t.grads - own * t.param_bytes,
    }
    for moment in (inside,):
        if sum(moment.values()) > sum(forward.values()):
            forward = moment
    for moment in (first, last):
        if sum(moment.values()) > sum(backward.values()):
            backward = moment
    return {"forward": forward, "backward": backward}


def expert_backward_peak(spec: ModelSpec, facts: MoeFacts, plan: Plan, targets, tokens: int) -> int:
    """Bytes alive beyond the saved tensors while backward goes through one experts block: for each adapted
    expert parameter the gradient of its merged copy (grouped_mm's weight gradient, as large as the stack) with
    the routed gradient in and out; down_proj's comes first, while gate_up's merged copy is still saved, and
    gate_up's after down_proj's copy is freed."""
    lora = expert_targets(targets, facts)
    if facts.implementation == SPLIT_LINEAR:
        return jetmoe_backward_peak(spec, facts, plan, tokens)
    if facts.implementation == REPEAT_BMM:
        return llama4_backward_peak(spec.hidden_size, facts, plan, lora, tokens)
    p = DTYPE_BYTES[plan.load_dtype]
    h, width, e, pairs = spec.hidden_size, facts.width, facts.experts, tokens * facts.top_k
    up = (2 if facts.gated else 1) * width
    flows = {"down_proj": pairs * (h + width) * p, "gate_up_proj": pairs * (up + h) * p}
    stacks = {"down_proj": e * h * width * p, "gate_up_proj": e * h * up * p}
    peak = max(flows.values())  # a frozen block: the routed gradients alone
    if "down_proj" in lora:
        peak = max(peak, stacks["down_proj"] + flows["down_proj"])
    if "gate_up_proj" in lora:
        freed = stacks["down_proj"] if "down_proj" in lora else 0
        peak = max(peak, stacks["gate_up_proj"] + flows["gate_up_proj"] - freed)
    return peak


def with_moe(est, t):
    """The estimate with its MoE record (experts, their dtype and why, the expert terms) and the per-layer
    activations of a MoE layer."""
    facts = moe_of(t.spec)
    plan, spec = t.plan, t.spec
    layer = moe_layer(spec, facts, plan, t.targets, t.tokens)
    kinds = layer_kinds(spec, facts, plan, t.targets, t.tokens)
    dtype, why = expert_dtype(plan)
    lora = expert_targets(t.targets, facts)
    from core.estimate.static_terms import expert_weight_bytes

    weights, constants = expert_weight_bytes(spec, plan)
    expert_trainable = sum(trainable_tensors(spec, plan, [s for s in t.targets if s.experts]))
    est.activation_bytes_per_token_per_layer = kinds["moe"] / max(t.tokens, 1)
    no_checkpointing = checkpointing_warning(spec, facts, plan)
    if no_checkpointing:
        est.warnings = est.warnings + [no_checkpointing]
    if plan.lora_dropout and any(s.experts for s in t.targets):
        est.warnings = est.warnings + [
            "LoRA wraps parameters of this model (its experts, through peft's target_parameters): peft refuses "
            "lora_dropout other than 0 there, so the run needs lora_dropout 0 (planned as asked)."
        ]
    est.moe = {
        "experts": facts.experts,
        "top_k": facts.top_k,
        "expert_width": facts.width,
        "shared_width": facts.shared_width,
        "moe_layers": facts.moe_layers,
        "dense_layers": facts.dense_layers,
        "router": facts.router_path,
        "experts_path": facts.experts_path,
        "expert_dtype": dtype,
        "expert_dtype_reason": why,
        "mxfp4_note": mxfp4_note(spec),
        "expert_weight_bytes": weights + constants,
        "lora_on": sorted(lora),
        "expert_trainable_params": expert_trainable,
        "merged_expert_copy_bytes": layer.merged,
        "routed_pairs": routed_rows(facts, t.tokens),
        "moe_layer_activation_bytes": kinds["moe"],
        "router_logits_bytes": facts.moe_layers * layer.logits,
        "aux_loss": facts.aux_loss,
        "attention_experts_width": facts.attention_width,  # JetMoE's attention's experts, 0 elsewhere
    }
    return est


def moe_lines(est) -> list[str]:
    """What a terminal (and the Estimate page) says of a MoE estimate: the experts, their dtype and why, the
    expert terms of the bill."""
    m = est.moe
    if not m:
        return []
    from core.fmt import gib

    shared = f", shared experts {m['shared_width']} wide" if m["shared_width"] else ""
    dense = f" (+{m['dense_layers']} dense)" if m["dense_layers"] else ""
    width = m.get("attention_experts_width", 0)
    attention = f"; the attention's query and output projections are experts, {width} wide" if width else ""
    lines = [
        f"mixture of experts: {m['experts']} experts, {m['top_k']} per token, each {m['expert_width']} wide"
        f"{shared}; {m['moe_layers']} MoE layers{dense}; router {m['router']}{attention}",
        f"expert weights: {gib(m['expert_weight_bytes'])} in {m['expert_dtype']}: {m['expert_dtype_reason']}",
    ]
    if m["mxfp4_note"]:
        lines.append(m["mxfp4_note"])
    if m["lora_on"]:
        lines.append(
            f"LoRA on the experts ({', '.join(m['lora_on'])}): {m['expert_trainable_params']:,} trainable; peft "
            f"folds the adapter into a merged copy of each layer's experts every forward: "
            f"{gib(m['merged_expert_copy_bytes'])} per layer, saved for backward, and a gradient as large"
        )
    elif width:  # JetMoE's 3-D experts: not planned with LoRA (core.estimate.jetmoe_terms)
        lines.append("LoRA leaves the experts as they are (all-linear adapts kv_proj and the routers)")
    else:
        lines.append(
            f"LoRA leaves the experts as they are (target them with lora.target_parameters: "
            f"{m['experts_path']}.gate_up_proj, {m['experts_path']}.down_proj)"
        )
    aux = (
        f"; router logits kept for the load-balancing loss: {gib(m['router_logits_bytes'])}"
        if m["aux_loss"]
        else ""
    )
    lines.append(
        f"routed tokens: {m['routed_pairs']:,} token-expert pairs per step; one MoE layer saves "
        f"{gib(m['moe_layer_activation_bytes'])}{aux}"
    )
    return lines
