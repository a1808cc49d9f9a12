"""Kimi Delta Attention (KDA: Kimi Linear's linear-attention layers, and Bailing hybrid's / Ling 2.5's): what one
mixer keeps for backward and what it holds for a moment, per token, from the code that runs it.

KDA is Gated DeltaNet with a decay per channel rather than per head (core.estimate.gdn_terms), and that one change
makes transformers' torch path expensive: `chunk_kimi_delta_attention` builds the pairwise decays of every chunk for
every key channel, a (heads x chunks x 64 x 64 x head_dim) fp32 tensor (64 x head_dim x 4 bytes per head and token,
32 KiB at head_dim 128), and multiplies it twice; its UT solve is a Python loop over the 63 rows of each chunk whose
clones autograd keeps. At Kimi Linear's widths (32 heads of 128) one layer saves over 2 MiB per token.

Which code runs (transformers 5.x, integrations/hub_kernels.use_kernel_func_from_hub_with_fallback): `chunk_kda` of
flash-linear-attention (`fla.ops.kda`) when `fla` imports and the tensors are on CUDA, else the torch reference
above; `causal_conv1d_fn` is causal-conv1d's under the same rule, else F.conv1d. `kernel=True` models fla's
ChunkKDAFunction from its source (ctx.save_for_backward of fla/ops/kda/chunk.py: the normed q and k with their rstd,
v, the fp32 chunk-cumsummed gate, the raw gate, beta and the two (chunk x 64) intra-chunk matrices Aqk and Akk; the
states, w, u, qg, kg and v_new are recomputed in backward); it is modelled, not measured (no CUDA here). The
conv is planned as F.conv1d's on both paths. `kernel=False` is the torch path, tensor by tensor equal to autograd's
(tests/test_linear_attention_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK = 64  # chunk_kimi_delta_attention's chunk_size default (fla's too)
_FAMILIES = ("kimi_linear", "bailing_hybrid")


@dataclass(frozen=True)
class KdaFacts:
    family: str
    hidden: int
    heads: int  # linear_num_heads
    head_dim: int  # linear_head_dim (q, k and v alike)
    conv_kernel: int  # linear_conv_kernel_dim
    gate: str  # "where" (Kimi: where(g > 20, g, log(1 + exp(g)))), "safe" (lower_bound * sigmoid), "softplus"
    chunk: int = CHUNK

    @property
    def width(self) -> int:  # q, k, v, the gate and the output: heads x head_dim each
        return self.heads * self.head_dim

    @property
    def low_rank(self) -> bool:
        """Kimi's forget gate and output gate go through head_dim (f_a/f_b, g_a/g_b); Bailing's are one Linear."""
        return self.family == "kimi_linear"


def kda_facts(text_config: dict) -> KdaFacts | None:
    """The mixer's widths from a (text) config dict, as the configuration classes leave them (Bailing's sets
    linear_head_dim / linear_num_heads from head_dim / num_attention_heads); None for other families."""
    c = text_config
    family = c.get("model_type")
    if family not in _FAMILIES:  # which layers are KDA is core.estimate.layer_kinds' (the module tree)
        return None
    if family == "kimi_linear":
        gate = "where"
    else:
        gate = "safe" if c.get("kda_safe_gate", True) else "softplus"
    heads = c.get("linear_num_heads") or c.get("num_attention_heads")
    head_dim = c.get("linear_head_dim") or c.get("head_dim")
    if not heads or not head_dim:
        return None
    kernel = c.get("linear_conv_kernel_dim") or c.get("short_conv_kernel_size") or 4
    return KdaFacts(family, int(c["hidden_size"]), int(heads), int(head_dim), int(kernel), gate)


def _shape(t, f: KdaFacts) -> tuple[int, int, int]:
    """(tokens per row, padded tokens per row, chunks per row): the torch path pads each row to whole chunks."""
    s = max(int(t.plan.seq_len), 1)
    chunks = -(-s // f.chunk)
    return s, chunks * f.chunk, chunks


def _linears(t, f: KdaFacts) -> None:
    """What the mixer's Linears keep of their inputs: q/k/v, b_proj and the gates read the input norm's output
    (without a padding mask; with one, apply_mask_to_padding_states makes the masked copy they read)."""
    d, h, w, p = t.d, f.hidden, f.width, t.d.proj
    reads_norm = ("q_proj", "k_proj", "v_proj", "b_proj")
    reads_norm += ("f_a_proj", "g_a_proj") if f.low_rank else ("f_proj", "g_proj")
    for m in reads_norm:
        t.linear_input(m, h, d.hidden, "attn_norm_out")
    if f.low_rank:  # the second halves read the head_dim-wide outputs of the first
        t.linear_input("f_b_proj", f.head_dim, p, "kda.f_a_out")
        t.linear_input("g_b_proj", f.head_dim, p, "kda.g_a_out")
    t.linear_input("o_proj", w, p, "kda.norm_out")


def kda_mixer_saved(t, f: KdaFacts, kernel: bool) -> None:
    """Per token, what one KDA mixer saves for backward, into `t.saved` (rows of t.plan.seq_len tokens).

    Torch path, transformers models/kimi_linear/modeling_kimi_linear.py (bailing_hybrid's identical but for its
    gate): KimiLinearDeltaAttention.forward, causal_conv1d_fn (F.conv1d + silu), KimiLinearForgetGate /
    BailingHybridForgetGate, chunk_kimi_delta_attention, l2norm, KimiLinearRMSNormGated."""
    s, padded, chunks = _shape(t, f)
    d, saved, full = t.d, t.saved, t.plan.tuning == "full"
    p, w, nh = d.proj, f.width, f.heads
    _linears(t, f)
    # F.conv1d saves its input, torch.cat's q|k|v; silu its input, the conv output kernel-1 tokens longer
    saved["kda.conv_input"] = 3 * w * p
    saved["kda.conv_out"] = 3 * w * p * (s + f.conv_kernel - 1) / s
    # the forget gate: fp32 from `.float()` on; A_log trains only in full fine-tuning
    if f.gate == "where":  # exp saves its output, log(1 + .) its input, where its condition
        saved["kda.gate_exp"] = w * 4
        saved["kda.gate_log_input"] = w * 4
        saved["kda.gate_condition"] = w
    elif f.gate == "safe":  # sigmoid(decay_rate * g) saves its output
        saved["kda.gate_sigmoid"] = w * 4
    else:  # F.softplus saves its input
        saved["kda.gate_softplus_input"] = w * 4
    # exp(A_log), a per-layer [heads] tensor the multiply keeps: Kimi takes A_log.float(), Bailing its own dtype
    saved["kda.decay_rate"] = nh * (4 if f.low_rank or t.plan.load_dtype == "fp32" else 2) / s
    if full:
        saved["kda.gate_trained_operand"] = w * 4
    saved["kda.beta"] = nh * p  # sigmoid saves its output
    if kernel:
        _kernel_saved(t, f)
    else:
        _torch_rule_saved(t, f, s, padded, chunks)
    # KimiLinearRMSNormGated over head_dim: `.to(float32)` of the output (pow / the rstd multiply save it), rstd
    # per head, the weight's fp32 copy (a 16-bit load), sigmoid(gate.float()) saves its output, the gating
    # multiply both its inputs; the normed x before the weight only when the weight trains.
    saved["kda_norm.fp32_input"] = w * 4
    saved["kda_norm.rstd"] = nh * 4
    if t.plan.load_dtype != "fp32" and not full:
        saved["kda_norm.weight_fp32"] = f.head_dim * 4 / s
    if full:
        saved["kda_norm.normed"] = w * 4
    saved["kda_norm.weighted"] = w * 4
    saved["kda_norm.gate_sigmoid"] = w * 4


def _loop_clones(c: int) -> int:
    """Elements per head and chunk that the UT loop's `row` and `sub` clones hold: i + i*i for rows 1..c-1."""
    return (c - 1) * c // 2 + (c - 1) * c * (2 * c - 1) // 6


