"""The run directory: the only channel between a training process and everything that watches it.

This module owns its file names and the reading and writing of its state files; the trainer, the launcher, the
watcher and the diagnosis all go through it. UI-free and light (no torch import).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

from core import procs
from core.files import (
    BadFile,
    atomic_write_text,
    iter_jsonl_objects,
    read_json_object,
    read_safetensors_header,
)
from core.fmt import nbytes
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
CHECKPOINTS = "checkpoints"
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


RESERVE = ".space-reserve"  # bytes the trainer sets aside so that it can still say "disk full" on a full disk
RESERVE_BYTES = 64 * 1024
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|StorageFull|os error 28\b|Errno 28\b"
)


def reserve_space(run_dir: str | os.PathLike) -> None:
    """Set RESERVE_BYTES aside in the run directory (really allocated, not a sparse file): the last status a trainer
    writes on a full disk (state failed, reason "disk full") is written into the space this frees."""
    path = Path(run_dir) / RESERVE
    with contextlib.suppress(OSError):  # no room even for this: the run fails on its first write, as it would
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError:
            os.write(fd, bytes(RESERVE_BYTES))
        finally:
            os.close(fd)


def release_space(run_dir: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):
        (Path(run_dir) / RESERVE).unlink()


def is_disk_full(exc: BaseException, run_dir: str | os.PathLike | None = None) -> bool:
    """The error is a full disk (or quota): ENOSPC/EDQUOT anywhere in its chain, the libraries' wordings of it
    (safetensors' StorageFull, "os error 28"), or any write error while the run's disk has under 1 MiB free."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if _DISK_FULL_TEXT.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    if run_dir is not None:
        with contextlib.suppress(OSError):
            return shutil.disk_usage(run_dir).free < 1 << 20
    return False


def disk_full_reason(run_dir: str | os.PathLike, exc: BaseException | None = None) -> str:
    """status.json's reason for a run stopped by a full disk: where, how much is free, what to do."""
    free = ""
    with contextlib.suppress(OSError):
        free = f" ({nbytes(shutil.disk_usage(run_dir).free)} free)"
    what = ""
    if exc is not None:
        text = str(exc).strip().splitlines()
        what = f"; {type(exc).__name__}: {text[0][:200]}" if text else f"; {type(exc).__name__}"
    return (
        f"disk full: no space left on the disk that holds {run_dir}{free}{what}. Free space there (or move the "
        "run to a larger disk), then resume the run."
    )


def _write_last_words(path: Path, text: str) -> None:
    """An atomic write that ends a run (its final status, a smoke result): on a full disk, the space the trainer set
    aside (reserve_space) is given back and the write tried once more."""
    try:
        atomic_write_text(path, text, parents=False)  # a run folder deleted under its trainer stays deleted
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS or not (path.parent / RESERVE).exists():
            raise
        release_space(path.parent)
        atomic_write_text(path, text, parents=False)


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
        _write_last_words(Path(run_dir) / STATUS, json.dumps(status))
        release_space(run_dir)  # the run has ended: its reserve is not needed any more
    else:
        atomic_write_text(Path(run_dir) / STATUS, json.dumps(status), parents=False)
    return status


def write_phase(run_dir: str | os.PathLike, phase: str | None) -> None:
    """What a starting run is doing now (status.json's `phase` and when it began), for the Monitor while the state
    is still "starting": importing, checking the data, loading the model, the first step. None once it steps."""
    write_status(run_dir, phase=phase, phase_started=time.time() if phase else None)


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


CHECKPOINT_CONFIG = "run_config.yaml"  # inside checkpoint-N: the config that trained it (core.train.resume)
CONFIG_HISTORY = "config.history"  # until-step-N.yaml: each config a resume with a changed config replaced


def checkpoint_step(path: Path) -> int | None:
    tail = path.name.removeprefix("checkpoint-")
    return int(tail) if path.name.startswith("checkpoint-") and tail.isdigit() else None


def checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every checkpoint-N folder of the run, newest first (whether usable or not)."""
    ckpts = Path(run_dir) / CHECKPOINTS
    if not ckpts.is_dir():
        return []
    found = [p for p in ckpts.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step, reverse=True)


def checkpoint_problem(path: str | os.PathLike, deep: bool = False) -> str | None:
    """None when the checkpoint folder can be resumed from; else why not, in a few words. Reads only.

    Checks what a cut-off or damaged save leaves: trainer_state.json readable and at the folder's step, weights
    (safetensors: the header parses and the file is as long as it says; .bin: a whole zip), and the optimizer,
    scheduler and RNG states written by torch.save as whole zip archives. `deep` also checks the CRC of every
    member of those archives (reads them through; the trainer does so for the one it resumes from)."""
    path = Path(path)
    state = read_json_object(path / "trainer_state.json")
    if state is None:
        return "trainer_state.json is missing or unreadable (cut off while saving?)"
    step = checkpoint_step(path)
    if state.get("global_step") != step:
        return f"trainer_state.json says step {state.get('global_step')!r}, not {step}"
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    weights = [w for w in weights if w.name != "training_args.bin"]
    if not weights:
        return "it holds no weights (no *.safetensors)"
    for w in weights:
        why = _safetensors_problem(w) if w.suffix == ".safetensors" else _torch_file_problem(w, deep)
        if why:
            return f"{w.name} {why}"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        f = path / name
        if not f.exists():
            if name == "rng_state.pth":
                continue  # optional for the Trainer
            return f"{name} is missing"
        why = _torch_file_problem(f, deep)
        if why:
            return f"{name} {why}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Why a checkpoint's weights file cannot be resumed from (core.files' one reader, then its size: a save cut
    off, or a file with bytes after its last tensor), or None."""
    try:
        header = read_safetensors_header(path)
    except BadFile as exc:
        return exc.why
    except OSError as exc:
        return f"is unreadable ({exc.__class__.__name__})"
    if header.data_end != header.size:
        return f"is {header.size:,} bytes where its header says {header.data_end:,} (truncated or damaged)"
    return None


def _torch_file_problem(path: Path, deep: bool) -> str | None:
    """torch.save writes a zip archive: a cut-off file has no central directory at its end."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if deep else None
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        return f"is damaged or truncated ({str(exc) or exc.__class__.__name__})"
    return f"is damaged ({bad} fails its checksum)" if bad else None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint that can be resumed from (checkpoint_problem), or None."""
    return next((p for p in checkpoints(run_dir) if checkpoint_problem(p) is None), None)


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
    _write_last_words(Path(run_dir) / SMOKE, json.dumps(result))


def read_plan(run_dir: str | os.PathLike) -> dict | None:
    return read_json_object(Path(run_dir) / PLAN)


def write_plan(run_dir: str | os.PathLike, plan: dict) -> None:
    atomic_write_text(Path(run_dir) / PLAN, json.dumps(plan, default=str))


def read_pid(run_dir: str | os.PathLike) -> int | None:
    """The owner's pid: recorded, or (its pid file deleted) found by its command line while it lives."""
    info = procs.owner_info(run_dir)
    return info["pid"] if info else None


# ---- liveness: owned by the training process (core.procs) -----------------------------------------------------
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
            f"{run_dir} is being trained right now (pid {owner['pid']}): watch it (`python -m core.runs show`, the Monitor "
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
        f"this machine cannot reach it; stop it there (python -m core.runs stop NAME on {host})."
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
            f"Run {Path(run_dir).name} is already running{who}: stop it first (python -m core.runs stop NAME).",
            exc.pid,
        ) from None


