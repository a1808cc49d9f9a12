"""Mixture-of-experts facts of a model, read from its meta model (core.estimate.specs builds it from config.json).

transformers 5 stores the experts of every MoE family as one module per layer holding fused 3-D parameters
(`mlp.experts.gate_up_proj`: experts x 2*width x hidden, `down_proj`: experts x hidden x width; gpt-oss stores
them transposed, with biases); the router is a module of its own (`mlp.gate`, gpt-oss `mlp.router`) and some
families add shared experts (a dense MLP every token goes through) or keep the first layers dense. The experts'
forward is transformers' `use_experts_implementation` (integrations/moe.py; `grouped_mm` by default): every routed
token-expert pair (tokens x top-k) goes through gate_up, the gate and down as one grouped matmul each. Llama 4's
experts run a forward of their own (REPEAT_BMM: every token through every expert, core.estimate.llama4_moe_terms);
Granite 4.0-H's experts use transformers' implementation, its router and the shared MLP beside the block are its
own (core.estimate.granite_moe_terms). JetMoE's experts (SPLIT_LINEAR) split the routed tokens per expert, one matmul
each, and its attention's query and output projections are experts too (core.estimate.jetmoe_terms). A family whose
experts run another forward of their own is not modelled: `MoeFacts.unsupported` says so in one sentence.

The facts are plain JSON (ModelSpec.moe_json) so that the spec's disk cache keeps them; `moe_of(spec)` reads them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache

# Router forwards, as their code computes the routing weights (each saves different tensors for backward):
# softmax_topk: softmax over every expert (fp32), top-k, optionally renormalised (Qwen2/3-MoE, Mixtral, OLMoE);
# topk_softmax: top-k of the logits, softmax over those k (gpt-oss);
# sigmoid_group: sigmoid scores, group-limited top-k, gathered and renormalised (DeepSeek-V3, GLM-4 MoE).
# sigmoid_topk: top-k of the logits scattered into -inf, sigmoid over every expert (Llama 4).
# fp32_topk_softmax: the logits cast to fp32, their top-k, softmax over those k, cast back (Granite 4.0-H).
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group", "sigmoid_topk", "fp32_topk_softmax")

# Llama 4's experts forward (Llama4TextMoe / Llama4TextExperts): the hidden states repeated once per expert, scaled by
# the sigmoid scores (0 for the experts not picked), one bmm per projection over experts x tokens rows.
REPEAT_BMM = "repeat_bmm"
# JetMoE's experts (JetMoeParallelExperts, an input_linear / output_linear pair of 3-D weights): the routed pairs sorted
# by expert, `inputs.split(expert_size)`, one F.linear per expert and torch.cat; its attention routes the query and
# output projections through such a pair too (JetMoeMoA).
SPLIT_LINEAR = "split_linear"


@dataclass(frozen=True)
class MoeFacts:
    experts_class: str  # e.g. Qwen3MoeExperts
    experts_path: str  # the experts module inside a layer, e.g. mlp.experts
    router_path: str  # the router inside a layer, e.g. mlp.gate
    experts: int  # routed experts per layer
    top_k: int  # experts each token goes through
    width: int  # one expert's intermediate size
    moe_layers: int  # layers with routed experts
    dense_layers: int  # layers with a dense MLP (first_k_dense_replace, mlp_only_layers, decoder_sparse_step)
    dense_width: int  # their MLP's intermediate size
    shared_width: int  # the shared experts' intermediate size (all of them together), 0 without
    shared_gate: bool  # Qwen2-MoE's sigmoid gate on the shared expert's output
    gated: bool  # gate_up_proj (SwiGLU) rather than up_proj alone
    clamped_gate: bool  # gpt-oss's clamped SwiGLU with sigmoid(alpha * gate) and (up + 1)
    bias: bool  # gate_up_proj_bias / down_proj_bias (gpt-oss)
    transposed: bool  # stored experts x in x out (gpt-oss) rather than experts x out x in
    router: str  # one of ROUTERS
    renormalise: bool  # norm_topk_prob: the top-k weights divided by their sum
    routing_fp32: bool  # the routing weights stay fp32 (not cast back to the logits' dtype)
    router_fp32_weight: bool  # the router multiplies in fp32 (`self.weight.type(torch.float32)`)
    groups: int  # sigmoid_group: expert groups (n_group) and how many the top-k picks from (topk_group)
    topk_groups: int
    expert_params: int  # every expert parameter of every layer (weights and biases)
    aux_loss: bool  # the config declares a load-balancing loss (router_aux_loss_coef != 0): TRL adds it
    implementation: (
        str  # the experts' forward: transformers' (grouped_mm unless asked otherwise) or REPEAT_BMM
    )
    unsupported: str  # "" or the sentence saying why this family's experts are not modelled
    # JetMoE: the width of its attention's experts (query / output projections), else 0
    attention_width: int = 0
    # transformers can checkpoint the model (JetMoE's supports_gradient_checkpointing is False)
    checkpointing: bool = True
    # LongCat-Flash's zero-computation experts: the router scores them, they pass their tokens through
    zero_experts: int = 0
    # LongCat-Flash: attention + MLP sublayers per decoder layer beside its one (shortcut) MoE
    sublayers: int = 1
    # ZAYA: its router is an MLP this wide (with a skip class) and its attention CCA (core.estimate.zaya_terms)
    router_hidden: int = 0


def moe_of(spec) -> MoeFacts | None:
    """The MoE facts of a ModelSpec, or None for a dense model."""
    return _parse(spec.moe_json) if spec.moe_json else None


def routed_rows(facts: MoeFacts, tokens: int) -> int:
    """Rows the experts multiply for `tokens` tokens: the routed token-expert pairs, or with Llama 4's forward every
    token once per expert (the experts not picked get a score of 0, not fewer rows)."""
    return tokens * (facts.experts if facts.implementation == REPEAT_BMM else facts.top_k)


@lru_cache(maxsize=64)
def _parse(text: str) -> MoeFacts:
    return MoeFacts(**json.loads(text))


def moe_json(model, layers, text_cfg) -> str:
    """The MoE facts of a meta `model` (its decoder `layers`) as JSON, or "" for a dense model."""
    facts = _facts(model, layers, text_cfg)
    return json.dumps(asdict(facts), sort_keys=True) if facts else ""


def _experts_in(layer):
    """(path, module) of the layer's experts: the module holding 3-D parameters of its own (not a convolution's
    kernel: hybrid models' Mamba layers have those)."""
    import torch.nn as nn

    for name, mod in layer.named_modules():
        if isinstance(mod, nn.modules.conv._ConvNd):
            continue
        if any(p.ndim == 3 for p in mod.parameters(recurse=False)):
            return name, mod
    return None, None


