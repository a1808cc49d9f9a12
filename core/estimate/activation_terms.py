"""The activation terms of the bill: what autograd saves for backward, named tensor by named tensor from the real
HF module code, the loss head (plain logits or TRL's fused head), attention masks, offloading, the KV cache and
autocast's weight copies."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from core.estimate import layer_shapes, mla_terms
from core.estimate.layer_kinds import kernel_path, kinds_of, mlp_linear_names, text_config
from core.estimate.mixer_terms import MIXERS
from core.estimate.plan import DTYPE_BYTES, OFFLOAD_STASH, Plan, packed_sequences
from core.estimate.specs import ModelSpec
from core.estimate.static_terms import adapter_bytes

# ----------------------------------------------------------------------------------------------------------
# activations: what autograd saves for backward, per token, named tensor by named tensor


@dataclass(frozen=True)
class _Dtypes:
    hidden: int  # residual stream / norm outputs
    proj: int  # MLP projections and their products
    attn: int  # q, k, v and the attention output
    logits: int
    autocast: bool  # Trainer bf16/fp16 runs forward under torch.autocast: Linear inputs get 16-bit copies


def step_dtypes(plan: Plan) -> _Dtypes:
    compute = DTYPE_BYTES[plan.compute_dtype]
    load = DTYPE_BYTES[plan.load_dtype]
    autocast = plan.autocast and compute != 4
    if plan.tuning == "qlora":
        # bnb 4-bit Linear returns its input's dtype; prepare_kbit makes embeddings/norms fp32, so the residual
        # stream and the MLP become fp32 too, while autocast hands sdpa 16-bit copies.
        hidden = 4 if plan.prepare_kbit else load
        return _Dtypes(
            hidden, hidden, compute if autocast else hidden, compute if autocast else hidden, autocast
        )
    proj = compute if autocast else load
    return _Dtypes(load, proj, proj, proj, autocast)


def liger_on(plan: Plan) -> bool:
    """Liger's kernels run (Triton, CUDA only); on a CPU the run does without them."""
    return plan.liger and plan.device == "cuda"


def offloading_on(plan: Plan) -> bool:
    """TRL's activation offloading runs: it moves only tensors on the accelerator (OffloadActivations)."""
    return plan.activation_offloading and plan.device == "cuda"


def _mask_bytes(plan: Plan) -> int:
    return 1 if plan.device == "cuda" else 4  # CUDA saves a bool mask; the CPU kernel a float one


