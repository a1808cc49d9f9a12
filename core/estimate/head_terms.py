"""The head end of the bill: the last layer's forward and the final norm's backward temporaries, and TRL's fused LM
head (trl.trainer.utils.add_fused_lm_head): what its tiles, saved inputs and fp32 accumulators hold at each moment of
the step, from trl 1.16's code."""

from __future__ import annotations

from dataclasses import dataclass

from core.estimate.activation_terms import embedding_output_requires_grad, layer_saved_tensors, step_dtypes
from core.estimate.layer_kinds import text_config
from core.estimate.plan import DTYPE_BYTES, Plan
from core.estimate.specs import ModelSpec
from core.estimate.static_terms import adapter_bytes
from core.recipe import methods

# trl 1.16: trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE and trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
FUSED_TOKEN_CHUNK = 4096
FUSED_VOCAB_CHUNK = 32768


@dataclass(frozen=True)
class FusedHead:
    """TRL's fused LM head + SFTTrainer.compute_loss: bytes next to the saved activations at each moment."""

    held: int  # saved by the fused loss for backward (its hidden input, per-token statistics)
    forward: int  # held + the forward's tile temporaries, at its largest
    backward: int  # held + the backward's tile temporaries and fp32 gradient accumulators, at its largest
    end: int  # as the loss backward returns: the fp32 accumulators and their casts to the input dtypes
    outputs: int  # its per-token outputs (log-probs, entropy, ...), alive until the loss is taken from them


def fused_head_bytes(spec: ModelSpec, plan: Plan, rows: int) -> FusedHead:
    """The loss through trl.trainer.utils.add_fused_lm_head (SFTTrainer adds it with outputs log_probs,
    entropy, is_top1) and trl.kernels.chunked_logprob.ChunkedLogProbFunction, from their code (trl 1.16).

    `_fused_forward` scores hidden_states[:, :-1]: N = rows x (seq_len - 1) positions. On CUDA with Triton
    (`compact = _use_triton(device)`) only positions whose label is not -100 are gathered (`hidden[mask]`, a
    copy, saved); planned as all positions valid. Elsewhere (the CPU) every position is scored through
    `hidden.reshape(-1, H)`: a view of the final norm's output for one row (which the save then keeps alive),
    a saved copy for more. The Function saves the hidden input, the clamped targets (int64), log_z and the
    entropy (fp32 per token).

    Both passes project min(N, 4096) tokens x 32768 vocabulary columns at a time into `mm_buf`, allocated
    full width in the compute dtype (the autocast dtype, else the hidden dtype) even when the vocabulary is
    smaller; `hidden_chunk = hidden[..].to(compute)` and the weight chunk `.to(compute)` are copies only when
    the dtypes differ. Forward keeps seven fp32 per-token statistics. Backward allocates the fp32 grad_hidden
    (N x H) and, when the head trains, the fp32 grad_weight (V x H), then returns both cast to their inputs'
    dtypes.

    Triton branch (modelled from the code, not measured here): the fold and the gradient are written in place
    into the tile, and `_addmm_fp32` accumulates with `torch.addmm(out_dtype=float32)`: no tile temporaries.
    CPU branch (measured): `_forward_tile` holds z, exp(z - max), e * z (entropy) and the top-1 bool mask: 13
    B per tile element; `_backward_tile` holds y, z, log_p, p, grad, the bool and float target masks, and
    `is_target.float() - p` with its product: 29 B per element (33 with a softcap: tanh's output kept);
    `_addmm_fp32` then makes fp32 copies of the tile and of the weight chunk (or of the hidden chunk for
    grad_weight) when the compute dtype is 16-bit.
    """
    d = step_dtypes(plan)
    h, vocab = spec.hidden_size, spec.vocab_size
    n_all = rows * (plan.seq_len - 1)
    triton = plan.device == "cuda"
    traits = methods.get(plan.method).traits
    # GRPO labels only the completion: Triton gathers those positions, the CPU path scores every one
    scored = rows * plan.completion_len if (triton and traits.generates) else n_all
    n = min(scored, FUSED_TOKEN_CHUNK)
    cols = min(vocab, FUSED_VOCAB_CHUNK)
    tile = n * cols
    hd = d.hidden
    cd = DTYPE_BYTES[plan.compute_dtype] if d.autocast else hd
    if plan.tuning == "full" or not (plan.tuning == "qlora" and plan.prepare_kbit):
        wd = DTYPE_BYTES[plan.load_dtype]
    else:
        wd = 4  # prepare_model_for_kbit_training upcast the lm_head
    head_trains = plan.tuning == "full"
    final_norm_out = rows * plan.seq_len * h * hd  # last_hidden_state
    mm_buf = n * FUSED_VOCAB_CHUNK * cd
    hidden_chunk = n * h * cd if hd != cd else 0
    weight_chunk = cols * h * cd if wd != cd else 0
    # the saved hidden: a gathered (Triton) or reshaped (CPU, several rows) copy, or the norm output itself
    hidden_own = scored * h * hd if (triton or rows > 1) else 0
    per_token_saved = scored * (8 + 4 + 4) + n_all  # targets, log_z, entropy; the label mask
    held = hidden_own + (0 if hidden_own else final_norm_out) + per_token_saved
    stats = 7 * scored * 4
    # log_probs, entropy, is_top1 (SFT, DPO), the label mask, all as wide as the labels (scattered back)
    outputs = n_all * (4 + 4 + (1 if traits.head_is_top1 else 0) + 1)
    # DPO/KTOTrainer also ask for mean_logits (their logits/* metrics)
    outputs += n_all * 4 * traits.head_outputs
    if triton:
        fold_fwd = weight_chunk  # the transient weight-chunk copy inside torch.mm
        fold_bwd = 0
    else:
        fold_fwd = max((13 if traits.head_is_top1 else 12) * tile, weight_chunk)
        addmm = 0 if cd == 4 else 4 * tile + 4 * max(cols * h, n * h if head_trains else 0)
        # a softcapped head (Gemma 2 / 3 / 3n) keeps t = tanh(y / cap) through the tile's backward for its
        # (1 - t * t) factor: one more fp32 tile (its forward's tanh chain peaks below the later moment)
        softcap = 4 if text_config(spec).get("final_logit_softcapping") else 0
        fold_bwd = max((29 + softcap) * tile, addmm)
    # forward: the norm output stays alive until the loss returns, next to the saved copy
    forward = (
        held + (final_norm_out if hidden_own else 0) + stats + outputs + mm_buf + hidden_chunk + fold_fwd
    )
    grad_weight = vocab * h * 4 if head_trains else 0
    grad_in = n_all * 4  # the incoming gradient of log_probs (masked_fill's backward)
    backward = held + grad_in + scored * h * 4 + grad_weight + mm_buf + hidden_chunk + weight_chunk + fold_bwd
    # `.to(dtype)` of an fp32 accumulator is the same tensor when the input is fp32; the head's returned
    # gradient becomes its .grad (counted under gradients), so only a separate fp32 accumulator adds here.
    end = held + scored * h * (4 + (hd if hd != 4 else 0)) + (grad_weight if wd != 4 else 0)
    return FusedHead(held, forward, backward, end, outputs)


