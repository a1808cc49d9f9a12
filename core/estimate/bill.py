"""The GPU memory planner: every term of docs/design/memory-model.md in bytes for one training step
(`python -m core.estimate --model meta-llama/Llama-2-7b-hf --tuning lora --batch-size 4 --seq-len 2048 --json`).
Input is one `Plan` (serialisable with dataclasses.asdict / Plan.from_dict, so the Train page can take it over);
output is an `Estimate`: the components at the peak, the three totals (tensor peak = max_memory_allocated,
reserved peak = max_memory_reserved, device total = what nvidia-smi shows), the phase of the peak, a verdict,
and hints. Exact terms (weights, quantization constants, LoRA parameters, optimizer states, KV cache) are counted
from the real module tree (core.estimate.specs); activations follow what autograd saves in the real HF module code,
one named tensor at a time, layer by layer as each is (core.estimate.layer_kinds), checked against measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.estimate import head_terms
from core.estimate.activation_terms import (
    activation_bytes,
    attention_mask_bytes,
    checkpointing_on,
    head_saved_bytes,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    liger_on,
    logits_bytes,
    offloaded_activations,
    offloading_on,
    outside_layers_saved_bytes,
    step_dtypes,
)
from core.estimate.autocast_terms import autocast_weight_copies
from core.estimate.eval_terms import EVAL_COMPONENTS, Evaluation, eval_terms
from core.estimate.generation_terms import ROLLOUT_COMPONENTS, Rollouts, rollout_terms, with_rollouts
from core.estimate.head_terms import FusedHead, fused_head_bytes
from core.estimate.moe import moe_of
from core.estimate.moe_terms import moe_activation_bytes, moe_moments, with_moe
from core.estimate.plan import (
    CUDA_CONTEXT_BYTES,
    FIT_LIMIT,
    FRAGMENTATION,
    FRAGMENTATION_EXPANDABLE,
    Estimate,
    Plan,
    batch_shape,
    generates,
    largest_batch_tokens,
    validate,
)
from core.estimate.shard_terms import ACCURACY_NOTE, DISTRIBUTED_COMPONENTS, LOAD_NOTE, Sharding, apply, shard
from core.estimate.spec_checks import check_against_spec
from core.estimate.specs import ModelSpec, load_spec, lora_targets, normalize_targets
from core.estimate.static_terms import (
    linear_trainable,
    optimizer_state_bytes,
    optimizer_step_temporaries,
    trainable_param_bytes,
    trainable_tensors,
    weight_bytes,
)
from core.estimate.vlm import vlm_of
from core.estimate.vlm_terms import check_images, vision_terms, vlm_record, with_images
from core.fmt import gib
from core.recipe import methods


def estimate_for_lengths(plan: Plan, lengths, spec: ModelSpec | None = None) -> tuple[int, Estimate]:
    """(tokens in the largest batch rows of these `lengths` can form, the estimate for that batch): the peak of
    the real data next to the max_length bound `plan` describes."""
    tokens = largest_batch_tokens(lengths, plan)
    return tokens, estimate(replace(plan, batch_tokens=tokens), spec)


# ----------------------------------------------------------------------------------------------------------
# the estimate


@dataclass
class StepTerms:
    """Every term of one step's bill before it is arranged into the moments of the step (bytes)."""

    plan: Plan  # with seq_len = the per-row length the terms see
    spec: ModelSpec
    targets: tuple
    batch: int
    tokens: int
    static: dict  # alive through the whole step: weights, constants, reference, LoRA params, optimizer states
    trainable: int
    param_bytes: int
    grads: int
    opt_paged: int
    opt_temp: int
    saved: int  # activations saved for backward (after checkpointing, masks, offloading)
    recompute: int  # a checkpointed layer's activations recomputed in backward
    recurrent_backward: int  # no checkpointing: a recurrent layer's backward, the layers saved below it
    pinned: int  # offloaded to pinned CPU memory
    logits_fwd: int
    logits_bwd: int
    autocast_fwd: int
    autocast_bwd: int
    kv_per_token: int
    fused: FusedHead | None  # TRL's fused LM head, or None for the plain logits path
    reference_text: str | None
    vision: object = None  # a VLM's core.estimate.vlm_terms.VisionTerms