def live_state(run_dir: str | os.PathLike, status: dict | None = None) -> tuple[str, bool]:
    """(state, alive) from the status file and the process check. A live-looking status without a live process
    is a process that died without a word ("failed"); an ended status while the process still lives is a
    process that is exiting: it reads as what it said (finished, stopped, failed), still alive, so nothing is
    relaunched under it -- never a transient "stopping" after a normal finish."""
    status = read_status(run_dir) if status is None else status
    written = (status or {}).get("state")
    written = written if isinstance(written, str) and written else None  # a hand-edited or broken file
    if not (Path(run_dir) / LOCK).exists() and procs.read_pid_info(run_dir) is None:
        if written in LIVE_STATES and procs.find_owner(run_dir):
            return written, True  # its lock and pid files were deleted under it: it still trains
        # no trace of a process at all (a folder written by hand or by a test): the status says it all
        state = written or "new"
        return state, state in LIVE_STATES
    if procs.elsewhere(procs.read_pid_info(run_dir)):
        # trained from another machine on shared storage: its lock if the storage shows it, else its reports
        alive = procs.lock_held(run_dir) or remote_alive(status)
    else:
        alive = procs.alive(run_dir)
    state = written or ("starting" if alive else "new")
    if state in ("starting", "running") and not alive and written:
        return "failed", False
    return state, alive


