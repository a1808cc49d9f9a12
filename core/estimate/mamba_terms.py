"""Activation terms of hybrid layers: the Mamba-2 mixer (mamba2, bamba, granitemoehybrid, nemotron_h, falcon_h1)
and LFM2's short convolution (lfm2, lfm2_moe), per token, tensor by tensor, from transformers 5.25's code.

Which path runs (transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback): each decorated
function (mamba2_split_conv1d_scan_combined, mamba2_chunk_scan, causal_conv1d_fn) takes, in this order, a Hub
kernel when the model was loaded with `use_kernels=True`, else the `mamba_ssm` / `causal_conv1d` package's function
when the package imports AND the first tensor argument is on CUDA (_PACKAGE_SUPPORTED_DEVICES), else the torch
function. The mixer tries `mamba2_split_conv1d_scan_combined` first when `self.training and cache is None` (the
run engine sets use_cache=False); its torch stand-in returns None, so without mamba_ssm on CUDA the torch path
(causal_conv1d_forward -> mamba2_scan_forward -> mamba2_chunk_scan -> gated norm) runs. `kernel=True` below means
mamba_ssm (+ causal_conv1d) on CUDA: modelled from their source, not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.estimate.plan import DTYPE_BYTES

MAMBA_FAMILIES = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1")
SHORT_CONV_FAMILIES = ("lfm2", "lfm2_moe")


@dataclass(frozen=True)
class MambaFacts:
    family: str
    hidden: int
    heads: int
    head_dim: int
    d_state: int
    n_groups: int
    chunk_size: int
    conv_kernel: int
    intermediate: int  # heads * head_dim: the gate, x and the scan output widths
    norm: str  # "gated" (norm(y * silu(z))), "gated_after" (falcon norm_before_gate), "none" (y * silu(z))
    in_multiplier: bool  # falcon_h1: in_proj reads `hidden_states * ssm_in_multiplier`, a tensor of its own
    mup_vector: bool  # falcon_h1: `projected_states * mup_vector`, a second projection-wide tensor

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state

    @property
    def proj_width(self) -> int:
        return self.intermediate + self.conv_dim + self.heads


@dataclass(frozen=True)
class ShortConvFacts:
    family: str
    hidden: int
    conv_kernel: int  # conv_L_cache


def _get(c: dict, *names, default=None):
    for n in names:
        if c.get(n) is not None:
            return c[n]
    return default


def mamba_facts(text_config: dict) -> MambaFacts | None:
    """The Mamba-2 mixer's geometry from a config dict (each family names the fields its own way), or None."""
    c, mt = text_config, text_config.get("model_type")
    if mt not in MAMBA_FAMILIES:  # which layers are Mamba-2 is core.estimate.layer_kinds' (the module tree)
        return None
    hidden = c["hidden_size"]
    if mt == "mamba2":
        heads, hd, n, g = c["num_heads"], c["head_dim"], c["state_size"], c["n_groups"]
        chunk, k, expand = c["chunk_size"], c["conv_kernel"], c.get("expand", 2)
    elif mt == "nemotron_h":
        heads, hd, n, g = c["mamba_num_heads"], c["mamba_head_dim"], c["ssm_state_size"], c["n_groups"]
        chunk, k, expand = c["chunk_size"], c["conv_kernel"], None
    else:
        heads, hd, n, g = c["mamba_n_heads"], c["mamba_d_head"], c["mamba_d_state"], c["mamba_n_groups"]
        chunk, k, expand = c["mamba_chunk_size"], c["mamba_d_conv"], c.get("mamba_expand", 2)
    inter = heads * hd  # every family's in_proj / norm widths; mamba2 and bamba also check expand * hidden
    norm = "gated"
    if mt == "falcon_h1":
        inter = _get(c, "mamba_d_ssm", default=int((expand or 2) * hidden))
        if not c.get("mamba_rms_norm", False):
            norm = "none"
        elif c.get("mamba_norm_before_gate", True):
            norm = "gated_after"
    elif mt in ("mamba2", "bamba", "granitemoehybrid"):
        inter = int(expand * hidden)
    return MambaFacts(
        mt,
        hidden,
        heads,
        hd,
        n,
        g,
        chunk,
        k,
        inter,
        norm,
        in_multiplier=mt == "falcon_h1",
        mup_vector=mt == "falcon_h1",
    )


def short_conv_facts(text_config: dict) -> ShortConvFacts | None:
    """LFM2's ShortConv geometry (conv_L_cache taps over the hidden width), or None without conv layers."""
    c = text_config
    if c.get("model_type") not in SHORT_CONV_FAMILIES:
        return None
    return ShortConvFacts(c["model_type"], c["hidden_size"], c.get("conv_L_cache", 3))