def _torch_rule_saved(t, f: KdaFacts, s: int, padded: int, chunks: int) -> None:
    """chunk_kimi_delta_attention: q, k, v, beta, g to fp32 [b, heads, len, dim]; l2norm of q and k; right padding
    to whole chunks; the pairwise decays exp(g_i - g_j) per channel; the UT transform by a Python loop over rows;
    then a loop over chunks carrying the [heads, dim, dim] state. Under autocast every `@` casts its fp32 operands
    to 16-bit copies that the matmul saves; without it the matmuls save the tensors themselves. The last chunk's
    state update feeds a discarded state: what only it saved is freed when forward returns."""
    saved, ac = t.saved, t.d.autocast
    nh, dk, c, w = f.heads, f.head_dim, f.chunk, f.width
    m = 2 if ac else 4  # what the matmuls save of each operand
    pad = padded / s  # per real token, a padded [len] tensor costs pad tokens
    row = 1 / s  # a tensor per row (per chunk: * chunks)
    last = chunks - 1  # chunks whose state needs a gradient (the first starts from zeros)
    saved["kda.q_k_fp32"] = 2 * w * 4  # l2norm: x * x and the division keep the fp32 copy ...
    saved["kda.q_k_inv_norm"] = 2 * nh * 4  # ... and the norm
    saved["kda.v_k_padded"] = 2 * w * 4 * pad  # v_beta and k_beta keep F.pad's copies of v and k
    saved["kda.beta_padded"] = nh * 4 * pad
    saved["kda.k_beta"] = w * 4 * pad
    saved["kda.masks"] = 3 * c * c * row  # strict_mask, the UT mask, the loop's mask (bool)
    saved["kda.decay_mask"] = nh * c * dk * 4 * pad  # exp() keeps its output: [heads, chunks, c, c, dim]
    saved["kda.k_beta_key"] = nh * c * dk * 4 * pad  # k_beta * key, kept by its multiply with decay_mask
    saved["kda.ut_loop_clones"] = nh * chunks * _loop_clones(c) * 4 * row
    saved["kda.g_exp"] = w * 4 * pad  # g.exp() for k_cumdecay
    if ac:  # attn @ v_beta and attn @ (k_beta * g.exp()): a 16-bit copy of attn and of the operand each
        saved["kda.wy_matmuls"] = 2 * (nh * c * 2 + w * 2) * pad
    else:  # attn once (both matmuls keep it), v_beta and the k_beta product
        saved["kda.wy_matmuls"] = (nh * c * 4 + 2 * w * 4) * pad
    # the chunk loop: q (padded, scaled) kept whole by its first slice's multiply; per chunk q_i * exp(g_i) and
    # k_i * exp(g_last - g_i) keep their exp outputs, and q_i * k_i * decay its [c, c, dim] product
    saved["kda.q_padded"] = w * 4 * pad
    saved["kda.loop_q_k_products"] = nh * c * dk * 4 * pad
    saved["kda.loop_exps"] = (2 * nh * c * dk + nh * dk) * 4 * chunks * row
    # each chunk's matmuls: the state (chunk 0: zeros in the output dtype) and the decayed q (from chunk 1), the
    # intra-chunk scores and v_new, the decayed k (all chunks, v_new needs a gradient); v_prime's operands
    state = nh * dk * dk
    saved["kda.loop_inter"] = (chunks * state * m + last * nh * c * dk * m) * row
    saved["kda.loop_intra_v_new"] = chunks * (nh * c * c * m + nh * c * dk * m) * row
    saved["kda.loop_k_update"] = chunks * nh * c * dk * m * row
    # the 16-bit copies of the state for v_prime, the 16-bit k_cumdecay (from chunk 1), the fp32 states
    if ac:
        saved["kda.loop_v_prime"] = (last * state * 2 + (last > 0) * w * 2 * padded) * row
        saved["kda.loop_state_fp32"] = max(chunks - 2, 0) * state * 4 * row
    else:  # k_cumdecay whole (from chunk 1); the state is the one the first matmul keeps
        saved["kda.loop_v_prime"] = (last > 0) * w * 4 * pad
    # the discarded last update: its two exps and the decayed k's matmul operand are freed
    saved["kda.loop_exps"] -= (nh * c * dk + nh * dk) * 4 * row
    saved["kda.loop_k_update"] -= nh * c * dk * m * row


