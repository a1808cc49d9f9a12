"""The launcher: create run directories, start `python -m core.train` as a detached subprocess, list runs with
their live state, stop them. UI-free: the dashboard calls these functions, nothing here imports streamlit.

A run's truth is its directory: the lock and the pid file say which process trains it (core.procs owns spawning,
liveness, stopping and reaping), status.json what that process last reported. When the process is gone but the
status still says starting/running, it died without a word (SIGKILL, out of memory, a segfault): the run is
read as failed with the last lines of stderr.log (nothing is written on read). A live run that stopped stepping reads as stalled.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from core import liveness, logtail, procs, rundir, stopping
from core.recipe.config import ConfigError, dump_config, load_config, validate_config
from core.rundir import read_pid, read_smoke, read_status, write_status
from core.train.preflight import check_model_folder
from core.train.resume import check_resume
from core.workspace import (
    MAKE_WRITABLE,
    WorkspaceError,
    check_run_name,
    inside,
    make_folder,
    runs_dir,
    unwritable,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TAIL_LINES = 20


class RunError(RuntimeError):
    """A launcher problem the user can act on (the message says how)."""


@dataclass
class RunInfo:
    name: str
    path: Path
    state: str  # starting / running / finished / failed / stopped, or "new" before any launch
    reason: str | None
    step: int
    max_steps: int | None
    pid: int | None
    alive: bool
    updated: float | None
    stalled_s: float | None = None  # a live run that stopped stepping: seconds since its last step
    stall: str | None = None  # and why ("no step for 3 min (process stopped)")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["path"] = str(self.path)
        return d


# ---- creating ------------------------------------------------------------------------------------------------


def create_run(workspace: str | os.PathLike, name: str, config: dict) -> Path:
    """Make runs/<name>/ with the validated config in it (the trainer writes plan.json, for the device it trains
    on). Refuses an existing name. Everything is checked before the folder is made: a config that cannot train
    (a bad key, a model folder that is not one) leaves nothing behind."""
    name = check_run_name(name)
    run_dir = inside(workspace, runs_dir(workspace) / name)
    cfg = validate_config(config)
    problem = check_model_folder(cfg["model"]["path"])
    if problem:
        raise RunError(problem)
    if run_dir.exists():
        raise RunError(f"A run named {name!r} already exists in {run_dir.parent}: choose another name.")
    make_folder(run_dir.parent, "runs folder")
    try:
        run_dir.mkdir()
    except FileExistsError:  # made since the check above
        raise RunError(
            f"A run named {name!r} already exists in {run_dir.parent}: choose another name."
        ) from None
    except OSError as exc:
        raise RunError(
            f"Cannot create the run {name}: {unwritable(run_dir.parent, exc)}; {MAKE_WRITABLE}, or choose a "
            "workspace you can write to (the sidebar, or $LORA_COCKPIT_WORKSPACE)."
        ) from None
    try:
        dump_config(cfg, run_dir / rundir.CONFIG)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)  # the folder made just above: a run without config is none
        raise RunError(
            f"Cannot create the run {name}: {unwritable(run_dir, exc)}; {MAKE_WRITABLE}."
        ) from None
    return run_dir


# ---- launching ------------------------------------------------------------------------------------------------


def launch(run_dir: str | os.PathLike, resume: bool = False, smoke: bool = False) -> int:
    """Start the trainer for `run_dir` in its own session (process group); returns the pid.

    Atomic: the launcher takes the run's lock first and hands it to the trainer, so of two launches at the same
    instant exactly one starts a trainer and the other gets RunError. stdout/stderr go to files in the run dir,
    never to pipes (a full pipe would block training when nobody reads it).
    """
    run_dir = Path(run_dir).resolve()
    config = run_dir / rundir.CONFIG
    if not config.is_file():
        raise RunError(f"{run_dir} has no config.yaml: create the run with create_run() first.")
    ended = (read_status(run_dir) or {}).get(
        "state"
    ) in rundir.END_STATES  # its last owner may still be exiting
    remote = rundir.busy_elsewhere(run_dir)
    if remote:
        raise RunError(remote)
    try:
        lock_fd = procs.claim(run_dir, wait_s=15.0 if ended else 1.0)
    except procs.Busy as exc:
        raise RunError(
            f"Run {run_dir.name} is already running (pid {exc.pid or read_pid(run_dir)}): stop it before "
            "launching again."
        ) from None
    except OSError as exc:  # its lock file cannot be made: a read-only or full workspace
        raise RunError(_cannot_start(run_dir, resume, exc)) from None
    try:
        status = read_status(run_dir)
        if status and status.get("state") == "finished" and not smoke:
            raise RunError(f"Run {run_dir.name} has finished: create a new run to train again.")
        if not smoke:
            try:
                rundir.check_run_dir(run_dir, resume, Path(config))
                if resume:  # the trainer checks the same; refused here, nothing is started or written
                    check_resume(run_dir, load_config(config), config)
            except (rundir.RunRefused, ConfigError) as exc:
                raise RunError(str(exc).replace("--resume", "Resume").replace("--run-dir", "run")) from None
        cmd = [sys.executable, "-m", "core.train", str(config), "--run-dir", str(run_dir)]
        if resume:
            cmd.append("--resume")
        if smoke:
            # Smoke tests belong in their own folder (core.runs.admin keeps them apart): they write status too.
            cmd.append("--smoke")
            (run_dir / rundir.SMOKE).unlink(missing_ok=True)  # so a reader waits for this test's result
        try:
            write_status(
                run_dir,
                state="starting",
                reason=None,
                ended=None,
                phase="importing the libraries",  # the trainer names its next phases itself
                phase_started=time.time(),
                # a resume: this attempt's start and the earlier ones' time (the run's time leaves out the stop)
                **(
                    rundir.resume_times(status)
                    if resume and status
                    else {"started": time.time(), "step": 0, "max_steps": None, **rundir.FIRST_ATTEMPT}
                ),
            )
        except OSError as exc:
            raise RunError(_cannot_start(run_dir, resume, exc)) from None
        try:
            # own session: survives the UI server; the trainer keeps the lock this launcher took
            return procs.spawn(run_dir, cmd, lock_fd, cwd=REPO_ROOT)
        except OSError as exc:
            write_status(run_dir, state="failed", reason=f"could not start {sys.executable}: {exc}")
            raise RunError(f"Could not start the trainer ({exc}).") from None
    finally:
        os.close(lock_fd)  # the child holds the lock through its own copy of the descriptor


def _cannot_start(run_dir: Path, resume: bool, exc: OSError) -> str:
    again = "resume" if resume else "launch"
    return (
        f"Cannot {again} run {run_dir.name}: {unwritable(run_dir, exc)}; {MAKE_WRITABLE} and {again} again."
    )


def stop_run(run_dir: str | os.PathLike, grace_s: float = 60.0) -> str:
    """SIGTERM the trainer (it checkpoints and exits; never the process group of whoever started it), wait until
    it is gone, then SIGKILL it and its children if it is not (core.stopping.stop). Returns the state once the
    process has exited."""
    run_dir = Path(run_dir)
    remote = rundir.busy_elsewhere(run_dir)
    if remote:
        raise RunError(remote)
    outcome = stopping.stop(run_dir, grace_s)
    if outcome == "killed":
        write_status(
            run_dir, state="stopped", reason=f"killed after {grace_s:.0f} s without stopping by itself"
        )
    elif outcome == "exited" and (read_status(run_dir) or {}).get("state") in ("starting", "running"):
        write_status(run_dir, state="stopped", reason="stopped before training began")  # before its handler
    return run_state(run_dir).state


# ---- listing --------------------------------------------------------------------------------------------------


def run_state(run_dir: str | os.PathLike) -> RunInfo:
    """The run's state from its files and its lock; a live-looking status whose process is gone reads as failed
    with the tail of stderr.log (liveness.read_live_status). Writes nothing: listing runs works on a full disk or a
    read-only workspace."""
    run_dir = Path(run_dir)
    status, state, alive = liveness.read_live_status(run_dir)
    # a scan for an owner whose pid file is gone only for a live run (listing many ended runs stays cheap)
    pid = read_pid(run_dir) if alive else (procs.read_pid_info(run_dir) or {}).get("pid")
    stalled_s, stall = rundir.stall(run_dir, status, state, alive)
    status = status or {}
    step = status.get("step")
    return RunInfo(
        name=run_dir.name,
        path=run_dir,
        state=state,
        reason=status.get("reason") if isinstance(status.get("reason"), str) else None,
        step=step if isinstance(step, int) else 0,
        max_steps=status.get("max_steps") if isinstance(status.get("max_steps"), int) else None,
        pid=pid,
        alive=alive,
        updated=status.get("updated") if isinstance(status.get("updated"), (int, float)) else None,
        stalled_s=stalled_s,
        stall=stall,
    )


def list_runs(workspace: str | os.PathLike) -> list[RunInfo]:
    """Every run under <workspace>/runs, newest first."""
    return [run_state(d) for d in rundir.run_folders(workspace)]


def live_runs(workspace: str | os.PathLike) -> list[RunInfo]:
    """The runs of the workspace whose process lives on this machine (what a run started now trains beside: its
    GPU memory, or its CPU cores); a run trained from another machine on shared storage is not one of them."""
    return [r for r in list_runs(workspace) if r.alive and not procs.elsewhere(procs.read_pid_info(r.path))]


def wait_for(
    run_dir: str | os.PathLike, states=("finished", "failed", "stopped"), timeout: float = 300.0
) -> RunInfo:
    """Poll until the run reaches one of `states` (for CLIs and tests; the UI polls by itself)."""
    deadline = time.time() + timeout
    while True:
        info = run_state(run_dir)
        if info.state in states or time.time() > deadline:
            return info
        time.sleep(0.2)


def wait_for_smoke(run_dir: str | os.PathLike, timeout: float = 600.0) -> dict | None:
    """Poll for smoke.json; None on timeout. A smoke process that died silently gives a failed result."""

    run_dir = Path(run_dir)
    deadline = time.time() + timeout
    while time.time() < deadline:
        result = read_smoke(run_dir)
        if result is not None:
            stopping.wait_gone(
                run_dir, 30.0
            )  # it exits right after writing: a launch that follows is not refused
            return result
        if not procs.alive(run_dir):
            result = read_smoke(run_dir)  # it may have written just before exiting
            return result or {
                "state": "failed",
                "reason": "smoke test ended without a result; stderr.log:\n"
                + logtail.tail_text(run_dir / rundir.STDERR, TAIL_LINES),
            }
        time.sleep(0.2)
    return None


__all__ = [
    "RunError",
    "RunInfo",
    "WorkspaceError",
    "create_run",
    "launch",
    "list_runs",
    "live_runs",
    "run_state",
    "stop_run",
    "wait_for",
    "wait_for_smoke",
]
