"""The run directory: the only channel between a training process and everything that watches it.

This module owns its file names and the reading and writing of its state files; the trainer, the launcher, the
watcher and the diagnosis all go through it. UI-free and light (no torch import).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from core.files import atomic_write_text, loads_json, read_json_object

CONFIG = "config.yaml"  # the validated run config
PLAN = "plan.json"  # the planner's estimate for this config
STATUS = "status.json"  # state + reason, written by the trainer
METRICS = "metrics.jsonl"  # one line per logging step
GPU = "gpu.jsonl"  # NVML samples
SMOKE = "smoke.json"  # the smoke test's measured peak
PID = "pid"  # the training process
STDOUT, STDERR = "stdout.log", "stderr.log"
CHECKPOINTS = "checkpoints"
ADAPTER, MODEL = "adapter", "model"  # the final weights: a LoRA adapter, or a full fine-tune

LIVE_STATES = ("starting", "running", "stopping")
END_STATES = ("finished", "failed", "stopped")


def read_status(run_dir: str | os.PathLike) -> dict | None:
    return read_json_object(Path(run_dir) / STATUS)


def write_status(run_dir: str | os.PathLike, **fields) -> dict:
    """Merge `fields` into status.json and write it atomically (readers never see half a file)."""
    status = read_status(run_dir) or {
        "state": "starting",
        "reason": None,
        "step": 0,
        "max_steps": None,
        "started": time.time(),
        "ended": None,
    }
    status.update(fields)
    status["updated"] = time.time()
    if status["state"] in END_STATES and not status.get("ended"):
        status["ended"] = status["updated"]
    atomic_write_text(Path(run_dir) / STATUS, json.dumps(status))
    return status


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All complete lines of metrics.jsonl (a half-written last line, or one with a number beyond float range, is
    skipped)."""
    out = []
    path = Path(run_dir) / METRICS
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError, RecursionError):
                rec = loads_json(line)
                if isinstance(rec, dict):
                    out.append(rec)
    return out


def truncate_metrics(run_dir: str | os.PathLike, last_step: int) -> None:
    """Drop lines logged after `last_step` (a run killed after its last checkpoint), so a resumed run's file
    stays continuous: every step appears once, in order."""
    path = Path(run_dir) / METRICS
    if path.exists():
        keep = [json.dumps(m) + "\n" for m in read_metrics(run_dir) if _step(m) <= last_step]
        atomic_write_text(path, "".join(keep))