class LayerTerms:
    """One decoder layer's saved tensors as they are assembled: bytes per token by name (`saved`), with the rules
    every block shares -- an RMSNorm over the stream (`norm`) and what a Linear, frozen or trained, with or without
    LoRA, keeps of its input (`linear_input`). The attention block, the MLP and the recurrent mixers
    (core.estimate.gdn_terms, core.estimate.mamba_terms) write through these."""

    def __init__(self, spec: ModelSpec, plan: Plan, targets=(), shape=None, layer: int = 0):
        # shape: the layer's own, where layers differ (core.estimate.layer_shapes); layer: its index, whose adapted
        # Linears it reads (a hybrid's layer 0 may be recurrent, without the attention's projections)
        self.spec, self.plan, self.shape = spec, plan, shape
        self.d = step_dtypes(plan)
        self.full = plan.tuning == "full"
        adapted = {s.name.rsplit(".", 1)[-1] for s in targets if f".{layer}." in s.name}
        self.every_adapted = {s.name.rsplit(".", 1)[-1] for s in targets}
        self.adapted = adapted or self.every_adapted
        self.compute = DTYPE_BYTES[plan.compute_dtype]
        self.ad = adapter_bytes(plan)
        self.lora_bytes = self.compute if self.d.autocast else self.ad
        self.liger = liger_on(plan)
        self.saved: dict[str, float] = {}
        # per token, what the layer's block after its mixer holds that is not alive at the mixer's own moments
        # (beside_the_mixer); the Mamba-2 temporaries are counted net of it
        self.beside = 0.0

    def norm(self, name: str, width: int | None = None) -> None:
        """An RMSNorm over `width` (the hidden size) features: it upcasts to fp32 and saves that and rstd."""
        d, width = self.d, width or self.spec.hidden_size
        # LigerRMSNormFunction saves its input as it comes and rstd; the weight grad needs no more
        if self.liger:
            self.saved[f"{name}.input"] = width * d.hidden
            self.saved[f"{name}.rstd"] = 4
            return
        self.saved[f"{name}.fp32_input"] = 4 * width
        self.saved[f"{name}.rstd"] = 4
        if self.full:
            self.saved[f"{name}.normed"] = width * d.hidden

    def linear_input(self, module: str, width: int, in_bytes: int, shared_key: str, leaf: str = "") -> None:
        """What one Linear (base + LoRA) saves of its input: `width` features of `in_bytes` each, stored under
        `shared_key` when that tensor is saved anyway (several Linears reading one tensor save it once)."""
        d, saved = self.d, self.saved
        if self.full:
            if d.autocast and in_bytes != d.proj:
                saved[f"{module}.autocast_input"] = width * d.proj
            else:
                saved[shared_key] = width * in_bytes
        if (leaf or module) not in self.adapted:  # leaf: the module's own name where it differs (LFM2's w1)
            return
        # peft casts x to the adapter dtype (fp32, or bf16 after TRL's QLoRA cast); under autocast lora_A
        # then saves a 16-bit copy of it unless the adapter is already in the compute dtype.
        autocast_copy = d.autocast and self.ad != self.compute
        copy_bytes = self.compute if autocast_copy else self.ad
        if self.plan.lora_dropout > 0:
            saved[f"{module}.lora_dropout_mask"] = width * _mask_bytes(self.plan)
            saved[f"{module}.lora_dropout_out"] = width * copy_bytes
        elif autocast_copy or in_bytes != self.ad:
            saved[f"{module}.lora_input_copy"] = width * copy_bytes
        else:
            saved[shared_key] = width * in_bytes
        saved[f"{module}.lora_A_out"] = self.plan.lora_r * self.lora_bytes


def layer_saved_tensors(
    spec: ModelSpec,
    plan: Plan,
    targets=(),
    mixers: tuple[str, ...] = ("attention",),
    ffn=True,
    shape=None,
    layer: int = 0,
) -> dict[str, float]:
    """Bytes per token that one decoder layer leaves saved for backward, by tensor: its input norm and token
    mixers (`mixers`: "attention" and the recurrent kinds of core.estimate.layer_kinds; none: no mixer), then, with `ffn`, the
    post-mixer norm and a dense SwiGLU MLP (a MoE block's terms are core.estimate.moe_terms').

    Derived from LlamaDecoderLayer & co in transformers: RMSNorm upcasts to fp32 and saves that input and
    rstd; the norm weight multiply saves its input only when the weight trains; a frozen Linear (bf16 or
    bnb 4-bit) saves nothing, a trainable one its input; SDPA saves q, k, v, output and logsumexp, eager
    the fp32 softmax and its cast; SwiGLU saves gate, act(gate), up; LoRA saves its (fp32 or autocast)
    input copy per adapted module, its dropout output + mask when dropout > 0, and lora_A's output.
    """
    t = LayerTerms(spec, plan, targets, shape, layer)
    if mixers:
        t.norm("input_layernorm")
        for mixer in mixers:  # Falcon-H1 runs attention and Mamba-2 side by side on the same norm output
            _attention_block(t) if mixer == "attention" else mixer_saved(t, mixer)
    if ffn:
        _mlp_block(t)
        if shape is not None and shape.ple:  # Gemma 4's per-layer input block closes the layer
            layer_shapes.ple_block(t, shape)
    return t.saved


def mixer_saved(t: LayerTerms, kind: str) -> None:
    """Add a recurrent mixer's saved tensors to `t` (a recurrence not modelled yet: as an attention block)."""
    facts = mixer_facts(t.spec, kind)
    if (
        facts is None
    ):  # a kind not modelled, or a family whose config the mixer's terms do not read yet (LFM3)
        _attention_block(t)
    else:
        MIXERS[kind].saved(t, facts, kernel_path(t.plan, kind))


def mixer_facts(spec: ModelSpec, kind: str):
    """The facts a recurrent mixer's terms read from the config; None where they are not modelled."""
    row = MIXERS.get(kind)
    return row.facts(text_config(spec)) if row else None


