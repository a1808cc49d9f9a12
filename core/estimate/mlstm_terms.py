"""xLSTM's mLSTM layer (transformers' `xlstm`, xLSTM-7B): what one layer keeps for backward and holds for a moment,
per token, from transformers models/xlstm/modeling_xlstm.py (the code it runs when the `xlstm` package is not
installed; with the package, transformers builds that package's block, whose Triton kernels this row does not model).

Which code runs: xLSTMBackend calls `wrap_chunkwise_arbitrary_sequence_length` in the configs' default mode
("inference", in training too): `mlstm_chunkwise_native_autograd` over the largest multiple of chunk_size (64)
tokens -- per chunk a (64 x 64) decay matrix and the state recurrence -- then `mlstm_recurrent_sequence_native`, a
Python loop of one-token steps over the rest, each keeping its fp32 [heads, dqk, dv] state twice (the clone the
update multiplies and the copy the output reads). "train" runs the chunkwise kernel alone (the length a multiple of
the chunk), "train_with_padding" on zero-padded chunks: those two are modelled, not measured. The default mode is
equal to autograd's tensor by tensor under bf16 autocast and in fp32 (tests/test_linear_attention_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlstmFacts:
    hidden: int
    heads: int
    qk_dim: int  # hidden * qk_dim_factor, all heads
    v_dim: int  # hidden * v_dim_factor, all heads
    chunk: int
    fused: bool  # weight_mode "fused": qkv_opreact + ifgate_preact instead of q, k, v, ogate_preact, i/fgate_preact
    mode: str  # "inference" (the default, chunks then steps), "train", "train_with_padding"

    @property
    def dqk(self) -> int:
        return self.qk_dim // self.heads

    @property
    def dv(self) -> int:
        return self.v_dim // self.heads


def mlstm_facts(text_config: dict) -> MlstmFacts | None:
    c = text_config
    if c.get("model_type") != "xlstm":
        return None
    h = int(c.get("hidden_size") or c["embedding_dim"])
    return MlstmFacts(
        h,
        int(c.get("num_heads", 8)),
        int(h * float(c.get("qk_dim_factor", 0.5))),
        int(h * float(c.get("v_dim_factor", 1.0))),
        int(c.get("chunk_size", 64)),
        c.get("weight_mode", "single") == "fused",
        str(c.get("mode", "inference")),
    )


def _split(t, f: MlstmFacts) -> tuple[int, int, int, int]:
    """(tokens per row, tokens through the chunkwise kernel, its chunks, one-token steps after it)."""
    s = max(int(t.plan.seq_len), 1)
    if f.mode == "train_with_padding":
        chunks = -(-s // f.chunk)
        return s, chunks * f.chunk, chunks, 0
    if "train" in f.mode:
        return s, s, s // f.chunk, 0
    chunks = s // f.chunk
    return s, chunks * f.chunk, chunks, s - chunks * f.chunk


def mlstm_mixer_saved(t, f: MlstmFacts, kernel: bool) -> None:
    """Per token, what xLSTMLayer.forward saves (rows of t.plan.seq_len tokens): the projections' LoRA inputs,
    soft_cap's tanh outputs, the chunkwise kernel's and the step loop's tensors (_chunkwise_saved, _steps_saved),
    the multi-head LayerNorm (fp32: its input copy, the centred input, rstd), sigmoid(o) * h_norm."""
    d, h, q, saved = t.d, f.hidden, t.d.proj, t.saved
    reads = ("qkv_opreact", "ifgate_preact") if f.fused else ("q", "k", "v", "ogate_preact")
    reads += () if f.fused else ("igate_preact", "fgate_preact")
    for m in reads:
        t.linear_input(f"mlstm.{m}", h, d.hidden, "attn_norm_out", leaf=m)
    saved["mlstm.gate_tanh"] = 2 * f.heads * q
    s, inner, chunks, steps = _split(t, f)
    if chunks:
        _chunkwise_saved(t, f, s, inner, chunks)
    if steps:
        _steps_saved(t, f, s, steps)
    v = f.v_dim
    saved["mlstm_norm.fp32_input"] = v * 4
    saved["mlstm_norm.centred"] = v * 4
    saved["mlstm_norm.rstd"] = f.heads * 4
    if t.plan.tuning == "full":
        saved["mlstm_norm.normed"] = v * q
    saved["mlstm.ogate_sigmoid"] = v * q
    saved["mlstm.h_norm"] = v * q
    t.linear_input("mlstm.out_proj", v, q, "mlstm.gated", leaf="out_proj")


def _chunkwise_saved(t, f: MlstmFacts, s: int, inner: int, chunks: int) -> None:
    """mlstm_chunkwise_native_autograd over `inner` tokens (the `.contiguous()` copies of q, k, v and the gates):
    logsigmoid of the forget gate (input and buffer); mlstm_chunkwise_recurrent_fw_C per chunk (the fp32 running
    state and normaliser the next update multiplies, exp(a) per token, the gated keys for the state matmul: a
    16-bit copy under autocast) with k and v kept whole; mlstm_chunkwise_parallel_fw_H: the causal mask, max's
    indices, the [heads, chunks, 64, 64] decay matrix D = exp(.) and the scores S (their product M for the
    numerator), q whole and gated, the chunk states (in k's dtype, a contiguous copy), the denominator's abs /
    exp / maximum, the division's numerator and denominator. No part of it is discarded: the last state
    feeds the step loop or the states returned."""
    saved, q, nh, c = t.saved, t.d.proj, f.heads, f.chunk
    # the gated keys' matmul operand: autocast's 16-bit copy, else the fp32 product
    m = 2 if t.d.autocast else 4
    dqk, dv, n = f.dqk, f.dv, inner / s  # n: chunkwise tokens per token of the row
    row = 1 / s
    state = nh * dqk * dv
    saved["mlstm_chunk.forget_logsigmoid"] = 2 * nh * q * n
    saved["mlstm_chunk.running"] = chunks * (state * 4 + nh * dqk * 4 + 2 * nh * 4) * row + nh * 4 * n
    saved["mlstm_chunk.a_max"] = nh * chunks * (8 + q) * row  # max's indices, the per-chunk maxima
    saved["mlstm_chunk.k_v"] = nh * (dqk + dv) * q * n + nh * dqk * m * n
    saved["mlstm_chunk.masks"] = c * c * row + nh * 8 * n  # tril, max's indices per token
    saved["mlstm_chunk.m_combine"] = 2 * nh * q * n
    saved["mlstm_chunk.D_S_M"] = 3 * nh * c * q * n  # D, S, M: [heads, chunks, 64, 64] each
    saved["mlstm_chunk.q"] = 2 * nh * dqk * q * n  # q and the gated q
    saved["mlstm_chunk.b_bar"] = nh * q * n
    saved["mlstm_chunk.states"] = chunks * (state + nh * dqk) * q * row
    saved["mlstm_chunk.denominator"] = 4 * nh * q * n  # abs, exp, maximum's abs output, + eps
    saved["mlstm_chunk.numerator"] = nh * dv * q * n


def _steps_saved(t, f: MlstmFacts, s: int, steps: int) -> None:
    """mlstm_recurrent_sequence_native over the last `steps` tokens, mlstm_recurrent_step_native per token: the
    fgate / igate / k / v copies whole; per step logsigmoid's buffer, max's fp32 input, the two exps, the state's
    and normaliser's clones (fp32) and the k v^T outer product the update multiplies, q * scale, the state and
    normaliser in q's dtype for the output matmuls (16-bit copies under autocast), exp(-m), the denominator's abs
    and maximum, the division's fp32 numerator and denominator."""
    saved, q, nh = t.saved, t.d.proj, f.heads
    m = 2 if t.d.autocast else 4
    dqk, dv, row = f.dqk, f.dv, 1 / s
    state = nh * dqk * dv
    saved["mlstm_step.inputs"] = steps * nh * (2 + dqk + dv) * q * row
    per_step = nh * q + 4 * nh * 4  # logsigmoid's buffer; max's input, two exps, exp(-m)
    per_step += state * 4 + nh * dqk * 4 + state * m  # the clones, the outer product
    per_step += nh * dqk * q + state * q + nh * dqk * q  # q * scale, the state and normaliser for the matmuls
    per_step += 2 * nh * q + nh * dv * 4 + nh * 4  # abs, maximum; h_num and h_denom
    saved["mlstm_step.loop"] = steps * per_step * row


def _post_saved(t) -> float:
    """What the layer saves after the kernels return (the multi-head norm, the output gate, out_proj's input)."""
    return sum(
        v
        for k, v in t.saved.items()
        if k.startswith(("mlstm_norm.", "mlstm.ogate", "mlstm.h_norm", "mlstm.out"))
    )


def mlstm_forward_temporaries(t, f: MlstmFacts, kernel: bool) -> float:
    """Per token: beyond the saved tensors, mlstm_chunkwise_parallel_fw_H holds four [heads, chunks, 64, 64]
    locals nothing keeps (the pairwise log-sigmoid differences, their masked, gated and stabilised forms) while
    the projections' outputs (q, k, v, o) and the output are alive, and the norm after it has saved nothing yet
    (measured on the layer alone: within 10% at 256 and 300 tokens)."""
    if not t.saved:
        mlstm_mixer_saved(t, f, kernel)
    s, inner, chunks, steps = _split(t, f)
    q, nh = t.d.proj, f.heads
    decay = 4 * nh * f.chunk * q * inner / s
    return decay + (2 * f.qk_dim + 2 * f.v_dim) * q + f.v_dim * q - _post_saved(t)


def mlstm_backward_temporaries(t, f: MlstmFacts, kernel: bool) -> float:
    """Per token: the chunkwise kernel's backward holds one [heads, chunks, 64, 64] gradient at a time beyond what
    it frees (measured: 520 B per token at 4 heads and 256 tokens, this figure); the step loop's select_backward
    allocates whole-length gradients of q, k and v per step, two of each alive as they are added up."""
    s, inner, chunks, steps = _split(t, f)
    q, nh = t.d.proj, f.heads
    chunk_grads = nh * f.chunk * q * inner / s
    step_grads = 2 * (f.qk_dim * 2 + f.v_dim) * q * steps / s
    return chunk_grads + step_grads
