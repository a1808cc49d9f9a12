"""What a measured step runs: the planner's own `Plan` (core.estimate.plan) plus `StepOptions`, the few things a
step does that the plan leaves out because the memory model does not depend on them (the clip norm, torch's
foreach loop). There is no second description of a run here: a run config becomes a Plan through
core.estimate.from_config.plan_for_config, as everywhere else, and the planner estimates the very Plan the step
measures."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from core.estimate.bill import estimate
from core.estimate.from_config import plan_for_draft
from core.estimate.plan import Plan, PlanError, validate
from core.estimate.specs import SpecError
from core.precision import torch_dtype
from core.recipe import methods
from core.recipe.config import ConfigError
from core.tracker import TrackerError

MEASURABLE_ATTN = ("sdpa", "eager")  # flash attention needs a GPU and its own kernels


@dataclass(frozen=True)
class StepOptions:
    """How a measured step runs, beyond its plan."""

    max_grad_norm: float = 1.0  # Trainer's clip_grad_norm_ (0: no clipping)
    foreach: bool | None = (
        None  # torch optimizers: None = torch's default for the device (CPU: per-tensor loop)
    )


def step_plan(tuning: str = "lora", **settings) -> Plan:
    """A Plan for a measured step on this CPU (tests, benchmarks): the engine's path (fused LM head, TRL's QLoRA
    preparation) without dropout or checkpointing unless asked, 512 tokens, bf16 under autocast; `settings` are
    Plan fields."""
    base = dict(device="cpu", lora_dropout=0.0, gradient_checkpointing=False, seq_len=512)
    return checked(Plan(tuning=tuning, **{**base, **settings}))


def checked(plan: Plan) -> Plan:
    """The plan validated as the planner validates it, and measurable here; else TrackerError with the fix."""
    try:
        validate(plan)
    except PlanError as exc:
        raise TrackerError(str(exc)) from None
    if plan.attn not in MEASURABLE_ATTN:
        raise TrackerError(f"attention {plan.attn!r} is not measurable here: use sdpa or eager")
    method = methods.get(plan.method)
    if method.traits.reference and not is_engine_path(plan):
        raise TrackerError(
            f"{method.label} is measured through the engine only ({method.trainer_name}: fused LM head, no "
            "prepare_kbit)"
        )
    return plan


def plan_of_config(cfg: dict, device: str = "cpu") -> Plan:
    """The Plan of a run config on `device`, through the one run config -> plan mapping (the data and the weights
    need not exist: they play no part in a step's memory)."""
    try:
        return checked(plan_for_draft(cfg, device=device))
    except ConfigError as exc:
        raise TrackerError(str(exc)) from None


def autocast_dtype(plan: Plan) -> torch.dtype | None:
    """The Trainer's bf16/fp16 autocast dtype, or None (no autocast; fp32 compute never autocasts)."""
    return torch_dtype(plan.compute_dtype) if plan.autocast and plan.compute_dtype != "fp32" else None


def lora_targets(plan: Plan) -> str | list[str]:
    """LoraConfig.target_modules: "all-linear" or the comma-separated names as a list."""
    targets = plan.target_modules.strip()
    return targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]


def estimate_for(model: str, plan: Plan) -> dict:
    """The planner's figures for `plan` on `model` (a preset id or a folder with config.json): tensor_peak_bytes,
    reserved_peak_bytes, device_total_bytes, peak_phase, phases, components; {"error": ...} when it cannot."""
    try:
        est = estimate(replace(plan, model=str(model)))
    except (PlanError, SpecError) as exc:
        return {"error": str(exc)}
    keep = (
        "tensor_peak_bytes",
        "reserved_peak_bytes",
        "device_total_bytes",
        "peak_phase",
        "phases",
        "components",
    )
    return {k: getattr(est, k) for k in keep}


def is_engine_path(plan: Plan) -> bool:
    """What core.train does (TRL's trainers): the fused LM head, QLoRA without prepare_model_for_kbit_training.
    Such plans are measured on the model the engine itself builds; the others (the HF-default baseline the
    planner also knows) on a model built here the way plain Trainer + peft would build it."""
    return plan.fused_lm_head and not plan.prepare_kbit
