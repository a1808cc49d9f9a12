"""Activation terms of the Mamba-1 (selective scan) mixer: MambaMixer (mamba), FalconMambaMixer (falcon_mamba),
JambaMambaMixer (jamba) and ZambaMambaMixer (zamba), per token, tensor by tensor, from transformers 5.25's code.

Which path runs (transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback): `mamba_inner_fn`,
`mamba_selective_scan` (selective_scan_fn) and `causal_conv1d_fn` are a Hub kernel with `use_kernels=True`, else
the `mamba_ssm` / `causal_conv1d` package's function when it imports AND its first tensor is on CUDA, else torch.
Only MambaMixer tries the fused `mamba_inner_fn` (when `self.training and cache is None`); its torch stand-in
returns None. FalconMamba, Jamba and Zamba normalize dt (and B, C) where the fused Function cannot, so they call
the scan and the convolution separately. The torch path (every CPU run) is the loop over time of
`mamba_selective_scan`: one (d_inner x d_state) state per step, each saved for backward (measured, below).
`kernel=True` models mamba_ssm's MambaInnerFn / SelectiveScanFn and causal-conv1d's CausalConv1dFn from the
signatures of their forward (what ctx.save_for_backward keeps, mamba_ssm 2.x ops/selective_scan_interface.py);
it is modelled, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

MAMBA1_FAMILIES = ("mamba", "falcon_mamba", "jamba", "zamba")
_SCAN_CHUNK = 2048  # selective_scan_cuda keeps one (state, 2 x d_state) pair per 2048-token chunk


@dataclass(frozen=True)
class Mamba1Facts:
    family: str
    hidden: int
    intermediate: int  # d_inner = expand * hidden: the conv, the scan and the gate widths
    d_state: int
    d_conv: int
    dt_rank: int
    bcdt_norms: bool  # falcon_mamba (weightless), jamba (weighted): RMS norms on dt, B and C before the scan
    x_proj_linear: bool  # an nn.Linear x_proj (LoRA can adapt it); zamba: per-head parameters, a matmul
    fused: bool  # mamba: the kernel path is MambaInnerFn (mamba_inner_fn), not the scan + conv Functions
    heads: int = 1  # zamba: n_mamba_heads scans, each with its own x_proj (dt, B and C per head)

    @property
    def x_proj_width(self) -> int:  # dt, B and C of every head
        return self.heads * (self.dt_rank + 2 * self.d_state)


def mamba1_facts(text_config: dict) -> Mamba1Facts | None:
    """The Mamba-1 mixer's geometry from a config dict (each family names the fields its own way), or None."""
    c, mt = text_config, text_config.get("model_type")
    if mt not in MAMBA1_FAMILIES:  # which layers are Mamba-1 is core.estimate.layer_kinds' (the module tree)
        return None
    hidden = int(c["hidden_size"])
    if mt in ("mamba", "falcon_mamba"):
        # the mixer reads intermediate_size: expand * hidden unless the config was given one (it then keeps that)
        inter = int(c.get("intermediate_size") or c.get("expand", 2) * hidden)
        n, k, r = int(c["state_size"]), int(c["conv_kernel"]), c["time_step_rank"]
        r = -(-hidden // 16) if r == "auto" else int(r)
    else:
        inter = int(c.get("mamba_expand", 2) * hidden)
        n, k, r = int(c["mamba_d_state"]), int(c["mamba_d_conv"]), c["mamba_dt_rank"]
        r = -(-hidden // 16) if r == "auto" else int(r)
    return Mamba1Facts(
        mt,
        hidden,
        inter,
        n,
        k,
        r,
        bcdt_norms=mt in ("falcon_mamba", "jamba"),
        x_proj_linear=mt != "zamba",
        fused=mt == "mamba",
        heads=int(c.get("n_mamba_heads", 1)) if mt == "zamba" else 1,
    )


def _dt_bytes(t) -> int:
    """dt = softplus(dt_proj.weight @ time_step + bias): the stream's dtype, but CUDA autocast runs softplus in
    fp32 (its fp32 op list); the CPU's runs it in bf16 (measured)."""
    return 4 if (t.d.autocast and t.plan.device == "cuda") else t.d.proj


def mamba1_mixer_saved(t, f: Mamba1Facts, kernel: bool) -> None:
    """What the Mamba-1 mixer saves for backward, per token of a seq_len row (conv / A_log / D / dt_proj frozen, as
    with LoRA; full fine-tuning adds their inputs, not modelled here). e: the in_proj output's dtype.

    Torch path (<Family>Mixer.forward -> causal_conv1d_forward -> mamba_scan_forward -> mamba_selective_scan,
    transformers/models/<family>/modeling_<family>.py; checked against saved_tensors_hooks by
    tests/test_mamba1_layers.py):
    - in_proj: `linear_input` of the norm output; `projected_states` (2 d_inner, e): the conv input and the gate
      are views of it (zamba: the conv input is a `.contiguous()` copy of its half), so F.conv1d and silu(gate)
      keep it alive;
    - the conv output padded to seq + d_conv - 1 (`[:, :, :seq_len]` is a view), saved by silu; x_proj's
      `linear_input` of the silu output;
    - the x_proj output (dt_rank + 2 d_state, e; zamba: per head): each step's bmm keeps its C view (dt's matmul
      with the frozen dt_proj.weight saves no input). FalconMamba / Jamba normalize dt, B and C first (an RMSNorm
      each: the fp32 copy and rstd), so the normed C is kept instead (B only as its fp32 copy, below) and the
      projection is freed unless it is already fp32 (`.float()` is then the tensor itself);
    - softplus's input (dt + dt_proj.bias) and output dt (d_inner each); A = -exp(A_log) (d_inner x d_state fp32,
      per row) and D.float() (per row, when the weights are 16-bit);
    - discrete_A = exp(A * dt) and discrete_B = dt * B.float() (d_inner x d_state fp32 each, per token), B.float()
      (d_state fp32) and u = hidden_states.float() (d_inner fp32);
    - the loop over time: step i saves `discrete_A[:, :, i] * ssm_state` 's previous state (the first a zero
      state of the input dtype, then fp32 states) and the bmm `ssm_state.to(input_dtype) @ C[:, i]` its copy of
      the state (the state itself when the input is fp32, the last one included): d_inner x d_state per token;
    - `scan_output * silu(gate)`: the fp32 scan output (`+ hidden_states * D` promotes it) and silu's output;
    - out_proj: `linear_input` of `scan_output.to(dtype)` (LoRA on it in jamba and zamba; peft refuses it on mamba
      and falcon_mamba).
    Kernel path (modelled from mamba_ssm's source, not measured): MambaInnerFn (mamba) saves xz (the projection made
    contiguous: a copy of the transposed in_proj output), x_dbl (the x_proj output), B and C made contiguous,
    scan_intermediates (d_inner x 2 d_state fp32 per 2048-token chunk) and the pre-gate scan output `out`; with
    checkpoint_lvl 1 (its default) conv1d_out and delta are recomputed in backward. x_proj, dt_proj and out_proj
    run inside the Function on their `.weight`: LoRA on them is bypassed (their adapters get no gradient).
    CausalConv1dFn (the other families) saves its input (a view of the projection) and returns the unpadded,
    activated output; SelectiveScanFn saves u (that output), delta, B and C (contiguous copies of strided views),
    z (the gate made contiguous), scan_intermediates and `out`, and returns out * silu(z).
    """
    d, sv, s = t.d, t.saved, t.plan.seq_len
    e, inter, n = d.proj, f.intermediate, f.d_state
    per = 1 / s
    t.linear_input("in_proj", f.hidden, d.hidden, "attn_norm_out")
    if kernel:
        sv["mamba1.projected_states"] = 2 * inter * e
        sv["mamba1.B_C_contiguous"] = 2 * n * e * f.heads
        sv["mamba1.scan_intermediates"] = inter * 2 * n * 4 * -(-s // _SCAN_CHUNK) * per
        sv["mamba1.scan_out"] = inter * e
        if f.fused:  # x_proj, dt_proj and out_proj inside the Function: no LoRA input of theirs is saved
            sv["mamba1.x_dbl"] = f.x_proj_width * e
            return
        sv["mamba1.conv_out"] = inter * e  # u
        sv["mamba1.delta"] = inter * e
        sv["mamba1.gate_contiguous"] = inter * e
        _x_proj_and_norms(t, f, kernel)
        t.linear_input("out_proj", inter, d.hidden, "mamba1.out_proj_input")
        return
    sv["mamba1.projected_states"] = 2 * inter * e
    if f.family == "zamba":
        sv["mamba1.conv_in_contiguous"] = inter * e
    sv["mamba1.conv_out_padded"] = inter * e * (s + f.d_conv - 1) * per
    _x_proj_and_norms(t, f, kernel)
    dt = _dt_bytes(t)
    sv["mamba1.softplus_in"] = inter * dt
    sv["mamba1.dt"] = inter * dt
    sv["mamba1.A"] = inter * n * 4 * per
    if t.plan.load_dtype != "fp32":
        sv["mamba1.D_fp32"] = inter * 4 * per
    sv["mamba1.discrete_A"] = inter * n * 4
    sv["mamba1.discrete_B"] = inter * n * 4
    # u = hidden_states.float(): at fp32 the silu output itself, which a LoRA x_proj may save already
    sv["mamba1.conv_out" if e == 4 else "mamba1.u_fp32"] = inter * 4
    # the scan loop: s states saved by the step's mul (a zero state first), s copies saved by its bmm
    if e == 4:
        sv["mamba1.states"] = inter * n * 4 * (s + 1) * per
    else:
        sv["mamba1.states"] = inter * n * (e + 4 * (s - 1) + e * s) * per
    sv["mamba1.scan_out"] = 4 * inter
    sv["mamba1.silu_gate"] = inter * e
    t.linear_input("out_proj", inter, d.hidden, "mamba1.out_proj_input")


def _x_proj_and_norms(t, f: Mamba1Facts, kernel: bool) -> None:
    """x_proj's LoRA input, its output (or the dt / B / C norms that replace it), and B.float() (torch path)."""
    d, sv = t.d, t.saved
    e, n, r = d.proj, f.d_state, f.dt_rank
    if f.x_proj_linear:
        t.linear_input("x_proj", f.intermediate, e, "mamba1.conv_out")
    if not f.bcdt_norms:
        if not kernel:  # each step's bmm keeps its C view (the scan Function takes contiguous copies instead)
            sv["mamba1.x_proj_out"] = f.x_proj_width * e
        if not kernel and e != 4:
            sv["mamba1.B_fp32"] = 4 * n * f.heads
        return
    # <Family>RMSNorm on dt, B and C: the fp32 copy (`.float()` / `.to(float32)`; at fp32 the projection itself) and
    # rstd, each. dt's matmul with the frozen dt_proj.weight saves no input: the normed dt is not kept
    sv["mamba1.bcdt_norm_fp32"] = 4 * f.x_proj_width
    sv["mamba1.bcdt_norm_rstd"] = 3 * 4
    # a quantized model calls the dt_proj module (`config._is_quantized`): its LoRA runs
    if t.plan.tuning == "qlora":
        t.linear_input("dt_proj", r, e, "mamba1.dt_normed")
    if not kernel:
        sv["mamba1.C_normed"] = n * e  # each step's bmm
        sv["mamba1.B_fp32"] = 4 * n  # B.float(): a copy, or at fp32 the normed B itself


def mamba1_forward_temporaries(t, f: Mamba1Facts, kernel: bool) -> float:
    """Per token: what the mixer holds beyond its saved tensors at its forward peak: on the torch path
    deltaB_u = discrete_B * u (d_inner x d_state fp32), which the loop reads step by step and nothing saves,
    alive until mamba_selective_scan returns. The kernel path: not modelled (0)."""
    return 0.0 if kernel else f.intermediate * f.d_state * 4


def mamba1_backward_temporaries(t, f: Mamba1Facts, kernel: bool) -> float:
    """Per token: the torch path's largest backward moment is early in the loop's: each step's `discrete_A[:, :, i]`
    and `deltaB_u[:, :, i]` slices send back a gradient as large as the whole tensor (select_backward fills a zero
    tensor of the input's shape), summed into one gradient for discrete_A and one for deltaB_u, out of place (the
    old sum, the step's zero-filled gradient and the new sum alive at once): four (d_inner x d_state) fp32 tensors
    per token, measured by the live-tensor tracker on a real mixer's backward. The kernel path (one fused backward,
    gradients of the mixer's inputs only): not modelled (0)."""
    return 0.0 if kernel else 4 * f.intermediate * f.d_state * 4
