"""A mixture-of-experts model's own levers: LoRA on the experts or not, and its experts quantized on load.

- LoRA on the experts (peft target_parameters; with target_modules "all-linear" peft 0.21 adds them itself for the
  Qwen-MoE and Mixtral families) costs a merged copy of each layer's experts per layer saved, its gradient in
  backward, and the adapters' parameters, gradients and optimizer states: leaving them out (attention and dense
  layers only) is what saves most on these models, at the cost of not adapting the experts.
- Quantizing the experts on load: bitsandbytes quantizes nn.Linear layers only, so QLoRA leaves a MoE model's
  fused experts in bf16 (most of its weights). axolotl's quantize_moe_experts quantizes them too; this engine
  cannot yet (transformers 5.24 has no such option), so the lever is planned and described, never set by the Train
  form: what_would_fit offers it apart from the recipes it combines.
"""

from __future__ import annotations

from dataclasses import replace

from core.estimate.moe import moe_of
from core.estimate.moe_terms import expert_targets, linear_targets
from core.estimate.plan import Plan
from core.estimate.specs import ModelSpec, lora_targets, normalize_targets

QUANTIZE_COST = (
    "not in this engine yet: bitsandbytes 4-bit quantizes nn.Linear layers only and transformers 5.24 has no option "
    "for fused experts (axolotl's quantize_moe_experts does it), so the Train form cannot set it; dequantized per "
    "forward, slower matmuls"
)
FROZEN_EXPERTS_COST = (
    "the experts (and a router peft wraps as a parameter) are not adapted: attention and dense layers learn"
)


def _targets(plan: Plan, spec: ModelSpec):
    return lora_targets(
        spec.model_id, normalize_targets(plan.target_modules), plan.target_parameters, plan.vision_frozen
    )


def without_experts(plan: Plan, spec: ModelSpec) -> dict | None:
    """The plan change that leaves the experts out of LoRA (explicit Linear targets, no target_parameters), or
    None when they are not adapted."""
    facts = moe_of(spec)
    if facts is None or plan.tuning == "full":
        return None
    targets = _targets(plan, spec)
    if not expert_targets(targets, facts).keys() & {"gate_up_proj", "down_proj"}:
        return None
    names = sorted({s.name.rsplit(".", 1)[-1] for s in linear_targets(targets)})
    return {"target_modules": ",".join(names) or "q_proj,v_proj", "target_parameters": ""}


def with_experts(plan: Plan, spec: ModelSpec) -> dict | None:
    """The plan change that puts LoRA on the experts too (target_parameters), or None when it is there."""
    facts = moe_of(spec)
    if facts is None or plan.tuning == "full" or without_experts(plan, spec) is not None:
        return None
    up = "gate_up_proj" if facts.gated else "up_proj"
    return {"target_parameters": f"{facts.experts_path}.{up},{facts.experts_path}.down_proj"}


def moe_candidates(plan: Plan, spec: ModelSpec) -> list[tuple[str, dict, str, bool]]:
    """(label, plan change, cost, keeps what is trained) of the MoE levers that could lower the bill; neither is
    folded into a combined recipe (one changes what is trained, the other is not in the engine)."""
    if moe_of(spec) is None:
        return []
    out = []
    frozen = without_experts(plan, spec)
    if frozen:
        label = f"LoRA without the experts (lora.target_modules: {frozen['target_modules']}, no target_parameters)"
        out.append((label, frozen, FROZEN_EXPERTS_COST, False))
    if plan.tuning == "qlora" and not plan.quantize_experts:
        out.append(
            ("the experts quantized to 4-bit on load too", {"quantize_experts": True}, QUANTIZE_COST, False)
        )
    if plan.tuning == "lora":
        out.append(
            (
                "QLoRA with the experts quantized on load too",
                {"tuning": "qlora", "quantize_experts": True},
                QUANTIZE_COST,
                False,
            )
        )
    return out


def moe_lever_rows(plan: Plan, spec: ModelSpec, estimate) -> list[dict]:
    """lever_savings' rows for the MoE levers: what LoRA on the experts costs (on or off, whichever the plan has)
    and what quantizing them on load would save (QLoRA)."""
    if moe_of(spec) is None or plan.tuning == "full":
        return []
    rows = []
    base = estimate(plan, spec)
    frozen, adapted = without_experts(plan, spec), with_experts(plan, spec)
    if frozen or adapted:  # the lever "experts left out of LoRA": on when the plan does not adapt them
        other = estimate(replace(plan, **(frozen or adapted)), spec)
        without, within = (other, base) if frozen else (base, other)
        rows.append(
            _row(
                "experts_frozen",
                "Experts left out of LoRA",
                not frozen,
                without,
                within,
                "lora.target_parameters",
                FROZEN_EXPERTS_COST,
                "CPU and GPU",
                True,
                "peft.tuners.lora.layer.ParamWrapper",
            )
        )
    if plan.tuning == "qlora":
        q_on = base if plan.quantize_experts else estimate(replace(plan, quantize_experts=True), spec)
        q_off = estimate(replace(plan, quantize_experts=False), spec) if plan.quantize_experts else base
        rows.append(
            _row(
                "quantize_experts",
                "Experts quantized on load",
                plan.quantize_experts,
                q_on,
                q_off,
                None,
                QUANTIZE_COST,
                "a plan only",
                False,
                "axolotl quantize_moe_experts (not in this engine)",
            )
        )
    return rows


def _row(lever, label, on, smaller, larger, key, costs, runs_on, measured, source) -> dict:
    """A lever_savings row; `smaller` is the plan with the cheaper setting."""
    return {
        "lever": lever,
        "label": label,
        "on": on,
        "saves_bytes": int(larger.device_total_bytes - smaller.device_total_bytes),
        "cpu_pinned_bytes": 0,
        "config_key": key,
        "costs": costs,
        "runs_on": runs_on,
        "measured": measured,
        "term": "measured on CPU" if measured else "modelled, not yet measured",
        "source": source,
    }
