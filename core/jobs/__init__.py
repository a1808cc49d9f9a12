"""Long jobs (merge, demo build, full-dataset preflight, GGUF export, evaluation, the GRPO demo's warm start) as
processes with their state in files.

The same pattern as runs: <workspace>/jobs/<kind>-<time>-<n>/ holds job.json (what to do), progress.json (how
far), result.json (the outcome) and the job's logs; the job process owns the folder (core.procs: its lock, pid and start time) for its whole life.
A page starts a job and polls its folder, so a reload, a second tab or a restarted server reattaches to it and
the page never blocks for more than a moment. UI-free and light: no torch import here.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from core import logtail, procs, stopping
from core.files import atomic_write_text, read_json_object
from core.workspace import inside, make_folder

JOBS_DIR = "jobs"
JOB, PROGRESS, RESULT = "job.json", "progress.json", "result.json"
KINDS = ("merge", "demo", "preflight", "gguf", "eval", "warm_start", "hub")
REPO_ROOT = Path(__file__).resolve().parents[2]


class JobError(RuntimeError):
    """A job could not be started; the message says why."""


@dataclass
class JobView:
    path: Path
    kind: str
    params: dict
    state: str  # running | finished | failed
    progress: dict = field(default_factory=dict)
    result: dict | None = None  # the job's return value when finished
    error: str | None = None  # one sentence when failed
    started: float | None = None

    @property
    def done(self) -> bool:
        return self.state != "running"


def jobs_dir(workspace: str | os.PathLike) -> Path:
    return Path(workspace).expanduser().resolve() / JOBS_DIR


def start(workspace: str | os.PathLike, kind: str, params: dict, key: str = "") -> Path:
    """Start `kind` with `params` (JSON-able) as a detached process; returns the job's folder at once.

    `key` tags the job (e.g. the merge's target) so that a page can find it again with `latest`."""
    if kind not in KINDS:
        raise JobError(f"unknown job kind {kind!r}: one of {', '.join(KINDS)}")
    root = inside(workspace, jobs_dir(workspace))
    make_folder(root, "jobs folder")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while True:
        folder = root / f"{kind}-{stamp}-{n}"
        try:
            folder.mkdir()  # atomic claim: two clicks never share a folder
            break
        except FileExistsError:
            n += 1
    atomic_write_text(
        folder / JOB, json.dumps({"kind": kind, "params": params, "key": key, "started": time.time()})
    )
    lock_fd = procs.claim(folder)
    try:
        procs.spawn(folder, [sys.executable, "-m", "core.jobs", str(folder)], lock_fd, cwd=REPO_ROOT)
    except OSError as exc:
        _write_result(folder, {"state": "failed", "error": f"could not start the job ({exc})"})
        raise JobError(f"Could not start the {kind} job ({exc}).") from None
    finally:
        os.close(lock_fd)  # the job holds the lock through its own copy of the descriptor
    return folder


def read(folder: str | os.PathLike) -> JobView:
    """The job's state from its files and its lock (a job killed without a word is failed at once)."""
    folder = Path(folder)
    procs.reap()  # a job started here that has ended lingers as a zombie until collected
    job = read_json_object(folder / JOB) or {}
    result = read_json_object(folder / RESULT)
    progress = read_json_object(folder / PROGRESS) or {}
    view = JobView(
        folder, str(job.get("kind")), job.get("params") or {}, "running", progress, started=job.get("started")
    )
    if result is not None:
        view.state = "finished" if result.get("state") == "finished" else "failed"
        view.result, view.error = result.get("result"), result.get("error")
    elif not procs.alive(folder):
        view.state = "failed"
        tail = logtail.tail_text(folder / procs.STDERR, n_lines=8)
        view.error = "the job ended without a result" + (
            f"; last lines of its stderr:\n{tail}" if tail else ""
        )
    return view


def latest(workspace: str | os.PathLike, kind: str, key: str | None = None, **params) -> JobView | None:
    """The newest job of `kind` (with `key`, and these `params`, when given): what a page reattaches to after a
    reload, or a restart of the server (the newest merge of an adapter, whatever its target was called)."""
    root = jobs_dir(workspace)
    if not root.is_dir():
        return None
    found = []
    for folder in root.glob(f"{kind}-*"):
        job = read_json_object(folder / JOB)
        if not job or (key is not None and job.get("key") != key):
            continue
        given = job.get("params") if isinstance(job.get("params"), dict) else {}
        if all(given.get(name) == value for name, value in params.items()):
            found.append((job.get("started") or 0.0, folder))
    return read(max(found)[1]) if found else None


def _write_result(folder: Path, result: dict) -> None:
    atomic_write_text(folder / RESULT, json.dumps(result, default=str))


class Progress:
    """What a job reports: written to progress.json at most every 0.2 s (and always the last report)."""

    def __init__(self, folder: Path):
        self.folder, self._t = folder, 0.0

    def __call__(self, **fields) -> None:
        now = time.time()
        if now - self._t >= 0.2 or fields.get("final"):
            self._t = now
            atomic_write_text(self.folder / PROGRESS, json.dumps({**fields, "time": now}, default=str))


def running(workspace: str | os.PathLike, kind: str) -> list[JobView]:
    """The jobs of `kind` still running, newest first (the Models page lists its downloads)."""
    root = jobs_dir(workspace)
    views = [read(f) for f in root.glob(f"{kind}-*")] if root.is_dir() else []
    return sorted((v for v in views if not v.done), key=lambda v: v.started or 0.0, reverse=True)


def cancel(folder: str | os.PathLike) -> None:
    """Stop a running job (SIGTERM, then SIGKILL) and record it as cancelled; what it finished stays (a download
    keeps its complete files, and the next one fetches the rest)."""
    folder = Path(folder)
    stopping.stop(folder, grace_s=5.0)
    if read_json_object(folder / RESULT) is None:
        _write_result(folder, {"state": "failed", "error": "cancelled"})