def _step(rec: dict) -> float:
    step = rec.get("step", 0)
    return step if isinstance(step, (int, float)) else 0


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = Path(run_dir) / CHECKPOINTS
    if not ckpts.is_dir():
        return None
    found = [p for p in ckpts.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    # A checkpoint without trainer_state.json was cut off while saving: not resumable.
    found = [p for p in found if (p / "trainer_state.json").exists()]
    return max(found, key=lambda p: int(p.name.split("-")[-1])) if found else None


def read_smoke(run_dir: str | os.PathLike) -> dict | None:
    """smoke.json: {"state": finished|failed, "reason", "peak_bytes", "seconds_per_step", ...} or None."""
    return read_json_object(Path(run_dir) / SMOKE)


def write_smoke(run_dir: str | os.PathLike, result: dict) -> None:
    atomic_write_text(Path(run_dir) / SMOKE, json.dumps(result))


def read_plan(run_dir: str | os.PathLike) -> dict | None:
    return read_json_object(Path(run_dir) / PLAN)


def write_plan(run_dir: str | os.PathLike, plan: dict) -> None:
    atomic_write_text(Path(run_dir) / PLAN, json.dumps(plan, default=str))


def read_pid(run_dir: str | os.PathLike) -> int | None:
    info = read_pid_info(run_dir)
    return info["pid"] if info else None


# ---- liveness: owned by the training process ------------------------------------------------------------------
#
# The trainer holds an exclusive flock on <run>/lock for its whole life, whoever started it (the app, the launcher
# or a terminal). "Running" means the lock is held: the kernel drops it the instant the process dies (SIGKILL,
# OOM killer, segfault), so a dead run is seen dead at once, a reused pid means nothing, and a second trainer on
# the same folder cannot start. The pid file records pid and process start time only to find and signal it.

LOCK = "lock"
LOCK_FD_ENV = "LORA_COCKPIT_LOCK_FD"  # a launcher that took the lock hands it to the trainer it starts


class RunBusy(RuntimeError):
    """Another process trains this run directory."""


class RunRefused(RuntimeError):
    """The run directory cannot be used as asked; nothing in it was touched."""


# What a run leaves behind once it has trained: training into such a folder again needs --resume.
TRAINED_MARKS = (METRICS, CHECKPOINTS, ADAPTER, MODEL)


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse (touching nothing) a run directory that is a file, or one that already trained without --resume:
    a second run into it would truncate its metrics and mix old and new checkpoints."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunRefused(f"--run-dir {run_dir} is a file, not a folder: give a new folder for the run.")
    if resume or not run_dir.is_dir():
        return
    status = read_status(run_dir) or {}
    if status.get("state") in (*END_STATES, "running") or any(
        (run_dir / name).exists() for name in TRAINED_MARKS
    ):
        raise RunRefused(
            f"{run_dir} already holds a run ({status.get('state') or 'it has metrics or checkpoints'}): "
            "continue it with --resume, or give a new --run-dir."
        )


def _try_flock(fd: int) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def claim(run_dir: str | os.PathLike, wait_s: float = 1.0) -> int:
    """Take the run's lock (an open fd that holds it; keep it open for the process's life) or raise RunBusy.

    Retries for `wait_s`: a watcher testing the lock holds it for microseconds."""
    path = Path(run_dir) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    while not _try_flock(fd):
        if time.monotonic() > deadline:
            os.close(fd)
            info = read_pid_info(run_dir)
            who = f" (pid {info['pid']})" if info else ""
            raise RunBusy(f"Run {Path(run_dir).name} is already being trained by another process{who}.")
        time.sleep(0.02)
    return fd


def adopt_claim() -> int | None:
    """The lock fd a launcher handed down (LORA_COCKPIT_LOCK_FD), still locked by the same open file."""
    value = os.environ.pop(LOCK_FD_ENV, None)
    if not value or not value.isdigit():
        return None
    fd = int(value)
    try:
        os.fstat(fd)
    except OSError:
        return None
    os.set_inheritable(fd, False)  # data loader workers and other children must not keep the run "alive"
    return fd


def is_live(run_dir: str | os.PathLike) -> bool:
    """True while a process holds the run's lock (a trainer is alive in this folder)."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return not _try_flock(fd)  # got it: nobody holds it (closing the fd below releases it at once)
    finally:
        os.close(fd)


def process_start_time(pid: int) -> float | None:
    """The process's start time; None when it is gone or a zombie (exited, not yet reaped)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except Exception:
        return None


def write_pid_info(run_dir: str | os.PathLike, pid: int | None = None) -> None:
    """pid + process start time: with them a stop signals this process, never a later one that reused the pid."""
    pid = pid or os.getpid()
    atomic_write_text(Path(run_dir) / PID, json.dumps({"pid": pid, "start_time": process_start_time(pid)}))


def read_pid_info(run_dir: str | os.PathLike) -> dict | None:
    """{"pid", "start_time"} (an old plain-number pid file gives start_time None)."""
    try:
        text = (Path(run_dir) / PID).read_text().strip()
    except OSError:
        return None
    if text.isdigit():
        return {"pid": int(text), "start_time": None}
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict) and isinstance(data.get("pid"), int):
        return data
    return None


def same_process(info: dict | None) -> bool:
    """The recorded process still exists and is the same one (its start time matches)."""
    if not info:
        return False
    started = process_start_time(info["pid"])
    if started is None:
        return False
    return info.get("start_time") is None or abs(started - info["start_time"]) < 1.0


def live_state(run_dir: str | os.PathLike, status: dict | None = None) -> tuple[str, bool]:
    """(state, alive) from the status file and the lock. A live-looking status without a lock holder is a
    process that died without a word ("failed"); an ended status while the lock is still held is a process
    that is winding down ("stopping"), so nothing is relaunched under it."""
    status = read_status(run_dir) if status is None else status
    info = read_pid_info(run_dir)
    if (Path(run_dir) / LOCK).exists():
        alive = is_live(run_dir)
        if alive and info and not same_process(info):
            # the process is gone (or a zombie) while the kernel is still tearing down its other threads and
            # files: the lock goes within moments
            deadline = time.monotonic() + 1.0
            while alive and time.monotonic() < deadline:
                time.sleep(0.02)
                alive = is_live(run_dir)
    elif info:  # a run directory from before the lock: its pid file is all there is
        alive = same_process(info)
    else:  # no trace of a process at all (a folder written by hand or by a test): the status says it all
        state = (status or {}).get("state") or "new"
        return state, state in LIVE_STATES
    state = (status or {}).get("state") or ("starting" if alive else "new")
    if state in ("starting", "running") and not alive and (status or {}).get("state"):
        return "failed", False
    if state in END_STATES and alive:
        return "stopping", True
    return state, alive