def _kernel_saved(t, f: KdaFacts) -> None:
    """fla ChunkKDAFunction.forward (fla/ops/kda/chunk.py) with use_qk_l2norm_in_kernel and disable_recompute
    False: q and k (normed, in the conv's dtype) with their fp32 rstd, v, the fp32 chunk-cumsummed gate, the raw
    gate (transformers' g: fp32 for Kimi, the stream dtype for Bailing), beta and Aqk, Akk (fp32, chunk wide)."""
    saved, p = t.saved, t.d.proj
    nh, w, c = f.heads, f.width, f.chunk
    saved["kda_fla.q_k_normed"] = 2 * w * p
    saved["kda_fla.q_k_rstd"] = 2 * nh * 4
    saved["kda_fla.v"] = w * p
    saved["kda_fla.g_cumsum"] = w * 4
    saved["kda_fla.g_input"] = w * (4 if f.low_rank else p)
    saved["kda_fla.Aqk_Akk"] = 2 * nh * c * 4


def _post_saved(t) -> float:
    """What the mixer saves after the chunk rule returns (the gated norm and o_proj's LoRA input)."""
    return sum(v for k, v in t.saved.items() if k.startswith(("kda_norm.", "o_proj.", "kda.norm_out")))


def kda_forward_temporaries(t, f: KdaFacts, kernel: bool) -> float:
    """Per token: the most the mixer's forward holds beyond its saved tensors (its input excluded, its output
    included). The torch path peaks in the last chunk of its loop: `q_i * k_i * decay_mask[:, :, i]`, one chunk's
    [c, c, dim] fp32 product before its sum, next to what the loop reads but autograd does not keep (the conv
    activation q/k/v are views of, the gate, the padded and cumsummed gate, the intra-chunk matrix, `value` and
    the output buffer), while the gated norm and o_proj have saved nothing yet. Measured: within a few hundred
    bytes per token of the mixer's own peak (tests/test_linear_attention_layers.py)."""
    if not t.saved:
        kda_mixer_saved(t, f, kernel)
    s, padded, chunks = _shape(t, f)
    p, nh, dk, c, w = t.d.proj, f.heads, f.head_dim, f.chunk, f.width
    pad = padded / s
    if kernel:  # fla's forward: h per chunk [heads, dim, dim], w, u, qg, kg, v_new and the output; modelled
        return chunks * nh * dk * dk * 4 / s + 5 * w * p + f.hidden * p
    m = p if t.d.autocast else 4  # `value` (attn @ v_beta) and the output buffer: the matmul's dtype
    product = nh * c * dk * 4 * pad / chunks
    held = 3 * w * p + w * 4 + (2 * w * 4 + 2 * w * m + nh * c * 4) * pad
    return product + held - _post_saved(t)


