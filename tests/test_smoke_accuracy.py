"""The Train page's smoke test agrees with the planner: a real one-step run (core.train --smoke, launched as the
page launches it) measures a peak within 10% of the estimate the page wrote to plan.json for the same config.

Both sides are independent: core.estimate computes from the model's config.json, the tracker counts the live
tensors of the real Trainer step. Before the fix the smoke step measured a short unpadded row and no optimizer
state (-18%), and on a CPU the plan assumed float32 for a bfloat16 model (-47%).
"""

import json
import time
from pathlib import Path

import pytest

from core.estimate.from_config import estimate_for_config
from core.recipe.config import validate_config
from core.runs.admin import start_smoke_test
from core.runs.launcher import wait_for_smoke

TOLERANCE = 0.10


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    """A tiny Llama wide enough that activations, not the Trainer's few scalars, make up its step's peak."""
    from core.demo.toy import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("wide_llama"), "llama", hidden_size=128, intermediate_size=256
    )


@pytest.fixture(scope="module")
def short_rows(tmp_path_factory) -> Path:
    """Rows far shorter than max_length: the smoke step must still measure a max_length step."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"instruction": f"Add one to {i}", "output": f"{i + 1}"} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(model: Path, data: Path, dtype: str, **lora) -> dict:
    return validate_config(
        {
            "model": {"path": str(model), "dtype": dtype},
            "lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", **lora},
            "data": {"path": str(data), "max_length": 96},
            "training": {"per_device_train_batch_size": 4, "max_steps": 10},
        }
    )


def _smoke(workspace: Path, name: str, cfg: dict) -> dict:
    """As pages/train.py smoke_panel does it on a machine without a GPU."""
    run_dir = start_smoke_test(workspace, name, cfg)  # the trainer plans its own step (plan.json)
    result = wait_for_smoke(run_dir, timeout=120)
    assert result is not None and result["state"] == "finished", result
    return result


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "lora"),
    [
        ("auto", {}),  # float32 on a CPU
        ("bfloat16", {}),  # loaded and computed in bfloat16 (no autocast on a CPU)
        ("float32", {"enabled": False}),  # full fine-tuning: the optimizer state dwarfs the adapter's
    ],
    ids=["fp32-lora", "bf16-lora", "fp32-full"],
)
def test_smoke_peak_is_within_ten_percent_of_the_estimate(workspace, wide_llama, short_rows, dtype, lora):
    result = _smoke(workspace, f"acc-{dtype}", _config(wide_llama, short_rows, dtype, **lora))
    peak, est = result["peak_bytes"], result["estimate_bytes"]
    assert result["measured_by"] == "tracker" and est > 0
    assert abs(peak / est - 1) <= TOLERANCE, f"measured {peak} vs estimated {est}: {peak / est - 1:+.1%}"
    # a steady step: the optimizer state made at the end of the first step is counted at the peak too
    assert result["optimizer_state_bytes"] > 0 and peak > result["first_step_peak_bytes"]


@pytest.mark.slow
def test_bf16_model_on_cpu_is_estimated_in_bf16(workspace, wide_llama, short_rows):
    """The CPU trainer keeps a bfloat16 model in bfloat16: the smoke peak falls with it, and so must the plan."""
    fp32 = estimate_for_config(_config(wide_llama, short_rows, "auto"), 24.0, "cpu", batch_size=1)
    bf16 = estimate_for_config(_config(wide_llama, short_rows, "bfloat16"), 24.0, "cpu", batch_size=1)
    plan = bf16.plan
    assert (plan["load_dtype"], plan["compute_dtype"], plan["autocast"]) == ("bf16", "bf16", False)
    assert (
        bf16.tensor_peak_bytes < 0.8 * fp32.tensor_peak_bytes
    )  # measured ratio 0.764; fp32 planning gives ~1.0


@pytest.mark.slow
def test_train_page_shows_both_peaks_in_one_unit_and_close(workspace, wide_llama, short_rows):
    """The page path: its own estimate (no GPU here, so for the CPU) next to the measured peak, one unit."""
    from streamlit.testing.v1 import AppTest

    page = str(Path(__file__).resolve().parent.parent / "pages" / "train.py")
    at = AppTest.from_file(page, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = _config(wide_llama, short_rows, "bfloat16")
    at.run()
    at.button(key="tr_smoke").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    from core.runs.admin import latest_smoke, smoke_result  # the smoke test runs on its own: wait for it

    run = latest_smoke(workspace, at.text_input(key="tr_name").value)
    deadline = time.time() + 600
    while smoke_result(run) is None:
        assert time.time() < deadline, "the smoke test did not end"
        time.sleep(0.2)
    at.run()
    metrics = {m.label: m for m in at.metric}
    measured, estimated = metrics["Measured peak"].value, metrics["Estimated peak"].value
    assert measured.split()[1] == estimated.split()[1], (measured, estimated)  # e.g. "3.3 MiB" and "3.2 MiB"
    assert abs(float(measured.split()[0]) / float(estimated.split()[0]) - 1) <= TOLERANCE
    assert metrics["Estimated peak"].delta.endswith("vs estimate")
