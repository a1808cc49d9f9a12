"""RWKV (v4, transformers' `rwkv`): what one block's time mix and channel mix keep for backward and hold for a moment,
per token, from transformers models/rwkv/modeling_rwkv.py.

An RWKV block is LayerNorm -> time mix (RwkvSelfAttention: a token shift, key / value / receptance projections
and the WKV recurrence) -> LayerNorm -> channel mix (RwkvFeedForward: a token shift, relu(key)^2, value,
a sigmoid receptance gate). core.estimate.layer_kinds reads both as the block's mixers ("rwkv",
"rwkv_channel_mix": the channel mix shifts in the previous token too) and no feed-forward, so each row brings its
own LayerNorm in place of the RMSNorm the planner puts before a layer's mixers.

Which code runs: at model construction transformers compiles its WKV CUDA kernel when ninja and CUDA are there
(RwkvSelfAttention.__init__ -> load_wkv_cuda_kernel); rwkv_linear_attention takes it for CUDA tensors of more than
one token, else `rwkv_linear_attention_cpu`, a Python loop over the tokens whose every step keeps its [batch,
attention_hidden] fp32 operands: about 12 x 4 bytes per channel and token, for a 4-layer-deep recurrence that the
kernel keeps as its key, value and output. `kernel=True` models RwkvLinearAttention's save_for_backward (time
decay and first, key, value, output); modelled, not measured. The torch path is equal to autograd's tensor by
tensor (tests/test_linear_attention_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RwkvFacts:
    hidden: int
    attention: int  # attention_hidden_size: the time mix's key / value / receptance width
    intermediate: int  # the channel mix's key width


def rwkv_facts(text_config: dict) -> RwkvFacts | None:
    """RWKV's widths from its config (attention_hidden_size and intermediate_size default to hidden, 4 x hidden)."""
    c = text_config
    if c.get("model_type") != "rwkv":
        return None
    h = int(c["hidden_size"])
    return RwkvFacts(h, int(c.get("attention_hidden_size") or h), int(c.get("intermediate_size") or 4 * h))


def layer_norm(t, name: str, width: int) -> None:
    """An nn.LayerNorm over `width` features in place of the planner's RMSNorm entries under `name`: it saves its
    input, mean and rstd. CUDA's autocast runs layer_norm in fp32 (an fp32 copy of the input, fp32 statistics);
    CPU's autocast leaves it in the input's dtype, statistics included."""
    for key in [k for k in t.saved if k.startswith(name + ".")]:
        del t.saved[key]
    if t.d.autocast and t.plan.device == "cuda":
        t.saved[f"{name}.fp32_input"] = width * 4
        t.saved[f"{name}.mean_rstd"] = 2 * 4
    else:
        t.saved[f"{name}.input"] = width * t.d.hidden
        t.saved[f"{name}.mean_rstd"] = 2 * t.d.hidden


def _shift_mixes(t, prefix: str, names: tuple[str, ...]) -> None:
    """`hidden * time_mix + shifted * (1 - time_mix)` per projection: the frozen time_mix is a parameter, but
    `1 - time_mix` is a [hidden] tensor of its own that the shifted multiply keeps (one per layer); when the
    mixes train (full fine-tuning) the multiplies keep `hidden` and `shifted` too."""
    s, h = max(int(t.plan.seq_len), 1), t.spec.hidden_size
    param = 4 if t.plan.load_dtype == "fp32" else 2
    t.saved[f"{prefix}.one_minus_mix"] = len(names) * h * param / s
    if t.plan.tuning == "full":
        t.saved[f"{prefix}.normed_and_shifted"] = 2 * h * t.d.hidden
    for n in names:  # each projection reads its own mix
        t.linear_input(f"{prefix}.{n}", h, t.d.hidden, f"{prefix}.{n}_mix", leaf=n)