# ----------------------------------------------------------------------------------------------------------
# Mamba-2


def _mamba_dims(t, f: MambaFacts):
    s = t.plan.seq_len
    c = math.ceil(s / f.chunk_size)
    return s, c, c * f.chunk_size


def _matmul_bytes(t) -> int:
    """The einsums' bmm operands: autocast hands bmm 16-bit copies of the fp32 SSD tensors; else fp32."""
    return DTYPE_BYTES[t.plan.compute_dtype] if t.d.autocast else 4


def mamba_mixer_saved(t, f: MambaFacts, kernel: bool) -> None:
    """What the Mamba-2 mixer saves for backward, per token of a seq_len row (a frozen conv / A / D / dt_bias /
    norm weight, as with LoRA; full fine-tuning adds their inputs, not modelled here).

    Torch path (measured; transformers/models/<family>/modeling_<family>.py, <Mixer>.forward):
    - in_proj: `linear_input` of the norm output (falcon_h1: of `hidden_states * ssm_in_multiplier`);
    - `projected_states` (falcon_h1: its `* mup_vector` copy): the conv input is a transposed view of it, so
      F.conv1d (causal_conv1d_fn) keeps the whole projection alive (gate, xBC and dt share its storage);
    - the conv output, padded to seq + kernel - 1 (`[:, :, :seq_len]` is a view), saved by silu;
    - dt: softplus saves dt + dt_bias, clamp its output, `hidden * dt.float()` the fp32 dt;
    - mamba2_chunk_scan: `hidden_states.float()` (fp32 input: the silu output itself, whole conv width);
      segment_sum's two (chunk x chunk) bool masks and L = exp(segsum) (b, h, c, l, l) fp32;
      each einsum's bmm operands (16-bit autocast copies, or fp32 contiguous clones): G's C and B (heads x n,
      padded), Y_diag's M and x, states' B_decay and x, new_states' decay_chunk and states (c + 1 chunks),
      C_times_states' C and states; G (b, c, l, l, h) itself (M = G * L); the padded chunked B (B_decay);
      decay_states and state_decay_out (h per padded token, fp32); C_times_states (Y_off);
    - the gated norm (<Family>RMSNormGated.forward): the fp32 gate copy (when the stream is 16-bit), silu's
      output, the scan output (`torch.cat` of the one chunked output: a tensor of seq_len rows), their
      product (pow's input) and rstd per norm group;
    - out_proj: `linear_input` of `scan_output.to(dtype)` (a copy when the stream is 16-bit).
    Kernel path (modelled from mamba_ssm/ops/triton/ssd_combined.py MambaSplitConv1dScanCombinedFn.forward, not
    measured): ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, initial_states,
    seq_idx, rmsnorm_weight, rstd, outproj_weight, outproj_bias): the projection, the pre-norm scan output out_x
    (input dtype) and rstd (fp32, per group); the out_proj input is recomputed in backward; out_proj runs inside
    the Function on `self.out_proj.weight`, so a LoRA on out_proj is bypassed (its adapter gets no gradient).
    """
    d, sv = t.d, t.saved
    s, c, S = _mamba_dims(t, f)
    L, h, n, p, inter = f.chunk_size, f.heads, f.d_state, f.head_dim, f.intermediate
    e = d.proj  # projected_states: the autocast dtype, else the load dtype
    in_key = "attn_norm_out"
    if f.in_multiplier:
        in_key = "mamba_in_scaled"
    t.linear_input("in_proj", f.hidden, d.hidden, in_key)
    if kernel:
        sv["mamba.zxbcdt"] = f.proj_width * e
        sv["mamba.out_x"] = inter * e
        sv["mamba.rstd"] = 4 * f.n_groups if f.norm != "none" else 0
        t.linear_input("out_proj", inter, d.hidden, "mamba_out_proj_input")
        t.saved.pop("mamba_out_proj_input", None)  # recomputed inside the Function's backward
        return
    m = _matmul_bytes(t)
    per = 1 / s
    sv["mamba.projected_states"] = f.proj_width * e
    sv["mamba.conv_out_padded"] = f.conv_dim * e * (s + f.conv_kernel - 1) * per
    sv["mamba.dt_softplus_in"] = h * e
    sv["mamba.dt_clamp_in"] = h * e
    sv["mamba.dt_fp32"] = 4 * h if e != 4 else 0
    # .float() is the tensor itself at fp32: `hidden * dt` keeps the clamp output and the whole silu output
    if e == 4:
        sv["mamba.dt_clamp_out"] = 4 * h
        sv["mamba.x_fp32"] = f.conv_dim * 4
    else:
        sv["mamba.x_fp32"] = inter * 4
    sv["mamba.segsum_masks"] = 2 * L * L * per
    sv["mamba.L_exp"] = 4 * h * c * L * L * per
    sv["mamba.G_operands"] = 2 * h * S * n * m * per
    sv["mamba.G"] = h * c * L * L * m * per
    # fp32 with one chunk: einsum's reshape of M (and below of the states) is a view, not a contiguous clone
    one = m == 4 and c == 1
    sv["mamba.Ydiag_operands"] = ((0 if one else h * c * L * L * m) + inter * S * m) * per
    sv["mamba.decay_states"] = 4 * h * S * per
    sv["mamba.B_chunked"] = 4 * h * S * n * per
    sv["mamba.states_operands"] = (h * S * n * m + inter * S * m) * per
    z = c + 1
    sv["mamba.chunk_masks"] = 2 * z * z * per
    sv["mamba.decay_chunk"] = 4 * h * z * z * per
    sv["mamba.new_states_operands"] = (h * z * p * n * m + (h * z * z * m if m != 4 else 0)) * per
    sv["mamba.state_decay_out"] = 4 * h * S * per
    sv["mamba.C_states_operands"] = (h * S * n * m + (0 if one else h * c * p * n * m)) * per
    sv["mamba.Y_off_in"] = inter * S * m * per
    sv["mamba.scan_out"] = 4 * inter
    if f.norm == "none":  # falcon_h1 without the gated norm: y * silu(z); silu saves z (the projection)
        sv["mamba.silu_gate"] = inter * e
    else:
        if e != 4:
            sv["mamba.gate_fp32"] = 4 * inter
        sv["mamba.silu_gate"] = 4 * inter
        sv["mamba.gated"] = 4 * inter
        sv["mamba.norm_rstd"] = 4 * f.n_groups
        # "gated_after" (falcon: norm(y) first, pow keeps y = scan_out) keeps weight * normed (fp32) instead
    t.linear_input("out_proj", inter, d.hidden, "mamba_out_proj_input")


