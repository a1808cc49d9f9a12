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

MAMBA_FAMILIES = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2")
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
    elif mt == "zamba2":  # Zamba2MambaMixer runs Mamba2Mixer's forward (its own gated norm, the same code)
        heads, hd, n, g = c["n_mamba_heads"], c["mamba_headdim"], c["mamba_d_state"], c["mamba_ngroups"]
        chunk, k, expand = c["chunk_size"], c["mamba_d_conv"], c.get("mamba_expand", 2)
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
    elif mt in ("mamba2", "bamba", "granitemoehybrid", "zamba2"):
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


# What the mixer saves after the scan's last einsum (the gated norm, out_proj's LoRA input), and what its backward
# has freed by the moments below: the scan's later einsums' operands, then the intra-chunk products' own.
_AFTER_SCAN = ("mamba.scan_out", "mamba.gate_fp32", "mamba.silu_gate", "mamba.gated", "mamba.norm_rstd")
_OUT_PROJ = ("out_proj.", "mamba_out_proj_input")
_STATES_FREED = (
    "mamba.Y_off_in",
    "mamba.state_decay_out",
    "mamba.C_states_operands",
    "mamba.new_states_operands",
    "mamba.decay_chunk",
    "mamba.chunk_masks",
    "mamba.states_operands",
)
_INTRA_FREED = ("mamba.B_chunked", "mamba.decay_states", "mamba.Ydiag_operands")


def _sum(t, keys, out_proj: bool = True) -> float:
    return sum(v for k, v in t.saved.items() if k in keys or (out_proj and k.startswith(_OUT_PROJ)))


def _scan_widths(t, f: MambaFacts) -> dict[str, float]:
    """Per real token, the torch scan's tensors by kind: `ll` one (b, c, l, l, h) fp32 tensor (segment_sum's, M,
    their gradients), `hn` one (b, c, l, h, n) fp32 tensor (B and C repeated to the heads, padded; B_decay; their
    gradients), `x` one fp32 (b, c, l, h, p) tensor; padded rows count S / s tokens (S a chunk multiple)."""
    s, c, S = _mamba_dims(t, f)
    rho = S / s
    h = f.heads
    return {
        "ll": 4 * h * f.chunk_size * rho,
        "hn": 4 * h * f.d_state * rho,
        "x": 4 * f.intermediate * rho,
        "state": h * f.head_dim * f.d_state / s,  # one (b, h, p, n) state per row, in elements
        "rho": rho,
        "c": c,
    }


def mamba_forward_temporaries(t, f: MambaFacts, kernel: bool) -> float:
    """Per token: the most the mixer's forward holds beyond its saved tensors (its input excluded).

    Torch path (measured, tensor by tensor, on a mixer at Granite 4.0-H's real widths and at reduced ones, bf16
    autocast): mamba2_chunk_scan keeps every local until it returns, so late in the scan the forward holds, not
    saved: M = G * L (one (b, c, l, l, h) fp32 tensor), C's padded fp32 copy and B_decay ((b, c, l, h, n) fp32
    each; B's copy is saved by B_decay's multiply), the padded fp32 x * dt and D_residual, Y_diag (matmul dtype),
    the chunk states (c + 1 of them) and the zero initial state, the conv activation (16-bit runs: x.float()
    copies it) and the small dt / A tensors. Two moments bound it:
    - the last einsum (C_times_states, `bclhn,bchpn->bclhp`): under autocast einsum makes C contiguous in fp32
      before bmm casts it (one more (b, c, l, h, n) fp32 tensor), plus its output (saved later, as Y_off_in);
    - the scan's end: Y_off (fp32), Y_diag + Y_off and its contiguous copy, x-wide fp32 tensors.
    At either, the gated norm and out_proj have saved nothing yet. segment_sum's three (b, h, c, l, l) copies
    come earlier, when far less is saved: never the larger moment.

    Kernel path (mamba_ssm's MambaSplitConv1dScanCombinedFn; modelled from its design, not measured): the conv
    output xBC, dt and dA_cumsum (fp32, per head and padded token), the chunk states in fp32 and their passed
    copy, CB = C^T B per chunk (fp32, (b, c, g, l, l)), the scan output and the gated norm's output."""
    if not t.saved:
        mamba_mixer_saved(t, f, kernel)
    w, e, m = _scan_widths(t, f), t.d.proj, _matmul_bytes(t)
    h, inter, rho, c = f.heads, f.intermediate, w["rho"], w["c"]
    if kernel:
        states = c * w["state"] * (4 + e)
        held = f.conv_dim * e + 2 * 4 * h * rho + states + 4 * f.n_groups * f.chunk_size * rho + 2 * inter * e
        return max(held - t.beside, 0.0)
    held = w["ll"] + 2 * w["hn"] + 2 * w["x"]  # M; C's padded copy, B_decay; x * dt, D_residual
    held += inter * m * rho  # Y_diag
    held += (c + 2) * w["state"] * m  # the chunk states (c + 1) and the zero initial state
    held += f.conv_dim * e if e != 4 else 0  # the conv activation (fp32: x.float() is it, saved already)
    held += 2 * 4 * h * rho + h * e  # A and its cumsum, chunked; dt
    after = _sum(t, _AFTER_SCAN)
    last_einsum = (
        held + (w["hn"] if m != 4 else 0) + inter * m * rho - after - t.saved.get("mamba.Y_off_in", 0)
    )
    end = held + 3 * w["x"] - after
    return max(max(last_einsum, end) - t.beside, 0.0)