def last_layer_forward_temporaries(spec: ModelSpec, plan: Plan, targets=()) -> float:
    """Per token: what is alive but not saved for backward while the last decoder layer runs its down_proj.

    With a small vocabulary (or a short sequence of a wide model) forward peaks here, not at the loss. Alive
    then, from the module code: LlamaModel keeps `inputs_embeds` (one more tensor when it is not also the
    layer input), the decoder loop the layer input, the layer its `residual`, and the MLP its input (the
    post-attention norm output) and the gated product; the base down_proj's output; and for a LoRA
    down_proj, peft's `x = x.to(lora_A.weight.dtype)` (a local alive until forward returns; saved, so
    already counted, only without dropout and autocast), and `result + lora_B(lora_A(x)) * scaling`: the
    lora_B output and its scaled copy (or the scaled copy and the sum, promoted to fp32 when the base is
    16-bit and the adapter fp32; TRL's bf16 QLoRA adapters need no cast). Tensors a full fine-tune saves
    anyway are not counted twice.
    Not used with gradient checkpointing: there the recompute moments of backward bound the step."""
    saved = layer_saved_tensors(spec, plan, targets)
    d = step_dtypes(plan)
    h, inter = spec.hidden_size, spec.intermediate_size
    adapted = {s.name.rsplit(".", 1)[-1] for s in targets}
    # A 32-bit residual stream needs no upcast in RMSNorm, so the norms save the stream tensors themselves:
    # the layer input (input_layernorm's) and `residual` (post_attention_layernorm's) are counted already,
    # and so is `inputs_embeds` when layer 0 saves it (its input needs grad).
    stream_saved = d.hidden == 4
    needs_grad = embedding_output_requires_grad(plan)
    stream = 0 if stream_saved else 2  # the layer input and `residual`
    if spec.num_layers > 1 and not (stream_saved and needs_grad):
        stream += 1  # `inputs_embeds`, a tensor of its own once the first layer has run
    elif spec.num_layers == 1 and stream_saved and not needs_grad:
        stream += 1  # the one layer's input is `inputs_embeds`, which layer 0 leaves unsaved
    if "mlp_norm_out" not in saved:
        stream += 1  # the post-attention norm output, the MLP's input
    b = stream * h * d.hidden
    if "gated_product" not in saved:
        b += inter * d.proj
    b += h * d.proj  # the base down_proj output
    if "down_proj" in adapted:
        ad, compute = adapter_bytes(plan), DTYPE_BYTES[plan.compute_dtype]
        lora = compute if d.autocast else ad
        if d.proj != ad and (plan.lora_dropout > 0 or (d.autocast and ad != compute)):
            b += inter * ad  # peft's cast of the input to the adapter dtype, not itself saved
        b += h * lora + h * max(lora, d.proj)
    return b


# Families whose final norm is nn.LayerNorm: its backward is one fused kernel, without RMSNorm's fp32 chain.
LAYERNORM_MODELS = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi")


def final_norm_backward_temporaries(spec: ModelSpec) -> float:
    """Per token: the fp32 temporaries of the final RMSNorm's backward (its input was upcast to fp32), alive
    next to every saved activation once the logits' gradients are gone. Through `x * rsqrt(mean(x^2) + eps)`:
    the gradient g * rstd (kept until the two paths into x are summed), the mean's expanded gradient, pow's
    x^1 and 2 * x^1, and their product with the gradient: five fp32 tensors as wide as the hidden state."""
    return 5 * spec.hidden_size * 4
