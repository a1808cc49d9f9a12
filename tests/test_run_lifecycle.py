"""Issue #21 items 1, 2 and 6 with real trainers started as users start them (a terminal pipeline, the launcher):
stop reaches the trainer and its own children only, a deleted lock file lets no second trainer in, a frozen
trainer reads as stalled. Real subprocesses, real files; timeouts are generous, nothing is timed."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_runs import run_config, wait_until

from core import checkpoints, rundir
from core.recipe.config import validate_config
from core.runs.launcher import create_run, launch, run_state, stop_run
from tests.cli import runs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread_per_trainer(monkeypatch, workspace):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    import psutil  # a failed test leaves no trainer behind: every process working in this workspace ends

    for proc in psutil.process_iter(["cmdline"]):
        if any(str(workspace) in part for part in proc.info["cmdline"] or ()):
            proc.kill()


def _runs_cli(workspace, *args, timeout=300):
    return runs(workspace, *args, timeout=timeout)


def _write_config(workspace, tiny_llama, name, **training) -> Path:
    cfg_path = workspace / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(validate_config(run_config(workspace, tiny_llama, **training))))
    return cfg_path


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_stop_reaches_the_trainer_not_the_pipeline_that_started_it(workspace, tiny_llama):
    """#21 item 1: `python -m core.train … | tee log; echo next` in a shell job shares the shell's process group;
    `core.runs stop` must leave tee and the shell alone, so the trainer writes its stop checkpoint."""
    cfg = _write_config(workspace, tiny_llama, "piped", max_steps=5000, save_steps=1000)
    run_dir, log, marker = workspace / "runs" / "piped", workspace / "piped.log", workspace / "marker"
    script = (
        f"{sys.executable} -m core.train {cfg} --run-dir {run_dir} 2>&1 | tee {log}; echo next > {marker}"
    )
    shell = subprocess.Popen(
        ["setsid", "bash", "-c", script], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        assert wait_until(lambda: run_dir.is_dir() and run_state(run_dir).step >= 3, 240), _lines(log)[-20:]
        out = _runs_cli(workspace, "stop", "piped")
        assert out.returncode == 0 and out.stdout.strip() == "piped: stopped", (out.stdout, out.stderr)
        shell.wait(timeout=120)  # the shell went on to its next command: it was not killed
        assert marker.read_text().strip() == "next"
        status = rundir.read_status(run_dir)
        assert status["state"] == "stopped" and "SIGTERM" in status["reason"], status
        step = status["step"]
        assert checkpoints.latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"checkpoint-{step}"
        # tee was alive to pass on the trainer's last words (a killed tee would have broken its pipe)
        assert f"run stopped at step {step}" in log.read_text()
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(timeout=30)


def test_a_deleted_lock_file_lets_no_second_trainer_in_and_stop_still_works(workspace, tiny_llama):
    """#21 item 2: people delete "stale" lock files; the recorded pid + start time still say who trains."""
    run_dir = create_run(workspace, "locked", run_config(workspace, tiny_llama, max_steps=5000, save_steps=4))
    pid = launch(run_dir)
    assert wait_until(
        lambda: checkpoints.latest_checkpoint(run_dir) is not None and run_state(run_dir).step >= 6, 240
    )
    (run_dir / rundir.LOCK).unlink()
    info = run_state(run_dir)
    assert (info.state, info.alive, info.pid) == ("running", True, pid)

    before = (run_dir / rundir.METRICS).read_text()
    out = _runs_cli(workspace, "resume", "locked")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and f"already running (pid {pid})" in out.stderr
    # nor from a terminal, straight into the folder
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "core.train",
            str(run_dir / "config.yaml"),
            "--run-dir",
            str(run_dir),
            "--resume",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and f"pid {pid}" in out.stderr and "Traceback" not in out.stderr, out.stderr
    after = (run_dir / rundir.METRICS).read_text()
    assert after.startswith(before)  # not truncated back to a checkpoint: the first trainer keeps writing
    assert rundir.read_pid(run_dir) == pid

    out = _runs_cli(workspace, "stop", "locked")
    assert out.returncode == 0 and out.stdout.strip() == "locked: stopped", (out.stdout, out.stderr)
    assert not run_state(run_dir).alive
    status = rundir.read_status(run_dir)
    assert status["state"] == "stopped" and "SIGTERM" in status["reason"]


def test_a_frozen_trainer_reads_as_stalled_and_stop_still_ends_it(workspace, tiny_llama):
    """#21 item 6: a SIGSTOPped trainer is still "running", but list/show say it is stalled and why."""
    run_dir = create_run(workspace, "frozen", run_config(workspace, tiny_llama, max_steps=5000))
    pid = launch(run_dir)
    assert wait_until(lambda: run_state(run_dir).step >= 3, 240)
    assert run_state(run_dir).stalled_s is None
    os.kill(pid, signal.SIGSTOP)
    try:
        listed = json.loads(_runs_cli(workspace, "list", "--json").stdout)[0]
        assert (listed["state"], listed["alive"]) == ("running", True)
        assert listed["stalled_s"] is not None and "(process stopped)" in listed["stall"], listed
        assert listed["stall"].startswith("no step for ")
        text = _runs_cli(workspace, "show", "frozen").stdout
        assert "running" in text and "stalled" in text and "process stopped" in text, text
    finally:
        os.kill(pid, signal.SIGCONT)
    listed = json.loads(_runs_cli(workspace, "list", "--json").stdout)[0]
    assert (listed["state"], listed["stalled_s"], listed["stall"]) == ("running", None, None), listed
    assert "stalled" not in _runs_cli(workspace, "list").stdout

    os.kill(pid, signal.SIGSTOP)  # a stop reaches a stopped trainer too: it is woken to handle the SIGTERM
    assert stop_run(run_dir, grace_s=120) == "stopped"
    assert "SIGTERM" in rundir.read_status(run_dir)["reason"]
