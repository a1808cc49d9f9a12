"""The launcher with real subprocesses: create, launch, SIGTERM + resume, SIGKILL detection, refusals, listing."""

import json
import os
import signal
import time

import pytest

from core.procs import pid_alive
from core.recipe.config import validate_config
from core.rundir import read_metrics, read_status
from core.runs.launcher import (
    RunError,
    create_run,
    launch,
    list_runs,
    read_pid,
    run_state,
    stop_run,
    wait_for,
)
from core.workspace import WorkspaceError

WORDS = ["cat", "dog", "emu", "fox", "gnu", "hen", "ibis", "jay"]


def run_config(workspace, model_path, **training) -> dict:
    data = workspace / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {w}", "output": w}) + "\n" for w in WORDS * 8))
    t = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": 60,
        "logging_steps": 2,
        "save_steps": 1000,
        "learning_rate": 5e-3,
    }
    t.update(training)
    return {
        "model": {"path": str(model_path)},
        "data": {"path": str(data), "max_length": 48},
        "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
        "training": t,
    }


def wait_until(predicate, timeout=180.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_create_run_sanitises_and_refuses(workspace, tiny_llama):
    cfg = run_config(workspace, tiny_llama)
    run_dir = create_run(workspace, "demo-1", cfg)
    assert run_dir == (workspace / "runs" / "demo-1").resolve()
    assert validate_config(
        __import__("yaml").safe_load((run_dir / "config.yaml").read_text())
    ) == validate_config(cfg)
    assert not (run_dir / "plan.json").exists()  # the trainer writes it, for the device it trains on
    with pytest.raises(RunError, match="already exists"):
        create_run(workspace, "demo-1", cfg)
    for bad in ("../escape", "a/b", "", "has space"):
        with pytest.raises(WorkspaceError):
            create_run(workspace, bad, cfg)
    assert not (workspace.parent / "escape").exists()
    assert [r.name for r in list_runs(workspace)] == ["demo-1"] and list_runs(workspace)[0].state == "new"


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_continues(workspace, tiny_llama):
    run_dir = create_run(workspace, "stop-resume", run_config(workspace, tiny_llama))
    pid = launch(run_dir)
    assert read_pid(run_dir) == pid
    with pytest.raises(RunError, match="already running"):  # one process per run dir
        launch(run_dir)
    assert wait_until(lambda: any(m["step"] >= 6 for m in read_metrics(run_dir)))
    assert stop_run(run_dir, grace_s=120) == "stopped"
    status = read_status(run_dir)
    stopped_at = status["step"]
    assert 6 <= stopped_at < 60, status
    assert "SIGTERM" in status["reason"] and (run_dir / "checkpoints" / f"checkpoint-{stopped_at}").is_dir()
    assert not (run_dir / "adapter").exists()

    launch(run_dir, resume=True)
    info = wait_for(run_dir, timeout=300)
    assert info.state == "finished", (info.reason, (run_dir / "stderr.log").read_text()[-2000:])
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(2, 61, 2))  # every logging step exactly once, across both processes
    assert read_status(run_dir)["step"] == 60 and (run_dir / "adapter" / "adapter_config.json").exists()
    assert "(resume)" in (run_dir / "stderr.log").read_text()


@pytest.mark.slow
def test_sigkill_is_reported_as_failed_with_stderr_tail(workspace, tiny_llama):
    run_dir = create_run(workspace, "killed", run_config(workspace, tiny_llama, max_steps=5000))
    pid = launch(run_dir)
    assert wait_until(lambda: (read_status(run_dir) or {}).get("state") == "running")
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(pid), timeout=30)
    info = run_state(run_dir)
    assert info.state == "failed" and not info.alive
    last_line = (run_dir / "stderr.log").read_text().strip().splitlines()[-1]
    assert f"pid {pid}" in info.reason and last_line in info.reason
    assert info.reason.splitlines()[0].startswith("The training process")  # a sentence the pages show alone
    before = (run_dir / "status.json").read_bytes()
    assert [r.state for r in list_runs(workspace)] == ["failed"]  # derived on read by every reader ...
    assert read_status(run_dir)["state"] == "running"  # ... while the file keeps what the trainer wrote
    assert (run_dir / "status.json").read_bytes() == before  # reads never write
    launch(run_dir, resume=True)  # a dead pid does not block a relaunch
    stop_run(run_dir, grace_s=120)


@pytest.mark.slow
def test_smoke_launch_writes_smoke_json_and_finishes(workspace, tiny_llama):
    from core.runs.launcher import wait_for_smoke

    run_dir = create_run(workspace, "smoke-first", run_config(workspace, tiny_llama))
    launch(run_dir, smoke=True)
    result = wait_for_smoke(run_dir, timeout=300)
    assert result["state"] == "finished", result
    assert result["peak_bytes"] > 0 and result["seconds_per_step"] > 0
    assert run_state(run_dir).state == "finished" and not run_state(run_dir).alive


@pytest.fixture(autouse=True)
def _one_thread_per_trainer(monkeypatch):
    """Launched trainers inherit this: a tiny model on 2 shared cores runs fastest on one thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