def estimate(plan: Plan, spec: ModelSpec | None = None) -> Estimate:
    """The whole memory bill of one training step of `plan` (per GPU when it trains on several). Raises
    PlanError / SpecError on bad input."""
    warnings = validate(plan)
    spec = spec or load_spec(plan.model)
    if (
        plan.attn == "sdpa" and not spec.sdpa
    ):  # transformers loads it with eager attention (the engine asks so)
        plan = replace(plan, attn="eager")
    targets = (
        lora_targets(
            spec.model_id, normalize_targets(plan.target_modules), plan.target_parameters, plan.vision_frozen
        )
        if plan.tuning != "full"
        else ()
    )
    warnings += check_against_spec(spec, plan, targets) + check_images(spec, plan)
    if plan.gpus > 1 and plan.strategy == "auto":
        # DDP when the plan fits one card (fastest: nothing gathered), else FSDP full shard
        ddp = _estimate(replace(plan, strategy="ddp"), plan, spec, targets, warnings)
        if ddp.verdict == "fits":
            return ddp
        return _estimate(replace(plan, strategy="fsdp"), plan, spec, targets, warnings)
    return _estimate(plan, plan, spec, targets, warnings)


def _estimate(plan: Plan, asked: Plan, spec: ModelSpec, targets, warnings: list[str]) -> Estimate:
    t = step_terms(plan, spec, targets)
    sharding = None
    if plan.gpus > 1:
        sharding = shard(plan, spec, t.static, t.grads, t.opt_temp, t.trainable, t.param_bytes)
        t = replace(t, static=sharding.static, grads=sharding.grads, opt_temp=sharding.opt_temp)
    phase_components = {
        "forward": forward_moment(t),
        "optimizer": {**t.static, "gradients": t.grads, "optimizer_temporaries": t.opt_temp},
        "backward": backward_moment(t),
    }
    if moe_of(spec):
        phase_components.update(moe_moments(t, forward_moment, backward_moment))
    evaluation = eval_terms(spec, plan, targets, t.static, t.kv_per_token)
    if evaluation:
        phase_components["eval"] = dict(evaluation.phase)
    rollouts = rollout_terms(spec, plan, targets, t.static) if generates(plan) else None
    if rollouts:
        phase_components = with_rollouts(phase_components, rollouts)
    if sharding:
        phase_components = apply(sharding, phase_components)
    notes = (
        list(warnings) + ([ACCURACY_NOTE] if sharding else []) + list(rollouts.warnings if rollouts else ())
    )
    est = _bill(asked, t, phase_components, notes, sharding, rollouts, evaluation)
    if t.vision:
        est.vlm = vlm_record(vlm_of(spec), t.vision, plan)
    return with_moe(est, t) if moe_of(spec) else est


def step_terms(plan: Plan, spec: ModelSpec, targets) -> StepTerms:
    """The terms of a step: its tensors' shape (padding-free concatenates the rows, real data may be shorter than
    the bound), the static terms, the activations and the loss head."""
    batch, length = batch_shape(plan)
    tokens = batch * length
    plan = replace(plan, seq_len=length)  # the per-row length the terms below see (score matrix, head tiles)
    weights, quant_constants = weight_bytes(spec, plan)
    tensors = trainable_tensors(spec, plan, targets)
    trainable = sum(tensors)
    param_bytes = trainable_param_bytes(plan)
    opt_inside, opt_paged = optimizer_state_bytes(
        tensors, plan, spec.embedding_params if plan.tuning == "full" else 0
    )
    moe = moe_of(spec)  # a mixture of experts: its layers' terms are core.estimate.moe_terms'
    saved, recompute, recurrent_backward = (moe_activation_bytes if moe else activation_bytes)(
        spec, plan, targets, tokens
    )
    mask_held, mask_per_layer = attention_mask_bytes(spec, plan, tokens)
    if checkpointing_on(plan):
        recompute += mask_per_layer  # the recomputed layer converts the mask again
        saved += mask_held
    else:
        saved += mask_held + spec.num_layers * mask_per_layer
    vision = vision_terms(spec, plan, batch, targets)
    saved += vision.saved if vision else 0  # a VLM's vision tower: kept until the end of backward
    pinned = 0
    if offloading_on(plan):
        saved, recompute, pinned = offloaded_activations(spec, plan, targets, tokens, saved, recompute)
    logits_fwd, logits_bwd = logits_bytes(spec, plan, tokens)
    autocast_fwd, autocast_bwd = autocast_weight_copies(
        spec, plan, trainable if plan.tuning == "full" else linear_trainable(targets, plan)
    )
    kv_per_token = kv_cache_bytes_per_token(spec, plan)
    reference, reference_text = _reference(plan, weights + quant_constants)
    static = {
        "weights": weights,
        "quant_constants": quant_constants,
        "reference_model": reference,
        "lora_params": trainable * param_bytes if plan.tuning != "full" else 0,
        "optimizer_states": opt_inside,
    }
    if vision:
        static["images"] = vision.pixels  # the batch's pixel_values, alive for the whole step
    return StepTerms(
        plan=plan,
        spec=spec,
        targets=targets,
        batch=batch,
        tokens=tokens,
        static=static,
        trainable=trainable,
        param_bytes=param_bytes,
        grads=trainable * param_bytes,
        opt_paged=opt_paged,
        opt_temp=optimizer_step_temporaries(tensors, plan),
        saved=saved,
        recompute=recompute,
        recurrent_backward=recurrent_backward,
        pinned=pinned,
        logits_fwd=logits_fwd,
        logits_bwd=logits_bwd,
        autocast_fwd=autocast_fwd,
        autocast_bwd=autocast_bwd,
        kv_per_token=kv_per_token,
        # the loss: full logits and cross-entropy (plain Trainer) or TRL's fused head (tiles, never the logits)
        fused=fused_head_bytes(spec, plan, batch) if plan.fused_lm_head else None,
        reference_text=reference_text,
        vision=vision,
    )