def mixer_temporaries(t: LayerTerms, kind: str) -> tuple[float, float]:
    """Per token, (forward, backward): what a recurrent mixer holds beyond its saved tensors at its peaks."""
    kernel, f = kernel_path(t.plan, kind), mixer_facts(t.spec, kind)
    if f is None:
        return 0.0, 0.0
    row = MIXERS[kind]
    return row.forward_temporaries(t, f, kernel), row.backward_temporaries(t, f, kernel)


def _attention_block(t: LayerTerms) -> None:
    if mla_terms.is_mla(t.spec):  # DeepSeek-V2/V3, GLM-4.7-Flash & co: latent q / kv projections
        return mla_terms.mla_block(t)
    spec, plan, d, saved, shape = t.spec, t.plan, t.d, t.saved, t.shape
    h = spec.hidden_size
    heads, head_dim, kv_heads = spec.num_heads, spec.head_dim, spec.num_kv_heads
    projections = ("q_proj", "k_proj", "v_proj")
    if shape is not None:  # this layer's own shape; a layer reusing earlier K/V (kv_heads 0) projects q only
        heads, head_dim, kv_heads = shape.heads, shape.head_dim, shape.kv_heads
        projections = ("q_proj",) + (("k_proj",) + ("v_proj",) * shape.v_proj) * bool(kv_heads)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    fused_qkv = "qkv_proj" in {s.name.rsplit(".", 1)[-1] for s in spec.decoder_linears}
    for m in ("qkv_proj",) if fused_qkv else projections:
        t.linear_input(m, h, d.hidden, "attn_norm_out")
    if spec.head_norms:  # Qwen3: RMSNorm per query / key head, upcast to fp32, one rstd per head
        saved["q_norm.fp32_input"], saved["q_norm.rstd"] = 4 * q_width, 4 * heads
        if kv_width:
            saved["k_norm.fp32_input"], saved["k_norm.rstd"] = 4 * kv_width, 4 * kv_heads
    p = d.attn
    if shape is not None:
        layer_shapes.attention_extras(t, shape, p)
        # a layer reusing K/V attends to the tensors the storing layer saved already: only their copies count
        kv_width = kv_width or layer_shapes.source_kv_heads(spec, shape) * head_dim
    repeat = shape is not None and layer_shapes.sdpa_repeats_kv(t, kv_width, q_width, head_dim, shape)
    if plan.attn == "sdpa" and (packed_sequences(plan) or repeat) and kv_width < q_width:
        # With a mask transformers does grouped-query attention by repeat_kv (use_gqa_in_sdpa is False):
        # k and v are copied out to every query head, and sdpa saves the copies.
        saved["q_rotary"] = q_width * p
        saved["k_repeated"] = q_width * p
        saved["v_repeated"] = q_width * p
        saved["attn_out"] = q_width * p
        saved["attn_logsumexp"] = spec.num_heads * 4
        o_key = "attn_out"
    elif plan.attn != "eager":  # sdpa and flash attention save the same tensors
        saved["q_rotary"] = q_width * p
        saved["k_rotary"] = kv_width * p
        # fused qkv: v is a view of the whole qkv output, which then stays alive
        saved["v"] = (q_width + 2 * kv_width) * p if fused_qkv else kv_width * p
        saved["attn_out"] = q_width * p
        saved["attn_logsumexp"] = spec.num_heads * 4
        o_key = "attn_out"
    else:
        s = plan.seq_len
        saved["q_rotary"] = q_width * p
        saved["k_repeated"] = q_width * p
        saved["v_repeated"] = q_width * p
        if spec.attention_sinks:  # gpt-oss: softmax over scores + sink in their dtype, the max's indices
            saved["attn_probs_sinks"] = spec.num_heads * (s + 1) * p
            saved["attn_max_indices"] = spec.num_heads * 8
        else:
            saved["attn_probs_fp32"] = spec.num_heads * s * 4
        if p != 4 and not spec.attention_sinks:
            saved["attn_probs_cast"] = spec.num_heads * s * p
        o_key = "attn_out_contiguous"
    if shape is not None and not shape.kv_heads:  # the storing layer's K/V, counted there
        saved.pop("k_rotary", None), saved.pop("v", None)
    t.linear_input("o_proj", q_width, p, o_key)


