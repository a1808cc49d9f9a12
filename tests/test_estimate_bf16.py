"""The planner against a real step when the weights are bfloat16 and there is no autocast: what core.train does
on a CPU for model.dtype bfloat16 (the Train page's smoke path). peft keeps the LoRA adapters fp32, so every
LoRA matmul casts its input up to fp32 and its result back down; with a small vocabulary the step peaks inside
the last decoder layer (forward) or in the final RMSNorm's backward, not at the loss.

Both sides are independent: the plan comes from the run config the way the Train page makes it
(core.estimate.from_config.plan_for_config, device "cpu"); the measurement is a steady-state step of the model built as
core.train builds it, counted by core.tracker's live-tensor tracker (core.measure.step.measure_plan).
"""

import pytest

from core.estimate.bill import estimate
from core.estimate.from_config import plan_for_config
from core.measure.step import measure_plan
from core.recipe.config import validate_config

TOLERANCE = 0.015


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A tiny Llama wide enough that activations, not the few scalars of the step, make up its peak."""
    from core.demo.toy import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("bf16_llama"), "llama", hidden_size=128, intermediate_size=256
    )


def _run_config(model, dropout: float) -> dict:
    return validate_config(
        {
            "model": {"path": str(model), "dtype": "bfloat16", "attn_implementation": "sdpa"},
            "lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": dropout},
            "data": {"path": str(model / "train.jsonl"), "max_length": 96},
            "training": {"per_device_train_batch_size": 4, "max_steps": 1, "gradient_checkpointing": False},
        }
    )


@pytest.mark.parametrize("dropout", [0.05, 0.0], ids=["dropout", "no-dropout"])
def test_bf16_weights_without_autocast_estimate_within_tolerance(wide_llama, dropout):
    from transformers import AutoConfig

    cfg = _run_config(wide_llama, dropout)
    plan = plan_for_config(cfg, 24.0, "cpu")
    # the regime under test: bfloat16 weights and activations, no autocast, CPU kernels
    assert (plan.load_dtype, plan.compute_dtype, plan.autocast, plan.device) == ("bf16", "bf16", False, "cpu")
    est = estimate(plan)

    # the very plan, measured as core.train runs it on a CPU: bfloat16 weights, no autocast
    measured = measure_plan(AutoConfig.from_pretrained(str(wide_llama)), plan)

    peak = measured.steady_peak_bytes
    error = est.tensor_peak_bytes / peak - 1
    assert abs(error) <= TOLERANCE, (
        f"estimated {est.tensor_peak_bytes} ({est.peak_phase}) vs measured {peak} "
        f"({measured.steady_peak_phase}): {error:+.2%}; measured phases {measured.steady_phase_peaks}, "
        f"estimated phases {est.phases}"
    )
    # the estimate puts the peak where the step has it
    assert est.peak_phase == measured.steady_peak_phase