def _names_experts(cfg) -> bool:
    """Does the config count experts (num_experts, num_local_experts, n_routed_experts, moe_num_experts, ...)? 3-D
    parameters alone do not make experts: RWKV's time mixing, XLNet's attention and Mamba-style recurrent layers
    hold them too."""
    return any(
        "expert" in key and isinstance(value, int) and not isinstance(value, bool) and value > 0
        for key, value in cfg.to_dict().items()
    )


def _facts(model, layers, cfg) -> MoeFacts | None:
    found = [(i, *_experts_in(layer)) for i, layer in enumerate(layers)]
    sparse = [(i, path, mod) for i, path, mod in found if mod is not None]
    if not sparse or not _names_experts(cfg):
        return None
    _, path, experts = sparse[0]
    parent_path = path.rsplit(".", 1)[0] if "." in path else ""
    block = layers[sparse[0][0]].get_submodule(parent_path) if parent_path else layers[sparse[0][0]]
    hidden = cfg.hidden_size
    n = int(
        getattr(experts, "num_experts", 0) or next(p.shape[0] for p in experts.parameters() if p.ndim == 3)
    )
    zero = int(getattr(block, "zero_expert_num", 0) or 0)  # LongCat-Flash: scored beside the routed experts
    router_path, router = _router(block, n + zero, hidden)
    router_hidden = 0
    if router is None:  # ZAYA: an MLP router scoring the experts and a skip class
        router_path, router, router_hidden = _mlp_router(block, n, layers[sparse[0][0]])
    top_k = int(
        getattr(router, "top_k", 0)
        or getattr(cfg, "num_experts_per_tok", 0)
        or getattr(cfg, "top_k_experts", 0)  # Gemma 4's name for it
        or getattr(block, "top_k", 0)
    )
    repeat_bmm = _repeats_every_token(block, experts)
    # Llama 4 stores experts x in x out (its bmm multiplies x @ W) without saying so (no is_transposed)
    transposed = bool(getattr(experts, "is_transposed", False)) or repeat_bmm
    down = getattr(experts, "down_proj", None)
    width = int(
        (down.shape[1] if transposed else down.shape[2]) if down is not None and down.ndim == 3 else 0
    )
    gated = bool(getattr(experts, "has_gate", True))
    split = _split_experts(block)  # JetMoE: input_linear / output_linear, one matmul per expert
    if split:
        width, gated = split
    dense = [layers[i] for i, _, mod in found if mod is None]
    shared_width, shared_gate = _shared(block, layers[sparse[0][0]], hidden)
    decorated = hasattr(experts, "has_gate")
    implementation = getattr(getattr(experts, "config", cfg), "_experts_implementation", None) or "grouped_mm"
    if repeat_bmm:
        implementation = REPEAT_BMM
    if split:
        implementation = SPLIT_LINEAR
    unsupported = ""
    attention_experts = _attention_experts(layers[sparse[0][0]])
    # JetMoE's attention routes its query and output projections through experts of the same kind (JetMoeMoA)
    attention_width = _attention_width(layers[sparse[0][0]]) if split and attention_experts else 0
    if attention_experts and not attention_width:
        unsupported = (
            f"{cfg.model_type}: its attention is a mixture of experts too ({attention_experts}: projections "
            "each token is routed through) whose experts run a forward this planner does not know, so it cannot "
            "model their activations yet; it plans JetMoE's mixture-of-attention and the MoE families whose "
            "experts use transformers' shared experts implementation."
        )
    elif not decorated and not repeat_bmm and not split:
        unsupported = (
            f"{cfg.model_type}: its experts ({type(experts).__name__}) run a forward of their own, not "
            "transformers' shared experts implementation, so this planner cannot model their activations yet; "
            "it plans the MoE families whose experts use it (Qwen2/3-MoE, Mixtral, gpt-oss, OLMoE, DeepSeek-V2/V3, "
            "GLM-4 MoE, Granite 4.0-H and most others) and Llama 4's."
        )
    elif not top_k:  # DeepSeek-V2's default config leaves it None: its router's topk fails on the first step
        key = "top_k_experts" if hasattr(cfg, "top_k_experts") else "num_experts_per_tok"  # Gemma 4's name
        unsupported = (
            f"{cfg.model_type}: config.json leaves {key} unset, and the router "
            f"({type(router).__name__}) picks that many experts for each token, so this model cannot run a "
            f"step as configured; set {key} in config.json as the model card gives it."
        )
    elif top_k > n + zero + bool(router_hidden):  # torch.topk over fewer scores than k: the first step fails
        unsupported = (
            f"{cfg.model_type}: config.json sends each token through {top_k} experts, but the router scores only "
            f"{n + zero + bool(router_hidden)}, so this model cannot run a step as configured; lower the experts per "
            "token (num_experts_per_tok or its family's name for it) or raise the experts."
        )
    elif not width or router is None:
        unsupported = (
            f"{cfg.model_type}: its experts ({type(experts).__name__}) have no down_proj or no router scoring "
            "them that this planner can find, so it cannot model them yet."
        )
    router_src = _source(type(router)) if router is not None else ""
    coef = getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0
    return MoeFacts(
        experts_class=type(experts).__name__,
        experts_path=path,
        router_path=f"{parent_path}.{router_path}".strip(".") if router_path else "",
        experts=n,
        top_k=top_k,
        width=width,
        moe_layers=len(sparse),
        dense_layers=len(dense),
        dense_width=_dense_width(dense[0]) if dense else 0,
        shared_width=shared_width,
        shared_gate=shared_gate,
        gated=gated,
        clamped_gate="clamp(" in _source(type(experts)),
        bias=bool(getattr(experts, "has_bias", False)),
        transposed=transposed,
        router="sigmoid_topk" if repeat_bmm else _router_kind(router_src),
        renormalise=_renormalises(router, router_src),
        routing_fp32=_fp32_routing(router_src),
        router_fp32_weight=_fp32_router(router_src),
        groups=int(getattr(router, "num_group", 0) or 0),
        topk_groups=int(getattr(router, "topk_group", 0) or 0),
        expert_params=_expert_params(layers, sparse, split is not None),
        aux_loss=hasattr(cfg, "output_router_logits") and coef != 0,
        implementation=implementation,
        unsupported=unsupported,
        attention_width=attention_width,
        checkpointing=bool(getattr(model, "supports_gradient_checkpointing", True)),
        zero_experts=zero,
        sublayers=_sublayers(layers[sparse[0][0]]),
        router_hidden=router_hidden,
    )