def mamba_backward_temporaries(t, f: MambaFacts, kernel: bool) -> float:
    """Per token: the most the mixer's backward holds beyond its saved tensors (the output and its gradient
    excluded).

    Torch path (measured as above; the moment of a checkpointed layer's recomputed backward that a Granite 4.0-H
    twin at real widths measured 18.5% above a plan without it): autograd keeps each gradient of a tensor used
    twice until both uses are done, so C's gradient from C_times_states waits for G's einsum, and x's for Y_diag's.
    Two moments bound it, the gated norm's and the later einsums' saved tensors freed by then:
    - B_decay's multiply (states' einsum backward): C's gradient, B_decay's (cast back to fp32), B's and
      B_decay * grad (summed into decay_states' gradient): four (b, c, l, h, n) fp32 tensors, with x's gradient,
      the scan output's (padded, fp32), the gate's (waiting for the projection's split) and Y_diag's 16-bit one;
    - M = G * L's multiply: M's gradient (fp32), G's and L's: three (b, c, l, l, h) fp32 tensors, next to C's
      and B's gradients, x's, the scan output's and the gate's; B's padded copy, decay_states and Y_diag's
      operands are freed by then.

    Kernel path (mamba_chunk_scan_combined's backward inside MambaSplitConv1dScanCombinedFn; modelled from its
    design, not measured): it recomputes the conv output, dt and dA_cumsum, CB and the chunk states, and holds
    dstates (fp32 per chunk), dx, ddt, dA, dB and dC (fp32 per group), dCB, the norm's recomputed output and
    gradient, and the whole projection's gradient (dzxbcdt) that it returns."""
    if not t.saved:
        mamba_mixer_saved(t, f, kernel)
    w, e, m = _scan_widths(t, f), t.d.proj, _matmul_bytes(t)
    h, inter, rho, c = f.heads, f.intermediate, w["rho"], w["c"]
    if kernel:
        g, L, n = f.n_groups, f.chunk_size, f.d_state
        held = f.proj_width * e + 2 * f.conv_dim * e + 2 * inter * e  # dzxbcdt, xBC and dxBC, out and dout
        held += 4 * 4 * h * rho + 2 * c * w["state"] * 4  # dt, dA_cumsum, ddt, ddA; states and dstates
        held += 2 * 4 * g * L * rho + 2 * 4 * g * n * rho + inter * e  # CB and dCB; dB, dC; dx
        return max(held - t.beside, 0.0)
    flowing = w["x"] + w["x"] + inter * e + 2 * 4 * h * rho  # x's gradient, the scan output's, the gate's
    freed = _sum(t, _AFTER_SCAN + _STATES_FREED)
    states = flowing + 4 * w["hn"] + (inter * m * rho if m != 4 else 0) - freed
    intra = flowing + 3 * w["ll"] + 2 * w["hn"] - freed - _sum(t, _INTRA_FREED, out_proj=False)
    return max(max(states, intra) - t.beside, 0.0)


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