def _mlp_block(t: LayerTerms) -> None:
    spec, d, saved = t.spec, t.d, t.saved
    h, inter = spec.hidden_size, (t.shape and t.shape.inter) or spec.intermediate_size
    names = mlp_linear_names(spec.decoder_linears, h)  # (gate, up, down) as the model names them
    fused_gate_up = len(names) == 2
    p = d.proj
    for _ in range(max(spec.norms_per_layer - 2, 0) // 2):  # Gemma-2 post-attention / post-MLP norms
        t.norm(f"post_norm_{_}a")
        t.norm(f"post_norm_{_}b")
    t.norm("post_attention_layernorm")
    for m, leaf in zip(("gate_up_proj",) if fused_gate_up else ("gate_proj", "up_proj"), names, strict=False):
        t.linear_input(m, h, d.hidden, "mlp_norm_out", leaf)
    if fused_gate_up:
        saved["gate_up"] = 2 * inter * p
    else:
        saved["gate"] = inter * p
        saved["up"] = inter * p
    if not t.liger:  # LigerSiLUMulFunction saves gate and up only and recomputes silu(gate) in backward
        saved["act_gate"] = inter * p
    t.linear_input("down_proj", inter, p, "gated_product", names[-1])


def layer_activation_bytes(spec: ModelSpec, plan: Plan, targets=()) -> float:
    """Saved bytes per token for one decoder layer (sum of `layer_saved_tensors`)."""
    return sum(layer_saved_tensors(spec, plan, targets).values())


def head_saved_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Per token: what the final norm's weight multiply and the lm_head save when their weights train (full
    fine-tuning): the normed input of the weight multiply and the lm_head input."""
    if plan.tuning != "full":
        return 0
    d = step_dtypes(plan)
    if plan.fused_lm_head:  # the fused head saves its own input (fused_head_bytes), no lm_head module call
        return spec.hidden_size * d.hidden
    return spec.hidden_size * (d.hidden + (d.proj if d.autocast else d.hidden))


def outside_layers_saved_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Per token: final norm, the lm_head input (when it trains), token ids and labels."""
    return 4 * spec.hidden_size + 4 + 16 + head_saved_bytes(spec, plan)


def embedding_output_requires_grad(plan: Plan) -> bool:
    """Does the first decoder layer get an input that requires grad? Only when the embedding trains (full
    fine-tuning) or the run engine calls enable_input_require_grads (LoRA with gradient checkpointing)."""
    return plan.tuning == "full" or (plan.tuning == "lora" and checkpointing_on(plan))


def first_layer_unsaved(saved: dict[str, float], targets) -> float:
    """Per token: what the first layer does not save when its input (the frozen embedding's output) needs no
    grad. Autograd saves an op's input only to compute a gradient that someone needs: the input RMSNorm saves
    nothing, LoRA dropout on the layer input keeps no mask (its output, lora_A's input, is still saved);
    when no attention projection is adapted, nothing in the attention block requires grad either."""
    adapted = {s.name.rsplit(".", 1)[-1] for s in targets}
    attn_in = {"q_proj", "k_proj", "v_proj", "qkv_proj"}
    # a recurrent mixer's input projections (in_proj, in_proj_qkv, ...) read the layer input's norm too
    mixer_in = tuple(k for k in saved if k.startswith("in_proj") and k.endswith(".lora_dropout_mask"))
    skip = ("input_layernorm.",) + tuple(f"{m}.lora_dropout_mask" for m in attn_in) + mixer_in
    if "q_rotary" in saved and not adapted & attn_in:
        skip += ("q_rotary", "k_", "v", "attn_", "o_proj.lora_dropout_mask")
        if "o_proj" not in adapted:
            skip += ("post_attention_layernorm.", "gate_proj.lora_dropout_mask", "up_proj.lora_dropout_mask")
            skip += ("gate_up_proj.lora_dropout_mask",)
    return sum(v for k, v in saved.items() if k.startswith(skip))


