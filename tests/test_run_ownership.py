"""Every run owned by its own process (issue #11): whatever started the trainer, the run is findable, stoppable
and seen dead at once; two launches train once; a rerun without --resume touches nothing. Real subprocesses."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from test_runs import run_config, wait_until

from core import checkpoints, procs, rundir
from core.recipe.config import validate_config
from core.runs.launcher import RunError, create_run, launch, run_state, stop_run
from tests.cli import runs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _runs_cli(workspace, *args, timeout=240):
    return runs(workspace, *args, timeout=timeout)


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _start_cli_trainer(workspace, tiny_llama, name, **training):
    """A trainer started from a terminal, as docs/cli.md shows: no launcher; it records its own pid."""
    cfg_path = workspace / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(validate_config(run_config(workspace, tiny_llama, **training))))
    run_dir = workspace / "runs" / name
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.train", str(cfg_path), "--run-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert wait_until(lambda: (run_state(run_dir).state == "running") if run_dir.is_dir() else False, 180), (
        proc.stderr.read().decode() if proc.poll() is not None else "never ran"
    )
    return proc, run_dir


def test_cli_started_run_is_listed_stopped_and_seen_dead(workspace, tiny_llama):
    proc, run_dir = _start_cli_trainer(workspace, tiny_llama, "from-terminal", max_steps=2000)
    listed = json.loads(_runs_cli(workspace, "list", "--json").stdout)
    assert [(r["name"], r["state"], r["pid"]) for r in listed] == [("from-terminal", "running", proc.pid)]
    assert set(listed[0]) >= {"name", "method", "state", "pid", "step", "loss", "malformed", "reason"}
    assert listed[0]["method"] == "sft"
    out = _runs_cli(workspace, "stop", "from-terminal")
    assert out.returncode == 0 and out.stdout.strip() == "from-terminal: stopped", out.stderr
    assert proc.poll() is not None  # `stop` returns once the process has exited
    assert checkpoints.latest_checkpoint(run_dir) is not None
    shown = json.loads(_runs_cli(workspace, "show", "from-terminal", "--json").stdout)
    assert shown["state"] == "stopped" and "stopped by SIGTERM" in shown["reason"]


def test_a_trainer_whose_lock_and_pid_files_were_deleted_keeps_its_run(workspace, tiny_llama):
    """Both records deleted under a training run: no second trainer gets in, delete refuses, the listing shows it
    running with its pid, and stop still reaches it (found by the --run-dir of its command line)."""
    proc, run_dir = _start_cli_trainer(workspace, tiny_llama, "bare", max_steps=2000, save_steps=20)
    assert wait_until(lambda: checkpoints.latest_checkpoint(run_dir) is not None, 300)  # resumable
    (run_dir / rundir.LOCK).unlink()
    (run_dir / rundir.PID).unlink()
    resumed = _runs_cli(workspace, "resume", "bare")
    assert resumed.returncode == 2 and "already running" in resumed.stderr, resumed.stdout + resumed.stderr
    deleted = _runs_cli(workspace, "delete", "bare")
    assert deleted.returncode == 2 and run_dir.is_dir(), deleted.stdout + deleted.stderr
    # hung, not dead (#38): the listing names the stall of the owner it found by its command line
    os.kill(proc.pid, signal.SIGSTOP)
    assert wait_until(lambda: procs.is_stopped(proc.pid), 30)
    listed = json.loads(_runs_cli(workspace, "list", "--json").stdout)
    assert [(r["name"], r["state"], r["pid"]) for r in listed] == [("bare", "running", proc.pid)]
    assert (listed[0]["stall"] or "").endswith("(process stopped)"), listed
    out = _runs_cli(workspace, "stop", "bare")  # continued, the stopped trainer checkpoints and exits
    assert out.returncode == 0 and out.stdout.strip() == "bare: stopped", out.stdout + out.stderr
    assert proc.poll() is not None


def test_a_folder_of_the_users_own_files_is_not_a_run_dir(workspace, tiny_llama):
    """core.train into an existing folder that is no run but holds a config.yaml (not the one trained): refused,
    its files untouched."""
    folder = workspace / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("my_own_config: important\n")
    (folder / "plan.json").write_text("user plan\n")
    cfg_path = workspace / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(validate_config(run_config(workspace, tiny_llama, max_steps=2))))
    before = _tree_digest(folder)
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(cfg_path), "--run-dir", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 2 and "already holds a config.yaml of its own" in out.stderr, out.stderr[-2000:]
    assert _tree_digest(folder) == before


def test_sigkill_is_seen_at_once_and_delete_then_works(workspace, tiny_llama):
    proc, run_dir = _start_cli_trainer(workspace, tiny_llama, "killed", max_steps=2000)
    from core.monitor.watch import RunWatcher

    watcher = RunWatcher(run_dir)  # the Monitor's reader, attached while the run is live
    assert watcher.refresh().state == "running"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert watcher.refresh().state == "failed"  # its very next tick (the page refreshes every 2 s)
    info = run_state(run_dir)  # the very next look, no grace period
    assert (info.state, info.alive) == ("failed", False)
    assert "ended without reporting" in info.reason
    assert _runs_cli(workspace, "delete", "killed").returncode == 0 and not run_dir.exists()


def test_two_racing_launches_start_one_trainer(workspace, tiny_llama):
    run_dir = create_run(workspace, "race", run_config(workspace, tiny_llama, max_steps=2000))
    results, barrier = [], threading.Barrier(2)

    def go():
        barrier.wait()
        try:
            results.append(launch(run_dir))
        except RunError as exc:
            results.append(exc)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pids = [r for r in results if isinstance(r, int)]
    errors = [r for r in results if isinstance(r, RunError)]
    assert len(pids) == 1 and len(errors) == 1 and "already running" in str(errors[0])
    assert wait_until(lambda: run_state(run_dir).state == "running")
    assert stop_run(run_dir, grace_s=120) == "stopped"


def _trainer(cfg_path: Path, run_dir: Path, *wrapper: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*wrapper, sys.executable, "-m", "core.train", str(cfg_path), "--run-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_trainer_under_a_wrapper_trains(workspace, tiny_llama):
    """#42: `timeout 300 python -m core.train …` exited 2 naming `timeout` (which names the run folder) as the
    run's owner; so did `/usr/bin/time -v` and any wrapper that forks."""
    cfg_path = workspace / "wrapped.yaml"
    cfg_path.write_text(yaml.safe_dump(validate_config(run_config(workspace, tiny_llama, max_steps=4))))
    run_dir = workspace / "runs" / "wrapped"
    proc = _trainer(cfg_path, run_dir, "timeout", "300")
    out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err
    assert run_state(run_dir).state == "finished" and rundir.read_status(run_dir)["step"] == 4