def _mlp_router(block, experts: int, layer):
    """(name, module, width) of ZAYA's router (ZayaRouter: down_proj to router_hidden_size, an RMSNorm, two GELU
    Linears, out_proj to the experts and one skip class) when the layer's attention is its compressed convolutional
    attention (ZayaCCAProjection), which core.estimate.zaya_terms plans with it; ("", None, 0) otherwise."""
    attention = getattr(layer, "self_attn", None)
    cca = getattr(getattr(attention, "qkv_proj", None), "conv_qk_depthwise", None) is not None
    for name, mod in block.named_children():
        out = getattr(getattr(mod, "router_mlp", None), "out_proj", None)
        if cca and getattr(out, "out_features", 0) == experts + 1 and hasattr(mod, "down_proj"):
            return name, mod, int(mod.down_proj.out_features)
    return "", None, 0


def _sublayers(layer) -> int:
    """Attention + MLP sublayers in one decoder layer: LongCat-Flash's holds two of each in ModuleLists (`self_attn`,
    `mlps`) beside the MoE its first sublayer feeds and its last one adds (the shortcut); 1 for every other family."""
    import torch.nn as nn

    attention = getattr(layer, "self_attn", None)
    return len(attention) if isinstance(attention, nn.ModuleList) else 1


def _expert_params(layers, sparse, split: bool) -> int:
    """Every expert parameter of the MoE layers: the experts module's own, or with JetMoE's split experts every
    3-D weight of the layer (its attention's experts and the MLP's input_linear and output_linear)."""
    if split:
        return sum(p.numel() for i, _, _ in sparse for p in layers[i].parameters() if p.ndim == 3)
    return sum(p.numel() for _, _, mod in sparse for p in mod.parameters(recurse=False))