def beside_the_mixer(t: LayerTerms, block: str) -> float:
    """Per token: what the bill of a layer puts next to its mixer's temporaries that is not alive at their
    moments. The layer's bill is its whole saved set plus the temporaries, but a dense MLP after the mixer
    (Granite 4.0-H, Bamba, Falcon-H1) runs after it: at the mixer's forward moments (a checkpointed layer
    recomputes the mixer first) its saved tensors do not exist yet, and at the mixer's backward ones the MLP's
    backward has freed them. With checkpointing the bill also puts the MLP's flowing gradients next to the
    recomputed layer (bill.backward_moment's first layer): gone too by the mixer's backward, not yet made at its
    recompute. Measured: a tiny Granite 4.0-H twin's checkpointed step peaks inside the Mamba layer's backward at
    its saved mixer, its temporaries and nothing of its MLP. A MoE block's: core.estimate.moe_terms'."""
    out = 0.0
    if block == "mlp":
        mlp = copy.copy(t)
        mlp.saved = {}
        _mlp_block(mlp)
        out += sum(mlp.saved.values())
    if checkpointing_on(t.plan):
        factors = 1 if t.liger else 3
        out += factors * t.spec.intermediate_size * t.d.proj + t.spec.hidden_size * t.d.hidden
    return out


def layers_saved(
    spec: ModelSpec,
    plan: Plan,
    targets,
    ffn: dict[str, float] | None = None,
    beside: dict[str, float] | None = None,
):
    """Per token, each decoder layer's (saved bytes, its saved tensors' dict, its recurrent mixers' backward
    temporaries), in order: the layer's mixers (core.estimate.layer_kinds) plus its feed-forward block, `ffn`
    giving a block's bytes by kind ("mlp", "moe"; a dense MLP by default), `beside` what a block of a kind holds
    that is not alive at its mixer's moments (beside_the_mixer's for a dense MLP by default)."""
    by_mixers: dict[tuple, tuple[dict, float]] = {}
    dense_by_shape, out = {}, []
    kinds = zip(kinds_of(spec), layer_shapes.shapes_of(spec), strict=True)
    for i, ((mixers, block), shape) in enumerate(
        kinds
    ):  # a kind's first layer: which of its Linears are adapted
        if shape not in dense_by_shape:  # a layer of its own shape (Gemma 4) has its own MLP width
            dense_by_shape[shape] = layer_saved_tensors(spec, plan, targets, mixers=(), shape=shape, layer=i)
        dense = dense_by_shape[shape]
        widths = {"mlp": sum(dense.values()), "none": 0, **(ffn or {})}
        if (mixers, block, shape) not in by_mixers:
            part = layer_saved_tensors(spec, plan, targets, mixers=mixers, ffn=False, shape=shape, layer=i)
            t = LayerTerms(spec, plan, targets, layer=i)
            if mixers:
                t.beside = (beside or {})[block] if block in (beside or {}) else beside_the_mixer(t, block)
            temps = [mixer_temporaries(t, m) for m in mixers]
            by_mixers[(mixers, block, shape)] = part, max((max(f, b) for f, b in temps), default=0.0)
        part, temp = by_mixers[(mixers, block, shape)]
        saved = {**part, **(dense if block == "mlp" else {})}
        out.append((sum(part.values()) + widths[block], saved, temp))
    return out


def activation_bytes(
    spec: ModelSpec,
    plan: Plan,
    targets,
    tokens: int,
    ffn: dict[str, float] | None = None,
    outside: float = 0,
    beside: dict[str, float] | None = None,
) -> tuple[int, int, int]:
    """(saved activations alive at the end of forward, one layer recomputed in backward with checkpointing, the
    activations at the largest moment of a recurrent layer's backward without it: its backward temporaries next to
    the layers still saved below it), summed over the model's layers as each is (`ffn`: layers_saved's;
    `outside`: more per-token bytes saved outside the layers; `beside`: layers_saved's)."""
    layers = layers_saved(spec, plan, targets, ffn, beside)
    outside += outside_layers_saved_bytes(spec, plan)
    outside += layer_shapes.outside_saved(LayerTerms(spec, plan, targets), checkpointing_on(plan))
    if checkpointing_on(plan):
        layer_inputs = spec.num_layers * spec.hidden_size * step_dtypes(plan).hidden
        # Liger's input norm saves the layer input itself, which the checkpoint holds already
        liger_input = liger_on(plan)
        recompute = max(
            b - liger_input * saved.get("input_layernorm.input", 0) + temp for b, saved, temp in layers
        )
        return int(tokens * (layer_inputs + outside)), int(tokens * recompute), 0
    first = 0 if embedding_output_requires_grad(plan) else first_layer_unsaved(layers[0][1], targets)
    below, recurrent = 0.0, 0.0
    for b, _saved, temp in layers:  # backward reaches a recurrent layer with the layers under it still saved
        below += b
        if temp:
            recurrent = max(recurrent, below - first + temp)
    return int(tokens * (sum(b for b, _, _ in layers) - first + outside)), 0, int(tokens * recurrent)


