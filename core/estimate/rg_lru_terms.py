"""RecurrentGemma's recurrent block (Griffin / Hawk: a gelu branch, a short convolution and the RG-LRU): what one
block keeps for backward and holds for a moment, per token, from transformers
models/recurrent_gemma/modeling_recurrent_gemma.py (RecurrentGemmaRecurrentBlock, RecurrentGemmaRglru).

One path runs (no kernel package): the RG-LRU's gates are per-head block-diagonal matmuls (baddbmm with frozen
3-D weights, not Linears: LoRA does not reach them) and `_rnn_scan` is a Python loop over the tokens whose every
step keeps the fp32 copy of its gate slice and the fp32 state it multiplies: 8 bytes per lru_width channel and
token, next to about ten lru_width-wide 16-bit tensors. Equal to autograd's tensor by tensor
(tests/test_linear_attention_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RgLruFacts:
    hidden: int
    width: int  # lru_width
    conv_kernel: int  # conv1d_width


def rg_lru_facts(text_config: dict) -> RgLruFacts | None:
    c = text_config
    if c.get("model_type") != "recurrent_gemma":
        return None
    h = int(c["hidden_size"])
    return RgLruFacts(h, int(c.get("lru_width") or h), int(c.get("conv1d_width", 4)))


def rg_lru_mixer_saved(t, f: RgLruFacts, kernel: bool) -> None:
    """Per token, what RecurrentGemmaRecurrentBlock.forward saves (rows of t.plan.seq_len tokens):

    - linear_y's and linear_x's LoRA inputs (the temporal norm's output); gelu keeps linear_y's output;
    - the depthwise conv keeps its input (linear_x's output); `activations * input_gate` keeps the conv output
      (its [..., :seq_len] is a view of the kernel-1 tokens longer result);
    - the RG-LRU: both gates' sigmoid outputs, softplus(recurrent_param) (one [lru_width] per layer), exp(log a)
      and exp(2 log a), SqrtBoundDerivative's input 1 - a^2, the reset masks (~reset twice, bool per token), the
      normalising multiply's two operands;
    - _rnn_scan: per step the fp32 copy of the gate slice (a view of the whole gate in fp32) and the fp32 state
      (the first step's zeros need no gradient: the gate's copy is not kept then); the last state stays referenced
      by the module (`self.recurrent_states`), so nothing of the loop is freed;
    - `x_branch * y_branch` keeps both; linear_out's LoRA input."""
    d, saved, h, w = t.d, t.saved, f.hidden, f.width
    p = d.proj
    s = max(int(t.plan.seq_len), 1)
    for m in ("linear_y", "linear_x"):
        t.linear_input(m, h, d.hidden, "attn_norm_out")
    saved["rg_lru.gelu_input"] = w * p
    saved["rg_lru.conv_input"] = w * p
    saved["rg_lru.conv_out"] = w * p * (s + f.conv_kernel - 1) / s
    saved["rg_lru.gates"] = 2 * w * p  # sigmoid outputs
    saved["rg_lru.softplus_param"] = w * (4 if t.plan.load_dtype == "fp32" else 2) / s
    saved["rg_lru.a_exps"] = 2 * w * p
    saved["rg_lru.sqrt_input"] = w * p
    saved["rg_lru.reset_masks"] = 2
    saved["rg_lru.normalised_operands"] = 2 * w * p
    if t.plan.tuning == "full":  # the gate weights and recurrent_param train: the gates' input and -8 * gate
        saved["rg_lru.trained_operands"] = 2 * w * p
    if p == 4:  # `.type(float32)` is a view: the whole gate once, the zeros and every later state
        saved["rg_lru.scan"] = 2 * w * 4
    else:
        saved["rg_lru.scan"] = (2 * s - 1) * w * 4 / s
    saved["rg_lru.out_and_y"] = 2 * w * p
    t.linear_input("linear_out", w, p, "rg_lru.gated")


def rg_lru_forward_temporaries(t, f: RgLruFacts, kernel: bool) -> float:
    """Per token, beyond the saved tensors: the gates' baddbmm inputs and outputs, the output buffer
    (zeros_like), gated_inputs and the module output, a handful of lru_width-wide tensors (measured on the block
    alone: 768 B per token at width 64, this figure)."""
    p, w = t.d.proj, f.width
    return 5 * w * p + f.hidden * p


def rg_lru_backward_temporaries(t, f: RgLruFacts, kernel: bool) -> float:
    """Per token: the scan's backward reaches `recurrent_gate[:, t]` and `hidden_states[:, t]` through
    select_backward, whole-length gradients added into the gathered ones (measured: 374 B per token at width 64,
    against these 384)."""
    return 3 * f.width * t.d.proj