def _split_experts(block) -> tuple[int, bool] | None:
    """(one expert's width, gated) of a block whose experts are JetMoE's pair of JetMoeParallelExperts
    (input_linear: experts x out x in, output_linear: experts x hidden x width, 3-D weights their own forward splits
    the routed tokens over); None for any other block (Granite 4.0-H's shared_mlp has 2-D Linears of these names)."""
    up = getattr(getattr(block, "input_linear", None), "weight", None)
    down = getattr(getattr(block, "output_linear", None), "weight", None)
    if up is None or down is None or up.ndim != 3 or down.ndim != 3:
        return None
    width = int(down.shape[2])
    return width, int(up.shape[1]) == 2 * width  # JetMoeMoE chunks input_linear's output in two: gate, up


def _attention_width(layer) -> int:
    """The width of the experts in the layer's attention when they are JetMoE's split pair (JetMoeMoA: query
    experts hidden -> width, output experts width -> hidden), else 0."""
    for name, mod in layer.named_children():
        if "attn" in name or "attention" in name:
            path, _ = _experts_in(mod)
            if path:
                parent = mod.get_submodule(path.rsplit(".", 1)[0]) if "." in path else mod
                split = _split_experts(parent)
                return split[0] if split else 0
    return 0


def _attention_experts(layer) -> str:
    """The class of the layer's attention when it holds experts (3-D parameters) of its own, else "" (a
    convolution's kernel is no expert: Qwen3-Next's linear_attn has one)."""
    for name, mod in layer.named_children():
        if ("attn" in name or "attention" in name) and _experts_in(mod)[1] is not None:
            return type(mod).__name__
    return ""