def test_two_trainers_started_at_once_train_once(workspace, tiny_llama):
    """#42: two `core.train … --run-dir D` started together could both refuse, each naming the other, leaving a
    folder with only its lock. Exactly one trains; the other refuses naming the winner's pid."""
    cfg_path = workspace / "twice.yaml"
    cfg_path.write_text(yaml.safe_dump(validate_config(run_config(workspace, tiny_llama, max_steps=2000))))
    run_dir = workspace / "runs" / "twice"
    pair = [_trainer(cfg_path, run_dir) for _ in range(2)]
    try:
        loser = next(p for p in _first_to_end(pair, 240))
        winner = next(p for p in pair if p is not loser)
        err = loser.stderr.read()
        assert loser.returncode == 2 and f"(pid {winner.pid})" in err and "Traceback" not in err, err
        assert wait_until(lambda: run_state(run_dir).state == "running", 180)
        assert run_state(run_dir).pid == winner.pid
        assert _runs_cli(workspace, "stop", "twice").returncode == 0
    finally:
        for p in pair:
            p.kill()
            p.wait()


def _first_to_end(procs_, timeout):
    assert wait_until(lambda: any(p.poll() is not None for p in procs_), timeout), "neither refused"
    return (p for p in procs_ if p.poll() is not None)


def test_stop_then_immediate_resume(workspace, tiny_llama):
    run_dir = create_run(workspace, "again", run_config(workspace, tiny_llama, max_steps=2000, save_steps=5))
    launch(run_dir)
    assert wait_until(lambda: run_state(run_dir).step >= 3)
    assert stop_run(run_dir, grace_s=120) == "stopped"
    launch(run_dir, resume=True)  # no "already running" window after a stop
    assert wait_until(lambda: run_state(run_dir).state == "running")
    out = _runs_cli(workspace, "stop", "again")
    assert out.returncode == 0, out.stderr


def test_rerun_without_resume_is_refused_and_touches_nothing(workspace, tiny_llama):
    cfg = run_config(workspace, tiny_llama, max_steps=4, save_steps=2)
    run_dir = create_run(workspace, "done", cfg)
    launch(run_dir)
    # finished is written before the trainer lets go of the folder: until it exits it is "being trained"
    assert wait_until(lambda: run_state(run_dir).state == "finished" and not run_state(run_dir).alive)
    before = _tree_digest(run_dir)
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "already holds a run" in out.stderr and "Traceback" not in out.stderr
    assert _tree_digest(run_dir) == before
    a_file = workspace / "a-file"
    a_file.write_text("x")
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(run_dir / "config.yaml"), "--run-dir", str(a_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "is a file" in out.stderr and a_file.read_text() == "x"


def test_runs_cli_bad_input_is_one_line(workspace):
    out = _runs_cli(workspace, "show", "nope")
    assert out.returncode == 2 and out.stderr.startswith("error: No run named 'nope'")
    assert len(out.stderr.strip().splitlines()) == 1
    (workspace / "bad.yaml").write_text("training: {learning_rat: 1}\n")
    out = _runs_cli(workspace, "launch", str(workspace / "bad.yaml"), "--name", "x")
    assert out.returncode == 2 and "Did you mean training.learning_rate?" in out.stderr