def checkpointing_on(plan: Plan) -> bool:
    # The run engine calls prepare_model_for_kbit_training(use_gradient_checkpointing=<this flag>), so
    # checkpointing follows the plan's setting for QLoRA too (peft's own default would turn it on).
    return plan.gradient_checkpointing


def logits_bytes(spec: ModelSpec, plan: Plan, tokens: int) -> tuple[int, int]:
    """(peak inside the forward's cross-entropy, peak at the start of backward) for b*s*V logits.

    Forward: lm_head logits + their fp32 upcast + log_softmax output (saved). Backward: the saved
    log_softmax + the dense fp32 gradient of the loss + the log_softmax gradient (12 B per logit).
    """
    n = tokens * spec.vocab_size
    p = step_dtypes(plan).logits
    forward = n * (p + (4 if p != 4 else 0) + 4)
    backward = n * 12
    config = json.loads(spec.config_json)
    if config.get("final_logit_softcapping"):  # Gemma-2: tanh(logits / cap) * cap saves two more copies
        forward += 2 * n * p
        backward += 2 * n * p
    return forward, backward


def attention_mask_bytes(spec: ModelSpec, plan: Plan, tokens: int) -> tuple[int, int]:
    """(held for the whole step, saved per layer call) of the attention mask of a padding-free batch that holds
    several sequences. transformers (masking_utils) derives a block-diagonal boolean (T x T) mask from
    position_ids, alive until the step's backward is done; torch's scaled_dot_product_attention converts a
    boolean mask to the query dtype in every call (convert_boolean_attn_mask) and saves that copy for backward.
    Eager attention gets the float mask once (no per-layer copy). Flash attention takes the sequence bounds
    (cu_seq_lens) instead: no mask. Measured on the CPU (sdpa)."""
    if plan.attn == "flash" or not packed_sequences(plan):
        return 0, 0
    t2 = tokens * tokens
    if plan.attn == "eager":
        return t2 * step_dtypes(plan).attn, 0
    return t2, t2 * step_dtypes(plan).attn


def offloaded_activations(
    spec: ModelSpec, plan: Plan, targets, tokens: int, saved: int, recompute: int
) -> tuple[int, int, int]:
    """(GPU bytes at the end of forward, GPU bytes while one layer's backward runs, pinned CPU bytes) with TRL's
    activation offloading (trl.models.activation_offloading.OffloadActivations, use_streams=True): every saved
    tensor of at least 1 KiB on the accelerator is copied to pinned CPU memory during forward, the last five
    stay on the GPU while their copies are in flight, and backward brings each one back just before its node
    runs (the next one prefetched). With checkpointing the saved tensors are the layer inputs (the checkpoint
    saves them through the same hooks) and the recomputed layer stays on the GPU (backward runs outside the
    offloading context). Modelled from the code, not yet measured (it moves nothing on a CPU)."""
    if checkpointing_on(plan):
        unit = tokens * spec.hidden_size * step_dtypes(plan).hidden  # one layer input
        in_flight = min(OFFLOAD_STASH, spec.num_layers) * unit
        return in_flight, recompute + 2 * unit, saved
    layer = layer_saved_tensors(spec, plan, targets)
    largest = sorted(layer.values(), reverse=True)[:OFFLOAD_STASH]
    in_flight = int(tokens * sum(largest))
    per_layer = int(tokens * sum(layer.values()))
    # backward holds the layer being differentiated and the prefetched one: two layers' saved tensors
    return in_flight, 2 * per_layer, saved


def kv_cache_bytes_per_token(spec: ModelSpec, plan: Plan) -> int:
    return spec.kv_cache_bytes_per_token_per_byte * DTYPE_BYTES[plan.compute_dtype]