def _reference(plan: Plan, model_bytes: int) -> tuple[int, str | None]:
    """(bytes, what it is) of a preference method's reference model, or GRPO's with beta > 0 (core.recipe.methods'
    traits)."""
    traits = methods.get(plan.method).traits
    if not (traits.reference or (traits.kl_reference and plan.kl_beta > 0)):
        return 0, None
    if plan.tuning == "full" or plan.reference == "copy":
        return (
            model_bytes,
            "a second, frozen copy of the model (full fine-tuning or an explicit reference model)",
        )
    return 0, "the base model with the adapter disabled: no second copy, one more forward without grad"


def forward_moment(t: StepTerms) -> dict:
    """The forward's largest moment: the end of the loss, or (preference methods) the reference's forward after
    the policy's, or (without checkpointing) inside the last layer's down_proj."""
    plan, spec, fused, tokens = t.plan, t.spec, t.fused, t.tokens
    loss = {"lm_head_loss": fused.forward} if fused else {"logits_loss": t.logits_fwd}
    moment = {**t.static, "autocast_weight_copies": t.autocast_fwd, "activations": t.saved, **loss}
    candidates = [moment]
    if methods.get(plan.method).traits.reference and not plan.precompute_ref and fused:
        # DPOTrainer._compute_loss (KTOTrainer's likewise) runs the reference forward (no grad; the adapter off or
        # the reference model) after the policy's: the policy's saved tensors and log-prob outputs wait next to
        # the reference's transients: one layer at a time (stream, norm output, gate/up/product) or its tiles.
        d = step_dtypes(plan)
        ref_layer = tokens * (3 * spec.hidden_size * d.hidden + 3 * spec.intermediate_size * d.proj)
        candidates.append(
            {
                **t.static,
                "autocast_weight_copies": t.autocast_fwd,
                "activations": t.saved,
                "lm_head_loss": fused.held + fused.outputs + max(ref_layer, fused.forward - fused.held),
            }
        )
    if not checkpointing_on(plan):
        # Inside the last layer's down_proj: everything saved but the final norm's and the loss's tensors,
        # next to that layer's unsaved temporaries.
        candidates.append(
            {
                **t.static,
                "autocast_weight_copies": t.autocast_fwd,
                "activations": max(0, t.saved - int(tokens * outside_layers_saved_bytes(spec, plan))),
                "logits_loss": int(tokens * head_terms.last_layer_forward_temporaries(spec, plan, t.targets)),
            }
        )
    best = candidates[0]
    for c in candidates[1:]:  # a later moment wins only when strictly larger, as the model was written
        if sum(c.values()) > sum(best.values()):
            best = c
    return best


