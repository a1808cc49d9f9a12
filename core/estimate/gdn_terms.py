"""The Gated DeltaNet mixer (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next linear-attention layers): what one mixer keeps
for backward and what it holds for a moment, per token, from the code that runs it.

Which code runs (transformers 5.x, integrations/hub_kernels.use_kernel_func_from_hub_with_fallback):
`chunk_gated_delta_rule` is fla's (flash-linear-attention, `fla.ops.gated_delta_rule`) only when `fla` imports
and the first tensor argument is on cuda / xpu / mlu / npu (and not under torch.export); `causal_conv1d_fn` is
causal-conv1d's only when `causal_conv1d` imports and the tensors are on cuda. Otherwise (a CPU run, or either
package missing) the reference torch code runs: `torch_chunk_gated_delta_rule` and the F.conv1d fallback. A hub
kernel (`kernels`, use_kernels=True) would replace them first; the planner does not model that.

`kernel=True` models fla's chunk_gated_delta_rule + causal-conv1d's autograd Functions from their source (what
their ctx.save_for_backward keeps); it is modelled, not measured. `kernel=False` is the torch path, measured on
the CPU tensor by tensor (autocast bf16 and fp32, LoRA on and off the mixer's Linears, dropout 0 / 0.05).
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK = 64  # torch_chunk_gated_delta_rule's chunk_size default (fla's chunk size is 64 as well)
_GDN_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


@dataclass(frozen=True)
class GdnFacts:
    hidden: int
    k_heads: int  # linear_num_key_heads
    v_heads: int  # linear_num_value_heads
    k_dim: int  # linear_key_head_dim
    v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    fused: bool  # Qwen3-Next: in_proj_qkvz + in_proj_ba instead of in_proj_qkv/z/b/a
    gdn_layers: int  # how many layers are linear_attention
    first_is_gdn: bool  # layer 0 is a GDN layer (Qwen3.5's and Qwen3-Next's default pattern)
    chunk: int = CHUNK

    @property
    def key_width(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_width(self) -> int:  # the conv runs over q, k and v together
        return 2 * self.key_width + self.value_width

    @property
    def linears(self) -> tuple[str, ...]:
        if self.fused:
            return ("in_proj_qkvz", "in_proj_ba", "out_proj")
        return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def gdn_facts(text_config: dict) -> GdnFacts | None:
    """The mixer's widths from a (text) config dict; None when it has no Gated DeltaNet layer. Layer kinds follow
    the configuration classes: `layer_types`, else linear_attention except every full_attention_interval-th."""
    cfg = text_config.get("text_config") or text_config
    if cfg.get("model_type") not in _GDN_TYPES and "linear_num_value_heads" not in cfg:
        return None
    n = int(cfg.get("num_hidden_layers", 0))
    kinds = cfg.get("layer_types")
    if not kinds:
        every = int(cfg.get("full_attention_interval", 4))
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    gdn = sum(k == "linear_attention" for k in kinds)
    if not gdn:
        return None
    return GdnFacts(
        hidden=int(cfg["hidden_size"]),
        k_heads=int(cfg.get("linear_num_key_heads", 16)),
        v_heads=int(cfg.get("linear_num_value_heads", 32)),
        k_dim=int(cfg.get("linear_key_head_dim", 128)),
        v_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        fused=str(cfg.get("model_type", "")).startswith("qwen3_next"),
        gdn_layers=gdn,
        first_is_gdn=kinds[0] == "linear_attention",
    )


def _shape(t, f: GdnFacts) -> tuple[int, float, int]:
    """(tokens per row, padded / real length, chunks per row): the torch path pads each row to whole chunks."""
    s = max(int(t.plan.seq_len), 1)
    chunks = -(-s // f.chunk)
    return s, chunks * f.chunk / s, chunks


def _proj_bytes(t) -> int:
    """dtype of the Linear outputs (q/k/v/z/b/a and the conv): 16-bit under autocast, else the load dtype."""
    return t.d.proj


def gdn_mixer_saved(t, f: GdnFacts, kernel: bool) -> None:
    """Per token, what one GDN mixer saves for backward, into `t.saved` (rows of t.plan.seq_len tokens).

    Torch path, transformers models/qwen3_5/modeling_qwen3_5.py (qwen3_next identical but for the fused
    projections): Qwen3_5GatedDeltaNet.forward, causal_conv1d_fn (F.conv1d + silu), torch_chunk_gated_delta_rule,
    l2norm, Qwen3_5RMSNormGated. Kernel path: fla.ops.gated_delta_rule.chunk.ChunkGatedDeltaRuleFunction and
    causal_conv1d.causal_conv1d_interface.CausalConv1dFn (modelled from their save_for_backward)."""
    s, rho, chunks = _shape(t, f)
    p, d, saved, full = _proj_bytes(t), t.d, t.saved, t.plan.tuning == "full"
    h, nv = f.hidden, f.v_heads
    kw, vw, cw = f.key_width, f.value_width, f.conv_width
    # Every input projection reads the input norm's output (without a padding mask; with one,
    # apply_mask_to_padding_states makes a masked copy that they read instead).
    for m in f.linears[:-1]:
        t.linear_input(m, h, d.hidden, "attn_norm_out")
    # The depthwise conv saves its input (q|k|v, the projection output or, fused, torch.cat's copy); silu
    # saves the conv output, whose storage is kernel-1 tokens longer than the row.
    saved["gdn.conv_input"] = cw * p
    if kernel:
        # CausalConv1dFn saves x, weight, bias and (with silu fused) recomputes the activation in backward.
        _kernel_saved(t, f, s)
    else:
        saved["gdn.conv_out"] = cw * p * (s + f.conv_kernel - 1) / s
        _torch_rule_saved(t, f, s, rho, chunks)
    # beta = b.sigmoid() saves its output; softplus(a.float() + dt_bias) its fp32 input; -A_log.exp() a
    # per-layer [v_heads] tensor. Full fine-tuning trains A_log: the multiply then saves softplus's output too.
    saved["gdn.beta"] = nv * p
    saved["gdn.softplus_input"] = nv * 4
    saved["gdn.neg_A"] = nv * 4 / s
    if full:
        saved["gdn.softplus_out"] = nv * 4
    # Qwen3_5RMSNormGated over v_dim per head: fp32 input and rstd, weight * x.to(input dtype) (x saved only
    # when the weight trains), silu(gate.float()) saves the fp32 gate, the gating multiply both its inputs.
    saved["gdn_norm.fp32_input"] = vw * 4
    saved["gdn_norm.rstd"] = nv * 4
    if full:
        saved["gdn_norm.normed"] = vw * p
    saved["gdn_norm.gate_fp32"] = vw * 4
    if f.fused and p == 4 and f.v_heads == f.k_heads:
        # fp32 Qwen3-Next with one value head per key head: z stays a view of in_proj_qkvz's output, so the
        # gate silu keeps that whole storage.
        saved["gdn_norm.gate_fp32"] = (2 * kw + 2 * vw) * 4
    saved["gdn_norm.weighted"] = vw * p
    saved["gdn_norm.silu_gate"] = vw * 4
    t.linear_input("out_proj", vw, p, "gdn_norm_out")


def _torch_rule_saved(t, f: GdnFacts, s: int, rho: float, chunks: int) -> None:
    """torch_chunk_gated_delta_rule: q, k, v, beta, g to fp32 ([b, heads, len, dim], k/q repeated to the value
    heads), l2norm of q and k, right-padding to whole chunks, the UT transform per chunk (two 64x64 products,
    two triangular solves), then a Python loop over chunks that carries the [v_heads, k_dim, v_dim] state.
    Under autocast every `@` casts its fp32 operands to 16-bit copies that the matmul saves."""
    saved, ac = t.saved, t.d.autocast
    nv, dk, dv, c = f.v_heads, f.k_dim, f.v_dim, f.chunk
    mm = 2 if ac else 4  # what the matmuls produce and save
    pad = rho  # per real token, a padded [len] tensor costs rho tokens
    if not ac and t.d.proj == 4 and f.k_heads == f.v_heads:
        # fp32 without repeat: .to(float32) is a no-op and q, k stay views of the conv activation's storage
        saved["gdn.conv_act"] = f.conv_width * 4
    else:
        saved["gdn.q_fp32"] = nv * dk * 4  # the repeated / upcast copies l2norm saves
        saved["gdn.k_fp32"] = nv * dk * 4
    saved["gdn.q_k_inv_norm"] = 2 * nv * 4
    saved["gdn.q_k_padded"] = 2 * nv * dk * 4 * pad  # F.pad copies; v_beta / k_beta and the decays save them
    saved["gdn.v_padded"] = nv * dv * 4 * pad
    saved["gdn.beta_padded"] = nv * 4 * pad
    saved["gdn.k_beta"] = nv * dk * 4 * pad
    saved["gdn.pairwise_decay"] = nv * c * 4 * pad  # exp() of the 64x64 decay matrices, saves its output
    saved["gdn.ut_system"] = nv * c * 4 * pad  # solve_triangular saves A and its result
    saved["gdn.kk_qk_products"] = 2 * nv * c * mm * pad  # the multiplies by pairwise_decay save them
    saved["gdn.new_values"] = nv * dv * 4 * pad
    saved["gdn.k_cumdecay"] = nv * dk * 4 * pad
    saved["gdn.decay_exps"] = 3 * nv * 4 * pad + nv * 4 * pad / c
    saved["gdn.causal_mask"] = c * c / s
    state = nv * dk * dv  # one recurrent state
    if ac:
        saved["gdn.matmul_copies"] = (
            4 * nv * dk * 2 * pad
        )  # k_beta, key^T (twice), query for the 64x64 products
        # The chunk loop, per chunk: two 16-bit copies of the state, two of v_new, intra[i], key[i]^T, and from
        # the second chunk on k_cumdecay[i] and query[i] (the zero first state needs no gradient); the fp32
        # state for the decay multiply. The last update feeds a discarded state: its operands are freed.
        saved["gdn.loop_state_copies"] = 2 * chunks * state * 2 / s
        saved["gdn.loop_state_fp32"] = (chunks - 1) * state * 4 / s
        saved["gdn.loop_v_new_copies"] = (2 * chunks - 1) * c * nv * dv * 2 / s
        saved["gdn.loop_kqk_copies"] = 3 * (chunks - 1) * c * nv * dk * 2 / s
        saved["gdn.loop_intra_copies"] = chunks * nv * c * c * 2 / s
    else:
        if s % c == 0:
            # No padding: F.pad keeps l2norm's [b, len, heads, dim] layout (the fp32 .to() was a no-op view), so
            # each 5-d `@` copies k_beta, key^T (twice) and query contiguous, and saves the copies.
            saved["gdn.matmul_copies"] = 4 * nv * dk * 4
        # fp32: the matmuls save views of whole tensors: the decayed query and key, intra-chunk attention
        saved["gdn.decayed_q_k"] = 2 * nv * dk * 4 * pad
        saved["gdn.intra_chunk_attn"] = nv * c * 4 * pad
        saved["gdn.loop_state_fp32"] = chunks * state * 4 / s
        saved["gdn.loop_v_new"] = chunks * c * nv * dv * 4 / s


def _kernel_saved(t, f: GdnFacts, s: int) -> None:
    """fla ChunkGatedDeltaRuleFunction.forward (fla/ops/gated_delta_rule/chunk.py) with use_qk_l2norm_in_kernel:
    saves q, k (the l2-normed ones) and their rstd, v, g (cumsum'd fp32), beta, A (the WY inverse, fp32 per
    64-chunk), initial_state; the chunk states h are recomputed in backward. transformers hands it q, k, v in
    the conv's dtype, [b, len, heads, dim], k/q not repeated (GVA in the kernel). CausalConv1dFn saves x and
    weight (and recomputes the silu); here its input is already counted as gdn.conv_input."""
    saved = t.saved
    nk, nv, dk, dv, c = f.k_heads, f.v_heads, f.k_dim, f.v_dim, f.chunk
    p = _proj_bytes(t)
    saved["gdn_fla.q_k_normed"] = 2 * nk * dk * p
    saved["gdn_fla.q_k_rstd"] = 2 * nk * 4
    saved["gdn_fla.v"] = nv * dv * p
    saved["gdn_fla.g_cumsum"] = nv * 4
    saved["gdn_fla.beta"] = nv * p
    saved["gdn_fla.A"] = nv * c * 4


def _post_saved(t, f: GdnFacts) -> float:
    """What the mixer saves after the chunk rule returns (the gated norm and out_proj's LoRA input)."""
    return sum(v for k, v in t.saved.items() if k.startswith(("gdn_norm.", "out_proj.", "gdn_norm_out")))


def gdn_forward_temporaries(t, f: GdnFacts, kernel: bool) -> float:
    """Per token: the most the mixer's forward holds beyond its saved tensors (its input excluded, its output
    included), the larger of two moments of Qwen3_5GatedDeltaNet.forward / torch_chunk_gated_delta_rule:

    - the chunk loop's last chunk: v_beta, decayed k_beta, the fp32 padded output (zeros_like), the conv
      activation whose views q/k/v the forward holds, z, b, a, g, decay and its cumsum, and (autocast) the
      decayed query / key and the fp32 intra-chunk attention, plus the loop's state, v_new and product
      temporaries; the gated norm and out_proj have saved nothing yet, and (autocast) the last update's
      operands are still alive;
    - the gated norm's end: its fp32 product, the 16-bit copies around it, the activation, z and the output."""
    if not t.saved:
        gdn_mixer_saved(t, f, kernel)
    s, rho, chunks = _shape(t, f)
    p, ac = _proj_bytes(t), t.d.autocast
    h, nv, dk, dv, c = f.hidden, f.v_heads, f.k_dim, f.v_dim, f.chunk
    vw, cw = f.value_width, f.conv_width
    state = nv * dk * dv
    held = cw * p + 3 * nv * p  # the conv activation (q/k/v views), b, a ... and g (fp32)
    held += nv * (4 - p)
    z = 0 if (not ac and p == 4) else vw * p  # fp32: z is itself the gate silu saved
    if f.fused:
        # z (and b, a) are views of the fused projections' outputs, which the forward holds whole
        z = (2 * f.key_width + 2 * vw) * p
    if kernel:
        # fla's forward: h states per chunk [v_heads, k_dim, v_dim] fp32, w/u (k/v-wide), A, o; modelled.
        loop = held + z + (s // c + 1) * state * 4 / s + nv * (dk + dv) * 4 + nv * c * 4 + vw * p
        return max(loop - _post_saved(t, f), vw * 4 + vw * p + held + z + h * p)
    loop = held + z + 2 * nv * 4 * rho  # padded decay, cumsum
    loop += (nv * dv + nv * dk + nv * dv) * 4 * rho  # v_beta, decayed k_beta, the fp32 output buffer
    loop += (2 * state * 4 + c * nv * dv * 4) / s  # state * decay, the new state, v_new
    if ac:
        loop += (2 * nv * dk + nv * c) * 4 * rho  # decayed query, key, intra-chunk attention (not saved)
        loop += (state * 2 + c * nv * dv * 2) / s  # key^T @ v_new and intra @ v_new outputs (16-bit)
        loop += (state * 4 + c * nv * (dk + dv) * 2) / s  # the discarded last update's operands
    else:
        loop += (state * 4 + c * nv * dv * 4) / s
    loop -= _post_saved(t, f)
    end = held + z + vw * 4 + h * p  # the gated product (fp32), the output
    end += 3 * vw * p if ac else nv * dv * 4 * rho  # 16-bit copies / the padded output's fp32 copy
    return max(loop, end)


def gdn_backward_temporaries(t, f: GdnFacts, kernel: bool) -> float:
    """Per token: the most the mixer's backward holds beyond its saved tensors (the output and its gradient
    excluded). It peaks in the chunk loop's backward: every `x[:, :, i]` of the loop has a select_backward
    that allocates a whole padded-length gradient, so the gradients of new_values, k_cumdecay, the decayed
    query and key, intra-chunk attention and the padded output are all alive at full length, with one more
    being added; by then the gated norm's saved tensors are freed."""
    if not t.saved:
        gdn_mixer_saved(t, f, kernel)
    s, rho, chunks = _shape(t, f)
    p = _proj_bytes(t)
    nv, dk, dv, c = f.v_heads, f.k_dim, f.v_dim, f.chunk
    state = nv * dk * dv
    if kernel:
        # fla's backward recomputes the chunk states and holds dq, dk, dv, dg, db plus dh per chunk; modelled.
        return (s // c + 1) * state * 4 / s + nv * (2 * dk + 2 * dv) * 4 + 2 * f.key_width * p
    grads_v = 2 * nv * dv * 4 * rho  # the padded output's gradient and new_values'
    grads_k = 3 * nv * dk * 4 * rho  # k_cumdecay, decayed query, decayed key
    grads_intra = nv * c * 4 * rho
    # adding one more slice's gradient: a second whole tensor of the widest kind for a moment
    extra = max(nv * dv, nv * dk, 2 * nv * c) * 4 * rho
    per_chunk = (state * 4 + 3 * c * nv * dv * 4) / s
    freed = _post_saved(t, f)
    return grads_v + grads_k + grads_intra + extra + per_chunk + f.value_width * p - freed
