"""The whole loop through the pages' own code: Launch on the Train page starts a real trainer subprocess, metrics
arrive in the run directory, Stop on the Monitor page stops it gracefully, and a checkpoint is left behind."""

import json
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.recipe.config import default_config
from core.runs.launcher import stop_run
from ui.fields import HANDOVER

APP = str(Path(__file__).resolve().parent.parent / "dashboard.py")


def _metrics(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow  # a real training subprocess: ~30 s on 2 cores
def test_launch_from_train_page_then_stop_from_monitor(workspace, tiny_llama, tmp_path, request):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"instruction": f"count {i}", "output": f"{i}"}) + "\n" for i in range(200))
    )
    config = {
        "model": {"path": str(tiny_llama)},
        "data": {"path": str(data), "max_length": 48},
        "training": {
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "max_steps": 100000,  # far more than the test waits for: it must be stopped midway
            "logging_steps": 1,
            "save_steps": 1000,
        },
    }
    # As a user would: a plan made on the Estimate page for this model, "Use this plan", the Train page prefilled.
    handed = default_config()
    handed["model"].update(path=str(tiny_llama), dtype="float32")
    handed["training"].update(per_device_train_batch_size=2, max_length=48)
    at = AppTest.from_file(APP, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = config
    at.session_state[HANDOVER] = handed  # what the Estimate page's "Use this plan" button hands over
    at.run()
    at.switch_page("pages/train.py").run()
    assert not at.exception, at.exception
    assert at.number_input(key="tr_batch").value == 2 and at.number_input(key="tr_max_length").value == 48
    launch = at.button(key="tr_launch")
    assert not launch.disabled, [e.value for e in at.error]
    launch.click().run()
    assert not at.exception, at.exception
    run_dir = Path(at.session_state["monitor_run"])
    request.addfinalizer(lambda: stop_run(run_dir, grace_s=10))  # never leave a trainer behind on failure
    assert run_dir.parent == workspace / "runs" and (run_dir / "pid").is_file()
    assert at.title[0].value == "Monitor"  # switch_page landed on the Monitor with this run selected

    deadline = time.time() + 120
    while time.time() < deadline and len(_metrics(run_dir)) < 3:
        time.sleep(0.5)
    steps = [m["step"] for m in _metrics(run_dir) if "loss" in m]
    assert len(steps) >= 3, (run_dir / "stderr.log").read_text()[-2000:]

    at.switch_page("pages/monitor.py").run()  # the Monitor as it is now: live run, Stop enabled
    stop = at.button(key="mon_stop")
    assert not stop.disabled
    stop.click().run()
    assert not at.exception, at.exception
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped", status
    assert status["step"] < 100000
    checkpoints = sorted((run_dir / "checkpoints").glob("checkpoint-*"))
    assert checkpoints, list(run_dir.rglob("*"))
    assert (checkpoints[-1] / "adapter_model.safetensors").is_file() or any(checkpoints[-1].iterdir())
    assert any(f"Run {run_dir.name} is stopped" in s.value for s in at.success)
    # at once, without a reload (issue #21 item 15): Resume in place of Stop, the selector no longer says live
    assert at.button(key="mon_resume") is not None and not at.button(key="mon_resume").disabled
    selector = at.selectbox(key="mon_run")
    assert selector.options[selector.index].endswith("· stopped"), selector.options
    at.button(key="mon_resume").click().run()
    assert not at.exception, at.exception
    assert any(f"Run {run_dir.name} resumes from checkpoint-" in s.value for s in at.success)
    assert at.metric[0].value in ("starting", "running"), at.metric[0].value  # not the stopped run's state
    request.addfinalizer(lambda: stop_run(run_dir, grace_s=10))