STDERR_TAIL_LINES = 20  # the lines of stderr.log a vanished trainer's reason quotes


def remote_alive(status: dict | None, now: float | None = None) -> bool:
    """A run whose process is on another machine reads as alive while its status still says starting/running and
    was updated within the stall limit (the trainer writes it at least at each step's end and while it evaluates)."""
    status = status or {}
    updated, step_s = status.get("updated"), status.get("step_s")
    if status.get("state") not in LIVE_STATES or not _number(updated):
        return False
    return (time.time() if now is None else now) - updated < stall_limit(step_s if _number(step_s) else 0.0)


def vanished_reason(run_dir: str | os.PathLike) -> str:
    """Why a run whose process is gone still says starting/running: it ended without writing its own status
    (SIGKILL from the kernel's OOM killer or from outside, a segfault). A first line that is a sentence by itself
    (the pages show it alone), then the end of stderr.log when it holds anything."""
    info = procs.read_pid_info(run_dir)
    pid = f" (pid {info['pid']})" if info else ""
    host = procs.elsewhere(info)
    if host:
        return (
            f"The training process{pid} on {host} has not reported for longer than its steps take; this machine "
            f"cannot check a process on another one: it has presumably ended (look at {host})."
        )
    reason = f"The training process{pid} ended without reporting (it was killed, or crashed in native code)."
    last = procs.tail_text(Path(run_dir) / STDERR, STDERR_TAIL_LINES).strip("\n")
    if last.strip():
        return f"{reason}\nLast lines of stderr.log:\n{last}"
    return f"{reason} It wrote nothing to stderr.log."


def read_live_status(run_dir: str | os.PathLike, status: dict | None = None) -> tuple[dict | None, str, bool]:
    """(status, state, alive) as every reader should see them, without writing anything (reads never write: a full
    disk or a read-only workspace must not break a listing). A status that still says starting/running while its
    process is gone is given state "failed", the reason `vanished_reason` and the time it was last updated as its
    end; the file keeps what the trainer wrote."""
    status = read_status(run_dir) if status is None else status
    state, alive = live_state(run_dir, status)
    if state == "failed" and (status or {}).get("state") in ("starting", "running"):
        ended = status.get("updated") if _number(status.get("updated")) else None
        status = {**status, "state": "failed", "reason": vanished_reason(run_dir), "ended": ended}
    return status, state, alive


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
    if not alive or state not in ("starting", "running") or not _number(updated):
        return None, None
    quiet = max(0.0, (time.time() if now is None else now) - updated)
    stopped = stopped_process(run_dir)
    if stopped:
        return quiet, f"no step for {_seconds(quiet)} ({stopped})"
    if state != "running":
        return None, None
    step_s = status.get("step_s")
    if not _number(step_s):  # a trainer that does not record its step time: the mean since it started
        started, step = status.get("started"), status.get("step")
        step_s = (updated - started) / step if _number(started) and _number(step) and step > 0 else 0.0
    if quiet > stall_limit(step_s):
        usual = f"; a step usually takes {step_s:.2g} s" if step_s else ""
        return quiet, f"no step for {_seconds(quiet)}{usual}"
    return None, None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"
