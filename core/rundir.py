"""The run directory: the only channel between a training process and everything that watches it.

This module owns its file names and the reading and writing of its state files, and the owner's side of a run:
checking and claiming its folder, and telling a live run that stopped stepping (stall). The trainer, the launcher,
the watcher and the diagnosis all go through it. A run's checkpoints are core.checkpoints', the space set aside for
a full disk core.diskfull's, and a run's state as a reader sees it core.liveness'. UI-free and light (no torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from core import procs
from core.checkpoints import (
    CHECKPOINTS,
)
from core.diskfull import release_space, write_last_words
from core.files import atomic_write_text, iter_jsonl_objects, read_json_object
from core.fmt import command
from core.procs import LOCK, PID, STDERR, STDOUT  # noqa: F401 - names of the run directory too
from core.workspace import runs_dir

CONFIG = "config.yaml"  # the validated run config
PLAN = "plan.json"  # the planner's estimate for this config
STATUS = "status.json"  # state + reason, written by the trainer
RANKS = "ranks"  # a run on several processes: rank-K.json records (core.train.ranks) and rank-K.log outputs
METRICS = "metrics.jsonl"  # one line per logging step
# a run on several processes: rank 0 writes every other rank K's memory on each line as rankK_<name>
RANK_MEMORY = ("cuda_allocated", "cuda_reserved", "cuda_peak", "rss_bytes")
GPU = "gpu.jsonl"  # NVML samples
SMOKE = "smoke.json"  # the smoke test's measured peak
SAMPLES = (
    "samples.jsonl"  # greedy answers to fixed held-out prompts at each evaluation (training.eval_samples)
)
# PID ("pid": the training process), LOCK ("lock": held by it), STDOUT and STDERR: see core.procs
# CHECKPOINTS ("checkpoints": checkpoint-N folders): see core.checkpoints; RESERVE: see core.diskfull
# what a mix of data.sources drew: rows per source, seed, rule, fingerprints (core.recipe.mix)
MIX = "mix.json"
SOURCES = "sources.json"  # the Hub ids it trains on, {role: {"id", "revision", "commit", "type"}} (core.train.sources)
# where the run config names each role's Hub id (or local folder)
SOURCE_ROLES = {
    "model": ("model", "path"),
    "reference": ("model", "reference_path"),
    "data": ("data", "path"),
}
TENSORBOARD = "tensorboard"  # training.report_to tensorboard: its event files (core.recipe.trackers)
TRACKIO = "trackio"  # training.report_to trackio: its local database (core.recipe.trackers)
ADAPTER, MODEL = "adapter", "model"  # the final weights: a LoRA adapter, or a full fine-tune

LIVE_STATES = ("starting", "running", "stopping")
END_STATES = ("finished", "failed", "stopped")


def read_sources(run_dir: str | os.PathLike) -> dict:
    return read_json_object(Path(run_dir) / SOURCES) or {}


def run_folders(workspace: str | os.PathLike) -> list[Path]:
    """Every run folder under <workspace>/runs (one with a config), newest first."""
    root = runs_dir(workspace)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and (d / CONFIG).exists()]
    dirs.sort(key=lambda d: (d / CONFIG).stat().st_mtime, reverse=True)
    return dirs


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
    if status["state"] in END_STATES:
        status["phase"] = status["phase_started"] = None  # an ended run is doing nothing
    # never creates the folder: a run folder deleted under its trainer stays deleted (folder_identity)
    if status["state"] in END_STATES:
        write_last_words(Path(run_dir) / STATUS, json.dumps(status))
        release_space(run_dir)  # the run has ended: its reserve is not needed any more
    else:
        atomic_write_text(Path(run_dir) / STATUS, json.dumps(status), parents=False)
    return status


def write_phase(run_dir: str | os.PathLike, phase: str | None) -> None:
    """What a starting run is doing now (status.json's `phase` and when it began), for the Monitor while the state
    is still "starting": importing, checking the data, loading the model, the first step. None once it steps."""
    write_status(run_dir, phase=phase, phase_started=time.time() if phase else None)


def resume_times(before: dict | None, now: float | None = None) -> dict:
    """The status fields a resume writes: when this attempt starts (`attempt_started`) and what the attempts before
    it took (`earlier_s`, each from its (re)start to its last record), so that a run's time leaves out the time it
    sat stopped. `before`: the status the last attempt left (its `ended`, else its last update: a killed trainer)."""
    before = before or {}
    earlier, start = _attempt(before)
    end = before.get("ended") if is_number(before.get("ended")) else before.get("updated")
    if is_number(start) and is_number(end):
        earlier += max(0.0, end - start)
    return {"attempt_started": time.time() if now is None else now, "earlier_s": earlier}


# what a fresh start writes: no earlier attempt, this one began when the run did
FIRST_ATTEMPT = {"attempt_started": None, "earlier_s": None}


def _attempt(status: dict) -> tuple[float, object]:
    """(the seconds earlier attempts took, when this one started): a run never resumed has only `started`."""
    earlier = status.get("earlier_s") if is_number(status.get("earlier_s")) else 0.0
    start = status.get("attempt_started")
    return earlier, start if is_number(start) else status.get("started")


def run_seconds(status: dict | None, end: float | None) -> float | None:
    """How long the run has trained up to `end` (its end, or now): every attempt's span, not the time since its
    first start (a resumed run sat stopped between them). None without a start."""
    earlier, start = _attempt(status or {})
    if not is_number(start) or not is_number(end):
        return None
    return earlier + max(0.0, end - start)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All complete lines of metrics.jsonl (a half-written last line, or one with a number beyond float range, is
    skipped)."""
    # streamed from a regular file only: a FIFO or a /dev/zero link in its place gives [] instead of a hang
    return list(iter_jsonl_objects(Path(run_dir) / METRICS))


def truncate_metrics(run_dir: str | os.PathLike, last_step: int) -> None:
    """Drop lines logged after `last_step` (a run killed after its last checkpoint), so a resumed run's file
    stays continuous: every step appears once, in order."""
    path = Path(run_dir) / METRICS
    if path.is_file():
        keep = [json.dumps(m) + "\n" for m in read_metrics(run_dir) if _step(m) <= last_step]
        atomic_write_text(path, "".join(keep))


def _step(rec: dict) -> float:
    step = rec.get("step", 0)
    return step if isinstance(step, (int, float)) else 0


def latest_samples(run_dir: str | os.PathLike) -> list[dict]:
    """samples.jsonl as the Monitor shows it: per held-out prompt (by its index), the newest answer with its step
    and the answer before it: {"i", "prompt", "reference", "step", "answer", "previous_step", "previous"}."""
    by_prompt: dict[int, list[dict]] = {}
    for rec in iter_jsonl_objects(Path(run_dir) / SAMPLES):
        if isinstance(rec.get("i"), int) and isinstance(rec.get("step"), int):
            by_prompt.setdefault(rec["i"], []).append(rec)
    out = []
    for i, recs in sorted(by_prompt.items()):
        recs.sort(key=lambda r: r["step"])  # a resumed run appends again from its checkpoint's step
        last = recs[-1]
        before = next((r for r in reversed(recs[:-1]) if r["step"] < last["step"]), None)
        out.append(
            {
                "i": i,
                "prompt": str(last.get("prompt", "")),
                "reference": str(last.get("reference", "")),
                "step": last["step"],
                "answer": str(last.get("answer", "")),
                "previous_step": before["step"] if before else None,
                "previous": str(before.get("answer", "")) if before else None,
            }
        )
    return out


def read_smoke(run_dir: str | os.PathLike) -> dict | None:
    """smoke.json: {"state": finished|failed, "reason", "peak_bytes", "seconds_per_step", ...} or None."""
    return read_json_object(Path(run_dir) / SMOKE)


def write_smoke(run_dir: str | os.PathLike, result: dict) -> None:
    write_last_words(Path(run_dir) / SMOKE, json.dumps(result))


def read_plan(run_dir: str | os.PathLike) -> dict | None:
    return read_json_object(Path(run_dir) / PLAN)


def write_plan(run_dir: str | os.PathLike, plan: dict) -> None:
    atomic_write_text(Path(run_dir) / PLAN, json.dumps(plan, default=str))


def read_pid(run_dir: str | os.PathLike) -> int | None:
    """The owner's pid: recorded, or (its pid file deleted) found by its command line while it lives."""
    info = procs.owner_info(run_dir)
    return info["pid"] if info else None


# ---- ownership: the training process owns its run (core.procs; a reader's view of it: core.liveness) ---------------
#
# The trainer holds an exclusive flock on <run>/lock for its whole life, whoever started it (the app, the launcher
# or a terminal), and <run>/pid records its pid, start time and whether it leads its own session. "Running" means
# the lock is held or the recorded process still runs (core.procs.alive): a dead run is seen dead at once, a reused
# pid means nothing, a deleted lock file changes nothing, and a second trainer on the same folder cannot start.


class RunBusy(procs.Busy):
    """Another process trains this run directory."""


class RunRefused(RuntimeError):
    """The run directory cannot be used as asked; nothing in it was touched."""


class RunGone(RuntimeError):
    """The run directory was deleted or replaced under its trainer, which stopped without writing anything more."""


def folder_identity(run_dir: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of the folder, None when it is gone: a folder deleted and made again under the same name
    (rm -rf, then a new run) is another folder."""
    try:
        st = os.stat(run_dir)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


@contextlib.contextmanager
def folder_held(run_dir: str | os.PathLike):
    """The folder held open while the block runs: its inode is not freed while a process holds it, so a folder
    deleted and made again under the same name gets another one. File systems hand a freed inode out again at
    once: without this, a checkpoint save re-creating the folder an instant after `rm -rf` made one that read as
    the same (folder_identity equal) and stayed behind."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # gone already: the identity taken says so
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


# What a run leaves behind once it has trained: training into such a folder again needs --resume.
TRAINED_MARKS = (METRICS, CHECKPOINTS, ADAPTER, MODEL)


NAME_MAX, PATH_MAX = 255, 4096  # bytes per folder name and per path on Linux file systems


def check_run_dir_path(run_dir: str | os.PathLike) -> None:
    """Refuse, creating nothing, a --run-dir that cannot be a run folder: a name longer than the file system allows,
    or a symbolic link whose target does not exist (creating the run there would make that target, anywhere)."""
    raw = Path(run_dir)
    too_long = next((part for part in raw.parts if len(os.fsencode(part)) > NAME_MAX), None)
    if too_long is not None:
        raise RunRefused(
            f"--run-dir: the name {too_long[:40]}... is {len(os.fsencode(too_long))} bytes long; a folder name "
            f"can have at most {NAME_MAX}: give a shorter one."
        )
    if len(os.fsencode(str(raw.absolute()))) >= PATH_MAX:
        raise RunRefused(
            f"--run-dir is longer than the {PATH_MAX} bytes a path can have: give a shorter one."
        )
    try:
        dangling = raw.is_symlink() and not raw.exists()
        target = os.readlink(raw) if dangling else None
    except OSError as exc:
        raise RunRefused(
            f"--run-dir {raw} cannot be used ({exc.strerror}): give a new folder for the run."
        ) from None
    if dangling:
        raise RunRefused(
            f"--run-dir {raw} is a symbolic link to {target}, which does not exist: give a real folder for the run "
            "(nothing was created)."
        )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def is_leftover(run_dir: Path) -> bool:
    """What a start that failed before writing its config left (an older trainer checked the config only after
    taking the folder): a lock, pid or status, no config.yaml, nothing trained. Not a run: deletable, reusable."""
    return (
        not (run_dir / CONFIG).exists()
        and any((run_dir / name).exists() for name in (STATUS, PID, LOCK))
        and not any((run_dir / name).exists() for name in TRAINED_MARKS)
        and (read_status(run_dir) or {}).get("state", "failed") in END_STATES
    )


def check_run_dir(run_dir: Path, resume: bool, config_path: Path | None = None) -> None:
    """Refuse (touching nothing) a run directory that is a file, or one that already trained without --resume:
    a second run into it would truncate its metrics and mix old and new checkpoints. A failed start's leftovers
    (is_leftover) are not a run: a new one may start there. A folder that is no run (none of its status, pid,
    lock, smoke.json) but holds a config.yaml other than `config_path` is the user's: a run would overwrite it."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunRefused(f"--run-dir {run_dir} is a file, not a folder: give a new folder for the run.")
    if resume or not run_dir.is_dir() or is_leftover(run_dir):
        return
    mine = (run_dir / CONFIG).exists() and not (config_path and _same_file(run_dir / CONFIG, config_path))
    if mine and not any((run_dir / name).exists() for name in (STATUS, PID, LOCK, SMOKE)):
        raise RunRefused(
            f"--run-dir {run_dir} already holds a {CONFIG} of its own, which a run would overwrite: give a new or "
            "empty folder for the run."
        )
    status = read_status(run_dir) or {}
    owner = procs.other_owner(run_dir)
    if owner:
        raise RunRefused(
            f"{run_dir} is being trained right now (pid {owner['pid']}): watch it (`{command('runs')} show`, the Monitor "
            "page) or stop it first; give a new --run-dir for another run."
        )
    if status.get("state") in (*END_STATES, "running") or any(
        (run_dir / name).exists() for name in TRAINED_MARKS
    ):
        raise RunRefused(
            f"{run_dir} already holds a run ({status.get('state') or 'it has metrics or checkpoints'}): "
            "continue it with --resume, or give a new --run-dir."
        )


def busy_elsewhere(run_dir: str | os.PathLike) -> str | None:
    """One sentence when the run trains on another machine (its folder on shared storage) and still reports."""
    info = procs.read_pid_info(run_dir)
    host = procs.elsewhere(info)
    if not host or not remote_alive(read_status(run_dir)):
        return None
    return (
        f"Run {Path(run_dir).name} is running on {host} (pid {info['pid']}), as its status says: a signal from "
        f"this machine cannot reach it; stop it there ({command('runs')} stop NAME on {host})."
    )


def claim(run_dir: str | os.PathLike, wait_s: float = 1.0) -> int:
    """Take the run's lock for this process (core.procs.claim) or raise RunBusy naming the trainer's pid."""
    remote = busy_elsewhere(run_dir)
    if remote:
        raise RunBusy(remote)
    try:
        return procs.claim(run_dir, wait_s)
    except procs.Busy as exc:
        who = f" (pid {exc.pid})" if exc.pid else ""
        raise RunBusy(
            f"Run {Path(run_dir).name} is already running{who}: stop it first ({command('runs')} stop NAME).",
            exc.pid,
        ) from None


def remote_alive(status: dict | None, now: float | None = None) -> bool:
    """A run whose process is on another machine reads as alive while its status still says starting/running and
    was updated within the stall limit (the trainer writes it at least at each step's end and while it evaluates)."""
    status = status or {}
    updated, step_s = status.get("updated"), status.get("step_s")
    if status.get("state") not in LIVE_STATES or not is_number(updated):
        return False
    return (time.time() if now is None else now) - updated < stall_limit(step_s if is_number(step_s) else 0.0)


# ---- stalls: alive, but not stepping ----------------------------------------------------------------------------

STALL_FACTOR = 10.0  # no step for this many usual step times ...
STALL_MIN_S = (
    120.0  # ... and at least this long: a stall (evaluation and checkpoints beat the trainer's heart)
)


def stall_limit(step_s: float) -> float:
    """Seconds without a report after which a live run counts as stalled (or, run from another host, as gone)."""
    return max(STALL_MIN_S, STALL_FACTOR * step_s)


def rank_records(run_dir: str | os.PathLike, machine: int | None = None) -> dict[int, dict]:
    """{rank: record} of the ranks of this launch that have started (of one machine's, when named)."""
    out = {}
    for path in sorted((Path(run_dir) / RANKS).glob("rank-*.json")):
        rec = read_json_object(path)
        if rec and isinstance(rec.get("rank"), int) and machine in (None, rec.get("machine", 0)):
            out[rec["rank"]] = rec
    return out


def stopped_process(run_dir: str | os.PathLike) -> str | None:
    """Which process of a live run is stopped (SIGSTOP, Ctrl+Z, a debugger), if one is: a rank of a run on
    several processes (one stopped rank holds every other at its next collective), else its owner."""
    live = {k: r for k, r in rank_records(run_dir).items() if not r.get("ended") and procs.same_process(r)}
    if live:
        k = next((k for k, r in sorted(live.items()) if procs.is_stopped(r["pid"])), None)
        return None if k is None else f"rank {k} stopped"
    info = procs.owner_info(run_dir)  # the owner the listing names, its pid file deleted or not
    return "process stopped" if info and procs.is_stopped(info["pid"]) and procs.same_process(info) else None


def stall(run_dir: str | os.PathLike, status: dict | None, state: str, alive: bool, now: float | None = None):
    """(seconds without a step, why) for a live run that stopped stepping, else (None, None).

    Stalled: its process is stopped (SIGSTOP, Ctrl+Z, a debugger), or a running trainer has not reported for
    STALL_FACTOR times its usual step time (at least STALL_MIN_S): a hung collective, a dead network mount. The
    trainer writes status.json at the end of its steps (at most once a second) and while it evaluates."""
    status = status or {}
    updated = status.get("updated")
    if not alive or state not in ("starting", "running") or not is_number(updated):
        return None, None
    quiet = max(0.0, (time.time() if now is None else now) - updated)
    stopped = stopped_process(run_dir)
    if stopped:
        return quiet, f"no step for {_seconds(quiet)} ({stopped})"
    if state != "running":
        return None, None
    step_s = status.get("step_s")
    if not is_number(step_s):  # a trainer that does not record its step time: the mean since it started
        started, step = status.get("started"), status.get("step")
        step_s = (updated - started) / step if is_number(started) and is_number(step) and step > 0 else 0.0
    if quiet > stall_limit(step_s):
        usual = f"; a step usually takes {step_s:.2g} s" if step_s else ""
        return quiet, f"no step for {_seconds(quiet)}{usual}"
    return None, None


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"
