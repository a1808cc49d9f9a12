"""Gemma 3n's text decoder (transformers 5.25 models/gemma3n/modeling_gemma3n.py: Gemma3nTextDecoderLayer,
Gemma3nTextAltUp, Gemma3nTextLaurelBlock, Gemma3nTextMLP, Gemma3nTextModel): what its layers and the model around
them save beyond a Gemma 4 layer of the same shape (core.estimate.layer_shapes plans its attention, KV sharing, the
per-layer MLP width and the per-layer input block).

AltUp keeps n = altup_num_inputs copies of the hidden stream (one tensor n x tokens x hidden) from the embedding to
the last layer; each layer runs only copy 0 (altup_active_idx) through attention and the MLP:
- predict: the modalities of copy 0 (router_norm, `* 1/hidden`, modality_router hidden -> n, tanh in fp32: its
  output saved), prediction_coefs (n -> n^2), then `matmul(copies.permute(1, 2, 3, 0), coefs)`: the matmul keeps a
  contiguous copy of the n copies and the coefficients;
- correct: the modalities of the layer's output (router_norm and modality_router again, a second tanh),
  `innovation = (output - prediction_0).repeat(n)` and the correction coefficients (F.linear of the modalities by
  the clamped correction_coefs weight, + 1), multiplied: the multiply keeps both. In training the weight is clamped
  (altup_coef_clip), so F.linear bypasses the module and its LoRA: that adapter keeps nothing (and learns nothing).
Laurel (a low-rank residual beside attention): linear_left (hidden -> laurel_rank) on the normed input, linear_right
back, post_laurel_norm -- the norm is one of the layer's norms, the adapters keep their inputs.
Activation sparsity (the first layers, activation_sparsity_pattern > 0): the gate goes through a gaussian top-k
before the activation, `relu(gate - (mean + std x z))`: std keeps the gate projection's output and its own result,
relu its output (the activation's input).

Around the layers the model projects the embedding to the other n - 1 copies (altup_projections, each rescaled to
the embedding's magnitude: `x**2`, mean, clamp, sqrt, `x * target / magnitude`) and at the end projects them back
(altup_unembed_projections, the same rescaling) and averages them. Under CUDA autocast `pow` runs in fp32
(autocast's fp32 list), so the squared tensors' saved inputs are fp32 copies there; on the CPU they are the
tensors themselves. With gradient checkpointing each checkpointed layer keeps its input: all n copies."""

from __future__ import annotations


def _pow_bytes(t) -> int:
    """Bytes of what `x**2` keeps of a stream tensor: an fp32 copy under CUDA autocast, else the tensor itself."""
    return 4 if (t.d.autocast and t.plan.device == "cuda") else t.d.hidden


def altup_layer(t, shape) -> None:
    """Add, per token, what one Gemma 3n layer saves for AltUp, Laurel and activation sparsity (`t`: a LayerTerms
    of the layer, core.estimate.activation_terms; `shape`: its LayerShape)."""
    d, h, n = t.d, t.spec.hidden_size, shape.altup
    c, p = d.hidden, d.proj
    # predict and correct each score the modalities; predict's router_norm is counted with the layer's norms
    t.norm("altup.router_norm_correct")
    t.linear_input("altup.modality_router", h, c, "altup.router_input", "modality_router")
    t.linear_input("altup.modality_router_correct", h, c, "altup.router_input_correct", "modality_router")
    t.saved["altup.modalities_fp32"] = 2 * n * 4  # tanh(routed.float()) twice
    t.linear_input("altup.prediction_coefs", n, c, "altup.modalities", "prediction_coefs")
    if not shape.coef_clip:  # without the clamp, correction_coefs runs as a module (its LoRA with it)
        t.linear_input("altup.correction_coefs", n, c, "altup.modalities_correct", "correction_coefs")
    t.saved["altup.prediction_coefs_out"] = n * n * p
    t.saved["altup.copies_permuted"] = n * h * p  # the matmul's contiguous copy of the permuted copies
    t.saved["altup.innovation"] = n * h * c
    t.saved["altup.correction_coefs_out"] = n * p
    if shape.laurel:
        t.linear_input("laurel.linear_left", h, c, "laurel.input", "linear_left")
        t.linear_input("laurel.linear_right", shape.laurel, p, "laurel.left_out", "linear_right")
    if shape.sparse:
        t.saved["mlp.gate_before_sparsity"] = (shape.inter or t.spec.intermediate_size) * p
        t.saved["mlp.sparsity_std"] = p