def _repeats_every_token(block, experts) -> bool:
    """Do the experts run Llama 4's forward: the block repeats the hidden states once per expert and the experts
    multiply them with one bmm per projection (every token through every expert, whatever the router picks)?"""
    return ".repeat(" in _source(type(block)) and "torch.bmm(" in _source(type(experts))


def _router(block, experts: int, hidden: int):
    """(name inside the MoE block, module) of the router: the child whose weight scores every expert."""
    for name, mod in block.named_children():
        for inner in mod.modules():  # the weight may sit in a Linear inside the router (AFMoE)
            w = getattr(inner, "weight", None)
            if w is not None and tuple(w.shape) == (experts, hidden):
                return name, mod
    return "", None


def _shared(block, layer, hidden: int) -> tuple[int, bool]:
    """(intermediate size of the shared experts, whether a sigmoid gate scales them) of a MoE block. Granite
    4.0-H keeps its shared MLP beside the block, in the layer (`shared_mlp`, input_linear / output_linear)."""
    width, gate = 0, False
    children = list(block.named_children())
    if layer is not block:
        children += [(n, m) for n, m in layer.named_children() if m is not block]
    for name, mod in children:
        # Gemma 4 keeps its experts in the layer beside a dense `mlp` every token goes through: a shared expert
        if "shared" not in name and not (block is layer and name == "mlp"):
            continue
        # explicit None tests: a shared expert's down_proj may be a 3-D parameter (Inkling), whose truth is ambiguous
        down = getattr(mod, "down_proj", None)
        down = getattr(mod, "output_linear", None) if down is None else down
        if down is not None and getattr(down, "out_features", None) == hidden:
            width += down.in_features
        elif getattr(mod, "out_features", None) == 1:
            gate = True
    return width, gate


def _dense_width(layer) -> int:
    mlp = getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)  # Llama 4: feed_forward
    down = getattr(mlp, "down_proj", None)
    return int(getattr(down, "in_features", 0) or 0)


def _source(cls) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


FP32_ROUTER = "self.weight.type(torch.float32)"  # DeepSeek-V2/V3, GLM-4 MoE: logits and weights in fp32
# LongCat-Flash's router multiplies by its classifier's weight cast to fp32 the same way
FP32_ROUTERS = (FP32_ROUTER, "self.classifier.weight.type(torch.float32)")


def _fp32_router(src: str) -> bool:
    return any(s in src for s in FP32_ROUTERS)


def _renormalises(router, src: str) -> bool:
    """Are the top-k weights divided by their sum (Mixtral always; others when norm_topk_prob)?"""
    divides = any(s in src for s in ("/= router_top_value.sum", "/= denominator", "/= top_k_weights.sum"))
    return divides and ("norm_topk_prob" not in src or bool(getattr(router, "norm_topk_prob", False)))


def _fp32_routing(src: str) -> bool:
    """Do the routing weights stay fp32? They do when the router computes in fp32, and after an fp32 softmax
    that is not cast back to the logits' dtype (Mixtral); gpt-oss's softmax keeps the logits' dtype."""
    if _fp32_router(src):
        return True
    return _router_kind(src) == "softmax_topk" and ".to(router_logits.dtype)" not in src


def _router_kind(src: str) -> str:
    if "softmax(top_k_logits" in src and ").float()" in src:
        return "fp32_topk_softmax"
    if "sigmoid" in src:
        return "sigmoid_group"
    if "softmax(router_top_value" in src:
        return "topk_softmax"
    return "softmax_topk"
