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

from core.files import atomic_write_text, read_json_object

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

LIVE_STATES = ("starting", "running")
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
    """All complete lines of metrics.jsonl (a half-written last line is skipped)."""
    out = []
    path = Path(run_dir) / METRICS
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError, RecursionError):
                rec = json.loads(line)
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
    try:
        return int((Path(run_dir) / PID).read_text().strip())
    except (OSError, ValueError):
        return None


def write_pid(run_dir: str | os.PathLike, pid: int) -> None:
    atomic_write_text(Path(run_dir) / PID, str(pid))