def _rescaled_copy(t, current_grad: bool, target_grad: bool) -> float:
    """Per token, what `x * target / sqrt(clamp(mean(x**2)))` keeps of one projected copy x (hidden wide)."""
    h, c, pw = t.spec.hidden_size, t.d.hidden, _pow_bytes(t)
    # only the target magnitude needs a gradient: the multiply keeps x, the divide the magnitude
    if not current_grad:
        return h * c + pw if target_grad else 0.0
    # x**2's input, clamp's input and sqrt's output, the divided product (promoted to the magnitude's dtype), and x
    # itself where the multiply keeps it apart from x**2's (fp32) copy
    return h * pw + 2 * pw + h * max(c, pw) + (h * c if target_grad and pw != c else 0)


def altup_outside(t, shapes, checkpointing: bool) -> float:
    """Per token, what Gemma 3n saves outside its layers for AltUp: the projections to the other copies and back
    (their LoRA inputs, the rescaling), the copies every checkpointed layer keeps as its input, and the first
    layer's input norm (its input, the AltUp prediction, needs a gradient once any AltUp weight is adapted)."""
    if not shapes or not shapes[0].altup:
        return 0.0
    spec, d = t.spec, t.d
    h, n, c, pw = spec.hidden_size, shapes[0].altup, d.hidden, _pow_bytes(t)
    embeds_grad = t.full or (t.plan.tuning == "lora" and checkpointing)  # enable_input_require_grads
    saved_before = dict(t.saved)
    b = 0.0
    # the projections to copies 1..n-1 and back (model.altup_projections.<i>, altup_unembed_projections.<i>: both
    # of leaf names "0", "1", ..., which all-linear adapts together)
    adapted = [str(i) in t.every_adapted for i in range(n - 1)]
    t.adapted = t.every_adapted  # modules outside the layers: not among layer 0's
    for i in range(n - 1):
        t.linear_input(f"altup_projections.{i}", h, c, "inputs_embeds", str(i))
        b += _rescaled_copy(t, adapted[i] or embeds_grad, embeds_grad)
    if any(adapted) or embeds_grad:
        b += pw  # the embedding's magnitude, kept by the multiplies
    if embeds_grad:
        b += h * pw + pw  # the embedding squared (its input) and the magnitude's square root (its input)
    # back from the copies: the last layer's output needs a gradient, so every rescaling keeps its tensors
    for i in range(n - 1):
        t.linear_input(f"altup_unembed_projections.{i}", h, c, "altup.stream_out", str(i))
        b += _rescaled_copy(t, True, True)
    t.saved.pop("altup.stream_out", None)
    # copy 0 squared: on the CPU a view of the last layer's output, which stays whole (all n copies)
    b += n * h * c if pw == c else h * pw
    b += 2 * pw  # the magnitude's square root keeps its input; the multiplies keep the magnitude
    b += sum(v for k, v in t.saved.items() if k not in saved_before and k != "inputs_embeds")
    if checkpointing:
        # each checkpointed layer's input holds all n copies (the plan counts one)
        b += (n - 1) * h * c * len(shapes)
    elif t.plan.tuning != "full" and (
        any(adapted) or {"modality_router", "prediction_coefs"} & t.every_adapted
    ):
        # layer 0's input_layernorm keeps its fp32 input and rstd (the plan leaves them out for layer 0)
        b += 4 * h + 4
    return b