def rwkv_mixer_saved(t, f: RwkvFacts, kernel: bool) -> None:
    """Per token, what RwkvBlock's ln1 and time mix save (RwkvSelfAttention.extract_key_value / forward,
    rwkv_linear_attention_cpu).

    The loop's step t (fp32 [batch, attention_hidden] each): `maximum(max_state, key_t + time_first)` keeps both;
    the two exps their outputs; `e1 * num_state` and `e1 * den_state` the states; the division numerator and
    denominator; the state update `maximum(max_state + time_decay, key_t)` both (key_t is `key[:, t].float()`, a
    copy per step of a 16-bit key, a view of the whole key in fp32) and its two exps. The last step's update feeds a
    state nobody returns (use_cache is off in training): what only it kept is freed."""
    layer_norm(t, "input_layernorm", f.hidden)
    _shift_mixes(t, "time_mix", ("key", "value", "receptance"))
    s, a, p, saved = max(int(t.plan.seq_len), 1), f.attention, t.d.proj, t.saved
    saved["rwkv.receptance_sigmoid"] = a * p
    saved["rwkv.value"] = a * p  # the value projection's output: every step's `e2 * value[:, t]` keeps it
    saved["rwkv.out"] = a * p  # `receptance * rwkv` keeps the recurrence's output (and the sigmoid)
    if kernel:
        # RwkvLinearAttention keeps key, value, output (fp16: fp32 copies of the three) and the [A] decays
        copy = 4 if t.plan.compute_dtype == "fp16" else p
        saved["rwkv_cuda.key_value_out"] = a * copy + (2 * a * 4 if copy != p else 0)
        saved["rwkv_cuda.decays"] = 2 * a * 4 / s
    else:
        per_step = 8  # maximum's two, two exps, the two states, numerator and denominator
        per_update = 4 if p != 4 else 3  # maximum's two (a key copy of its own when 16-bit), two exps
        saved["rwkv.loop"] = (per_step * s + per_update * (s - 1)) * a * 4 / s
        if p == 4:
            saved["rwkv.key_fp32"] = a * 4
    t.linear_input("time_mix.output", a, p, "rwkv.gated", leaf="output")


def channel_mix_saved(t, f: RwkvFacts, kernel: bool) -> None:
    """Per token, what RwkvBlock's ln2 and channel mix save (RwkvFeedForward.forward): `relu(key(x)) ** 2` keeps
    the relu output (relu and the square alike), sigmoid its output, `receptance * value` the value projection."""
    layer_norm(t, "post_attention_layernorm", f.hidden)
    _shift_mixes(t, "channel_mix", ("key", "receptance"))
    p, saved = t.d.proj, t.saved
    saved["channel_mix.relu"] = f.intermediate * p
    saved["channel_mix.receptance_sigmoid"] = f.hidden * p
    saved["channel_mix.value_out"] = f.hidden * p
    t.linear_input("channel_mix.value", f.intermediate, p, "channel_mix.squared", leaf="value")


def rwkv_forward_temporaries(t, f: RwkvFacts, kernel: bool) -> float:
    """Per token, beyond the saved tensors: extract_key_value holds the shifted input and the three mixes (its
    locals) while the key projection runs peft's fp32 copy of its input and its output (measured on the mixer
    alone: 896 B per token at hidden 64, this figure)."""
    h, a, p = f.hidden, f.attention, t.d.proj
    return 4 * h * t.d.hidden + h * 4 + a * p


def rwkv_backward_temporaries(t, f: RwkvFacts, kernel: bool) -> float:
    """Per token: the loop's backward reaches `key[:, t]` and `value[:, t]` through select_backward, which
    allocates a whole [batch, len, attention_hidden] gradient each step, added into the one gathered so far: two
    of each alive at once (measured: 489 B per token at width 64, against these 512)."""
    if kernel:  # the kernel's backward returns whole gradients of key and value (fp32 inside)
        return 3 * f.attention * 4
    return 2 * 2 * f.attention * t.d.proj


def channel_mix_forward_temporaries(t, f: RwkvFacts, kernel: bool) -> float:
    """Per token: the shifted input and the two mixes, the key projection's fp32 LoRA input copy, its output
    and the receptance projection's (measured: 1,024 B per token at hidden 64, this figure)."""
    h, p = f.hidden, t.d.proj
    return 3 * h * t.d.hidden + h * 4 + f.intermediate * p + h * p


def channel_mix_backward_temporaries(t, f: RwkvFacts, kernel: bool) -> float:
    """Per token: the gradients of the squared key and of the value and receptance outputs (measured: 497 B per
    token at hidden 64, against these 512)."""
    return f.intermediate * t.d.proj + 2 * f.hidden * t.d.proj