def backward_moment(t: StepTerms) -> dict:
    """Backward's largest moment. Gradients fill up while activations drain: the start (all saved tensors and the
    loss's gradients, or the head's gradient as the loss's backward returns), the first and the last decoder
    layer backward meets, the tail (the embedding's backward) and, for RMSNorm models, the final norm's."""
    plan, spec, fused, tokens, static = t.plan, t.spec, t.fused, t.tokens, t.static
    d = step_dtypes(plan)
    head_grad = (spec.lm_head_params or spec.embedding_params) * t.param_bytes if plan.tuning == "full" else 0
    loss_bwd = {"lm_head_loss": fused.backward} if fused else {"logits_loss": t.logits_bwd}
    early = {
        **static,
        "autocast_weight_copies": t.autocast_bwd,
        "activations": t.saved,
        **loss_bwd,
        "gradients": 0,
    }
    if fused:
        # As the fused loss's backward returns: its fp32 accumulators and their casts, the head's gradient.
        head_moment = {**early, "lm_head_loss": fused.end, "gradients": head_grad}
    else:
        # The lm_head's weight gradient appears only after the cross-entropy backward has freed its 12 B per
        # logit; then just the 16-bit gradient of the logits is left next to it.
        head_moment = {**early, "logits_loss": tokens * spec.vocab_size * d.logits, "gradients": head_grad}
    if sum(head_moment.values()) > sum(early.values()):
        early = head_moment
    # Later in backward the activations drain while gradients pile up. Two moments bound it:
    # - the last decoder layer backward meets (layer 0): with checkpointing its recomputed activations
    #   next to the gradients of everything above it (taken as all gradients but the embedding's: an upper
    #   bound, some of layer 0's own come only after its activations are freed);
    # - the tail, the embedding's backward: all gradients, the gradient reaching the embedding, and for a
    #   tied embedding trained in full its two gradients (lm_head's, the embedding's) and their out-of-place
    #   sum (AccumulateGrad) alive at once.
    tied = spec.tie_word_embeddings and plan.tuning == "full"
    embedding_grad = spec.embedding_params * t.param_bytes if (plan.tuning == "full" and not tied) else 0
    last_layer = {
        **static,
        "autocast_weight_copies": 0,  # released with the activations they were saved for
        "activations": t.recompute,
        "gradients": t.grads - embedding_grad,
        "logits_loss": 2 * tokens * spec.hidden_size * d.hidden,
    }
    tail = {
        **static,
        "autocast_weight_copies": 0,
        # a VLM's vision tower comes last: its saved tensors (one block recomputed with checkpointing)
        "activations": (t.vision.recompute or t.vision.saved) if t.vision else 0,
        "gradients": t.grads + (2 * spec.embedding_params * t.param_bytes if tied else 0),
        "logits_loss": tokens * spec.hidden_size * d.hidden,
    }
    # The first decoder layer backward meets (the last one): its saved tensors (recomputed ones with
    # checkpointing) next to the gradients flowing through its SwiGLU MLP: the gradient of the gated product
    # and of its two factors (3 x tokens x intermediate) plus the one of the residual stream. It outgrows the
    # start of backward only when the vocabulary is small.
    # Liger's SwiGLU backward writes the two factors' gradients into the saved gate and up (in place).
    factors = 1 if liger_on(plan) else 3
    flowing = tokens * (factors * spec.intermediate_size * d.proj + spec.hidden_size * d.hidden)
    first_layer = {
        **static,
        "autocast_weight_copies": t.autocast_bwd,
        "activations": t.saved + t.recompute,
        "logits_loss": flowing,
        "gradients": head_grad,
    }
    moments = (early, first_layer, last_layer, tail)
    if t.recurrent_backward:  # inside a recurrent layer's backward (no checkpointing): its chunk temporaries
        moments += ({**static, "activations": t.recurrent_backward, "gradients": head_grad},)
    if spec.model_type not in head_terms.LAYERNORM_MODELS:
        # The final norm's backward, after the cross-entropy's and lm_head's: the saved activations (less what
        # lm_head and the norm's weight multiply saved, freed by their backward) next to its fp32 temporaries.
        # It outgrows the start of backward only when the vocabulary is small.
        moments += (
            {
                **static,
                "autocast_weight_copies": t.autocast_bwd,
                "activations": max(0, t.saved - int(tokens * head_saved_bytes(spec, plan))),
                "logits_loss": int(tokens * head_terms.final_norm_backward_temporaries(spec)),
                "gradients": head_grad,
            },
        )
    return max(moments, key=lambda c: sum(c.values()))


