"""What would make a generating method's plan fit (GRPO's own changes, beside the levers every method has): fewer
completions per prompt, shorter completions, a smaller batch that keeps the generation batch, less of the card for
a colocated vLLM, and vLLM asleep outside generation. Each is a change of Plan fields with its cost, as
core.estimate.levers offers them; a batch or completion that shrinks shrinks to the largest that fits.
"""

from __future__ import annotations

from dataclasses import replace

from core.estimate.bill import estimate
from core.estimate.fit import largest, resized
from core.estimate.generation_terms import vllm_need
from core.estimate.plan import GiB, Plan, PlanError, generation_batch
from core.estimate.specs import ModelSpec, SpecError

GROUP_COST = "fewer completions per prompt: a noisier group baseline, less learning signal per prompt"
COMPLETION_COST = "longer completions are cut at the limit (and rewarded as cut)"
SLEEP_COST = "vLLM's weights are pushed again before each generation (host-device copies: slower steps)"


def _fits(plan: Plan, spec: ModelSpec) -> bool:
    try:
        return estimate(plan, spec).verdict == "fits"
    except (PlanError, SpecError):
        return False


def fewer_generations(plan: Plan, spec: ModelSpec) -> dict | None:
    """num_generations lowered, the prompts of a generation kept (so the batch and the generation batch shrink
    with it): the largest group that fits, else the smallest TRL takes (2). None when none is valid."""
    g = generation_batch(plan)
    if g % plan.num_generations:
        return None  # groups spread over several GPUs: keep them as they are
    prompts, steps = g // plan.num_generations, g // plan.batch_size
    options = []
    for n in range(plan.num_generations - 1, 1, -1):
        if (prompts * n) % steps == 0:
            options.append(
                {"num_generations": n, "batch_size": prompts * n // steps, "generation_batch": prompts * n}
            )
    if not options:
        return None
    return next((c for c in options if _fits(replace(plan, **c), spec)), options[-1])


def smaller_batch(plan: Plan, spec: ModelSpec) -> int:
    """The largest batch below the plan's that divides its generation batch (the same completions generated
    at once, trained in more steps) and fits; else the smallest such batch. 0 when there is none."""
    g = generation_batch(plan)
    sizes = [b for b in range(plan.batch_size - 1, 0, -1) if g % b == 0]
    fitting = (b for b in sizes if _fits(replace(plan, batch_size=b, generation_batch=g), spec))
    return next(fitting, sizes[-1] if sizes else 0)


def rollout_candidates(plan: Plan, spec: ModelSpec) -> list[tuple[str, dict, str, bool]]:
    """(label, plan change, cost, keeps what is trained) of a generating plan, as levers._candidates lists them."""
    out = []
    fewer = fewer_generations(plan, spec)
    if fewer:
        out.append(
            (
                f"num_generations {fewer['num_generations']} (per_device_train_batch_size {fewer['batch_size']}): "
                f"the same prompts, {fewer['num_generations']} completions each",
                fewer,
                GROUP_COST,
                False,
            )
        )
    b = smaller_batch(plan, spec)
    if b:
        steps = generation_batch(plan) // b
        out.append(
            (
                f"per_device_train_batch_size {b} with steps_per_generation {steps} (the same "
                f"{generation_batch(plan)} completions per generation; gradient_accumulation_steps x"
                f"{-(-plan.batch_size // b)} keeps the effective batch)",
                {"batch_size": b, "generation_batch": generation_batch(plan), "batch_tokens": 0},
                "more, smaller steps per generation; the generation phase is unchanged",
                True,
            )
        )
    if plan.completion_len > 16:
        step = 16 if plan.completion_len > 64 else 1
        c = largest(plan, spec, "completion_len", plan.completion_len - 1, step=step) or max(
            1, plan.completion_len // 2
        )
        change = {"completion_len": c, "seq_len": plan.seq_len - plan.completion_len + c}
        out.append((f"max_completion_length {c}", change, COMPLETION_COST, False))
    if plan.vllm == "colocate":
        need = vllm_need(spec, plan)
        if need < plan.vllm_fraction:
            out.append(
                (
                    f"vllm_gpu_memory_utilization {need:g} (vLLM's weights and one generation batch's KV cache: "
                    f"{need * plan.gpu_bytes / GiB:.1f} GiB)",
                    {"vllm_fraction": need},
                    "vLLM keeps less KV cache: fewer sequences at once when a generation batch grows",
                    True,
                )
            )
        if not plan.vllm_sleep:
            out.append(
                ("vLLM sleep mode (vllm_enable_sleep_mode: true)", {"vllm_sleep": True}, SLEEP_COST, True)
            )
    return out


def shrink(plan: Plan, name: str) -> tuple[dict, str] | None:
    """The next smaller batch (a divisor of the generation batch) or half the completion of a generating plan, as
    "What would make it fit"'s combination shrinks them; None when it cannot shrink further."""
    if name == "batch_size":
        sizes = [b for b in range(plan.batch_size // 2, 0, -1) if generation_batch(plan) % b == 0]
        if not sizes:
            return None
        return {
            "batch_size": sizes[0],
            "generation_batch": generation_batch(plan),
            "batch_tokens": 0,
        }, "more steps"
    if plan.completion_len <= 16:
        return None
    half = resized(plan, "completion_len", max(16, plan.completion_len // 2))
    return {
        "completion_len": half.completion_len,
        "seq_len": half.seq_len,
        "batch_tokens": 0,
    }, COMPLETION_COST


__all__ = ["rollout_candidates", "shrink"]