def mamba_forward_temporaries(t, f: MambaFacts, kernel: bool) -> float:
    """Per token: what the mixer holds beyond its saved tensors at the step's peak moments. Inside the mixer its
    forward builds segment_sum's expanded, masked and cumsummed (b, h, c, l, l) copies and its backward the
    gradients of L / M / G, but measured whole steps (tiny twins of every Mamba-2 family, checkpointing on and off:
    tests/test_layer_plan.py) peak where these are gone again: counted as 0 until the real-width twins
    (benchmarks/families_accuracy.py) show where they add."""
    return 0.0


def mamba_backward_temporaries(t, f: MambaFacts, kernel: bool) -> float:
    """Per token: see mamba_forward_temporaries."""
    return 0.0


# ----------------------------------------------------------------------------------------------------------
# LFM2 short convolution


def short_conv_mixer_saved(t, f: ShortConvFacts, kernel: bool) -> None:
    """What Lfm2ShortConv.forward (transformers/models/lfm2/modeling_lfm2.py) saves, per token:
    in_proj's `linear_input`; `B * x` keeps B and x, views of the in_proj output (BCx, 3 x hidden, its whole
    storage); F.conv1d (causal_conv1d_fn) keeps its input B * x; `C * conv_out` keeps C (BCx again) and the conv
    output, padded to seq + L_cache - 1 (`[..., :seq_len]` is a view); out_proj's `linear_input` of the
    `.contiguous()` copy. Kernel path (causal_conv1d's CausalConv1dFn, modelled, not measured): it saves x, the
    weight and bias and returns an unpadded output, so the conv output is seq_len rows."""
    d, sv, h = t.d, t.saved, f.hidden
    e = d.proj
    s = t.plan.seq_len
    t.linear_input("in_proj", h, d.hidden, "attn_norm_out")
    sv["conv.BCx"] = 3 * h * e
    sv["conv.Bx"] = h * e
    sv["conv.out"] = h * e * ((s if kernel else s + f.conv_kernel - 1) / s)
    t.linear_input("out_proj", h, e, "conv.y_contiguous")


def short_conv_forward_temporaries(t, f: ShortConvFacts, kernel: bool) -> float:
    """Per token: beyond the saved tensors, `C * conv_out` (y) before its contiguous copy, and out_proj's output."""
    return 2 * f.hidden * t.d.proj


def short_conv_backward_temporaries(t, f: ShortConvFacts, kernel: bool) -> float:
    """Per token: the incoming gradient, grad of y, grad of C and of conv_out, grad of B*x, and the grad of BCx
    (3 x hidden) assembled from B, C and x."""
    return (1 + 1 + 1 + 1 + 1 + 3) * f.hidden * t.d.proj