def kda_backward_temporaries(t, f: KdaFacts, kernel: bool) -> float:
    """Per token: the most the mixer's backward holds beyond its saved tensors (the output and its gradient
    excluded). The torch path's backward builds [heads, chunks, c, c, dim] fp32 gradients (F, the size of
    decay_mask) in the chunk loop's backward: every `decay_mask[:, :, i]` has a select_backward that allocates a
    whole F, added to the gradient gathered so far (out of place: the sum, the gathered and the new one, 3F, with
    the chunks done so far freed); the first chunk's backward alone holds one F and three of its own [c, c, dim]
    products (the gradient of q_i * k_i and of both its factors) less the product it frees. With one chunk that
    is 3F. Measured on the mixer alone at 1, 2, 5 and 8 chunks and head_dim 16 and 64: within 6% of F."""
    if not t.saved:
        kda_mixer_saved(t, f, kernel)
    s, padded, chunks = _shape(t, f)
    nh, dk, c, w = f.heads, f.head_dim, f.chunk, f.width
    # fla's backward: dq, dk, dv, dg, db, the recomputed w/u/qg/kg/v_new and dh per chunk; modelled
    if kernel:
        return chunks * nh * dk * dk * 4 / s + 10 * w * 4
    full = nh * c * dk * 4 * padded / s
    first_chunk = 2 * full / chunks
    gathering = (2 * full - full / chunks) if chunks > 1 else 0.0
    return full + max(first_chunk, gathering)