def _bill(
    asked: Plan,
    t: StepTerms,
    phase_components: dict,
    warnings: list[str],
    sharding: Sharding | None = None,
    rollouts: Rollouts | None = None,
    evaluation: Evaluation | None = None,
) -> Estimate:
    """The Estimate: the peak phase, the allocator's overhead and the CUDA context on top, the verdict (per GPU
    when `sharding` spreads the plan over several; with the generation phase of a method's `rollouts`, and the
    `evaluation` phase of a run that evaluates)."""
    plan, spec = t.plan, t.spec
    phases = {name: sum(c.values()) for name, c in phase_components.items()}
    context = 0 if plan.device == "cpu" else CUDA_CONTEXT_BYTES
    nccl = sharding.nccl if sharding else 0

    def allocator_of(phase: str) -> int:
        if plan.device == "cpu":
            return 0
        share = FRAGMENTATION_EXPANDABLE if plan.expandable_segments else FRAGMENTATION
        # the load moment's weights are allocated once and kept (nothing comes and goes): no fragmentation share;
        # nor has vLLM's pool, allocated whole
        held = phases[phase] if phase == "load" else sum(t.static.values())
        held += phase_components[phase].get("vllm_pool", 0)
        return int(share * max(0, phases[phase] - held))

    peak_phase = max(phases, key=phases.get)
    tensor_peak = phases[peak_phase]
    allocator = allocator_of(peak_phase)
    reserved = tensor_peak + allocator
    device_total = reserved + context + nccl + t.opt_paged
    record = sharding.record() if sharding else None
    if sharding:
        # the step alone, without the load moment: what the card holds once training runs
        step = max((p for p in phases if p != "load"), key=phases.get)
        step_reserved = phases[step] + allocator_of(step)
        record.update(
            step_tensor_peak_bytes=int(phases[step]),
            step_reserved_peak_bytes=int(step_reserved),
            step_device_total_bytes=int(step_reserved + context + nccl + t.opt_paged),
        )
        if peak_phase == "load":
            names = {"fsdp": "FSDP", "deepspeed_zero3": "ZeRO-3"}
            warnings = warnings + [
                LOAD_NOTE.format(
                    load=gib(device_total),
                    strategy=names[sharding.strategy],
                    step=gib(record["step_device_total_bytes"]),
                )
            ]
    order = COMPONENT_ORDER + (DISTRIBUTED_COMPONENTS if sharding else ())
    order += tuple(c for c in ROLLOUT_COMPONENTS if c not in order) if rollouts else ()
    order += tuple(c for c in EVAL_COMPONENTS if c not in order) if evaluation else ()
    order = with_images(order) if t.vision else order  # a language model's record stays as it was
    components = dict.fromkeys(order, 0)
    components.update(phase_components[peak_phase])
    components.update(
        {"allocator_overhead": allocator, "cuda_context": context, "paged_optimizer_states": t.opt_paged}
    )
    if sharding:
        components["nccl_context"] = nccl
    gpu = plan.gpu_bytes
    frac = device_total / gpu
    verdict = "fits" if frac <= FIT_LIMIT else ("tight" if frac <= 1.0 else "does not fit")
    return Estimate(
        plan=asked.to_dict(),
        model_id=spec.model_id,
        components={k: int(components[k]) for k in order},
        phases={k: int(v) for k, v in phases.items()},
        phase_components={k: {n: int(b) for n, b in c.items()} for k, c in phase_components.items()},
        tensor_peak_bytes=int(tensor_peak),
        reserved_peak_bytes=int(reserved),
        device_total_bytes=int(device_total),
        peak_phase=peak_phase,
        gpu_bytes=gpu,
        fits=verdict == "fits",
        verdict=verdict,
        trainable_params=t.trainable,
        total_params=spec.total_params,
        kv_cache_bytes_per_token=t.kv_per_token,
        activation_bytes_per_token_per_layer=layer_activation_bytes(spec, plan, t.targets),
        reference=t.reference_text,
        cpu_pinned_bytes=int(t.pinned),
        batch_rows=t.batch,
        batch_length=plan.seq_len,
        warnings=warnings,
        distributed=record,
        generation=(
            {
                **rollouts.record(),
                "bytes": int(phases["generation"]),
                "components": {k: int(v) for k, v in phase_components["generation"].items() if v},
            }
            if rollouts
            else None
        ),
        evaluation=(
            {
                **evaluation.record(),
                # every moment with what the whole phase holds beside it (GRPO's rollouts, sharded terms)
                "moments": {
                    k: int(v + phases["eval"] - sum(evaluation.phase.values()))
                    for k, v in evaluation.moments.items()
                },
                "bytes": int(phases["eval"]),
                "components": {k: int(v) for k, v in phase_components["eval"].items() if v},
            }
            if evaluation
            else None
        ),
    )


COMPONENT_ORDER = (
    "weights",
    "quant_constants",
    "reference_model",
    "lora_params",
    "gradients",
    "optimizer_states",
    "optimizer_temporaries",
    "autocast_weight_copies",
    "activations",
    "logits_loss",
    "lm_head_loss",  # TRL's fused LM head + loss (fused_lm_head); logits_loss is the plain path's
    "kv_cache",
    "allocator_overhead",
    "cuda_context",
    "paged_optimizer_states",
)
# Terms outside torch's allocator stats (not in tensor/reserved peak, but on the card)
OUTSIDE_TORCH = ("cuda_context", "paged_optimizer_states", "nccl_context")
