"""The run queue of a workspace: run configs waiting their turn, started one after another (or side by side on a
GPU with room for both, by their plans) by one supervisor process (core.runs.supervisor).

Its state is one file, <workspace>/queue/queue.json, written atomically under an exclusive flock of
queue/edit.lock, so the CLI, the pages and the supervisor can each change it without losing the others' changes.
An entry holds its run config (the config is the run), its plan's verdict for this machine, and, once started,
the run it became (runs/<name>). A run is created and launched only through an entry whose state says so first
("launching"), so a supervisor killed at any moment and started again never starts an entry twice: the run's
own folder and lock (core.runs.launcher) say whether it was started.

    states: queued -> launching -> running -> finished | failed | stopped;  queued -> cancelled

The supervisor owns <workspace>/queue/ as a trainer owns its run folder (core.procs: lock, pid, start time).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core.files import atomic_write_text, read_json_object
from core.fmt import command
from core.workspace import WorkspaceError, check_run_name, inside, make_folder, runs_dir

QUEUE_DIR = "queue"
STATE_FILE = "queue.json"
EDIT_LOCK = "edit.lock"
FORMAT = 1
WAITING = ("queued",)
ACTIVE = ("launching", "running")
ENDED = ("finished", "failed", "stopped", "cancelled")


class QueueError(RuntimeError):
    """A queue operation that cannot be done; the message says what and how to fix it."""


@dataclass
class Entry:
    id: str  # q1, q2, ... never reused within a workspace
    name: str  # the run's name (its folder under <workspace>/runs once started)
    config: dict  # the validated run config
    state: str = "queued"
    added: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    reason: str | None = None  # why it failed or stopped, from the run's status
    diagnosis: str | None = None  # a failed run's diagnosis (core.monitor.diagnose): what to change
    verdict: str | None = None  # the plan's verdict on this machine when it was added
    planned_bytes: int | None = None  # the plan's device total: what must be free to start it
    device: str | None = None  # cuda | cpu: what the plan was made for
    sweep: dict | None = None  # {"id", "values": {key path: value}} for a point of a sweep

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Entry:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class QueueState:
    entries: list[Entry] = field(default_factory=list)
    next_id: int = 1
    paused: str | None = None  # why the supervisor stopped starting entries (a full disk); resume clears it

    def find(self, entry_id: str) -> Entry:
        for e in self.entries:
            if e.id == entry_id or e.name == entry_id:
                return e
        known = ", ".join(e.id for e in self.entries) or "none"
        raise QueueError(f"No queue entry {entry_id!r} (entries: {known}); see `{command('queue')} list`.")

    def waiting(self) -> list[Entry]:
        return [e for e in self.entries if e.state in WAITING]

    def active(self) -> list[Entry]:
        return [e for e in self.entries if e.state in ACTIVE]


def queue_dir(workspace: str | os.PathLike) -> Path:
    return Path(workspace).expanduser().resolve() / QUEUE_DIR


def _state_path(workspace) -> Path:
    return queue_dir(workspace) / STATE_FILE


def read_queue(workspace: str | os.PathLike) -> QueueState:
    """The queue as it is now (reading never writes; a missing file is an empty queue). A file that is not a
    queue (hand-edited, truncated) is a QueueError naming it: the queue is never silently emptied."""
    path = _state_path(workspace)
    if not path.exists():
        return QueueState()
    data = read_json_object(path)
    if data is None or not isinstance(data.get("entries"), list):
        raise QueueError(
            f"{path} is not a queue file (truncated or edited by hand): move it aside to start a new queue."
        )
    try:
        entries = [Entry.from_dict(e) for e in data["entries"] if isinstance(e, dict)]
    except TypeError:
        raise QueueError(
            f"{path} has an entry without its id, name or config: fix or move the file."
        ) from None
    return QueueState(entries, int(data.get("next_id") or len(entries) + 1), data.get("paused"))


def _write(workspace, state: QueueState) -> None:
    data = {
        "format": FORMAT,
        "next_id": state.next_id,
        "paused": state.paused,
        "entries": [e.to_dict() for e in state.entries],
    }
    atomic_write_text(_state_path(workspace), json.dumps(data, indent=1, default=str))


@contextlib.contextmanager
def editing(workspace: str | os.PathLike) -> Iterator[QueueState]:
    """Read, change and write the queue as one step: an exclusive flock around the read-modify-write, so two
    writers (the CLI and the supervisor) never lose each other's change."""
    folder = inside(workspace, queue_dir(workspace))
    try:
        make_folder(folder, "queue folder")
        fd = os.open(folder / EDIT_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except (OSError, WorkspaceError) as exc:
        raise QueueError(
            f"The queue folder {folder} cannot be written ({exc}): check the workspace."
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        state = read_queue(workspace)
        yield state
        try:
            _write(workspace, state)
        except OSError as exc:
            raise QueueError(
                f"The queue file in {folder} cannot be written ({exc.strerror or exc})."
            ) from None
    finally:
        os.close(fd)  # closing the descriptor releases the flock


# ---- what the CLI and the pages do -----------------------------------------------------------------------------


def add(workspace: str | os.PathLike, config: dict, name: str, plan: dict | None = None, sweep=None) -> Entry:
    """Queue a validated run config under a run name not used by a run or another entry."""
    name = check_run_name(name)
    with editing(workspace) as q:
        taken = {e.name for e in q.entries if e.state not in ("cancelled",)}
        if name in taken or (runs_dir(workspace) / name).exists():
            raise QueueError(f"The name {name!r} is taken (a run or a queue entry): give another --name.")
        entry = Entry(f"q{q.next_id}", name, copy.deepcopy(config), sweep=sweep, **(_plan_fields(plan)))
        q.next_id += 1
        q.entries.append(entry)
    return entry


def _plan_fields(plan: dict | None) -> dict:
    if not plan:
        return {}
    device = (plan.get("plan") or {}).get("device")
    return {"verdict": plan.get("verdict"), "planned_bytes": plan.get("device_total_bytes"), "device": device}


def remove(workspace: str | os.PathLike, entry_id: str) -> Entry:
    """Cancel a waiting entry (kept in the list as cancelled); a started one is a run: stop it instead."""
    with editing(workspace) as q:
        entry = q.find(entry_id)
        if entry.state in ACTIVE:
            raise QueueError(
                f"{entry.id} ({entry.name}) has started: stop its run ({command('runs')} stop {entry.name})."
            )
        if entry.state in ENDED:
            raise QueueError(f"{entry.id} ({entry.name}) has already ended ({entry.state}).")
        entry.state, entry.ended = "cancelled", time.time()
    return entry


def move(workspace: str | os.PathLike, entry_id: str, to: int) -> list[Entry]:
    """Move a waiting entry to position `to` (1 = next to start) among the waiting ones."""
    with editing(workspace) as q:
        entry = q.find(entry_id)
        if entry.state not in WAITING:
            raise QueueError(f"{entry.id} ({entry.name}) is {entry.state}: only waiting entries move.")
        waiting = q.waiting()
        if not 1 <= to <= len(waiting):
            raise QueueError(f"--to must be between 1 and {len(waiting)} (the waiting entries).")
        waiting.remove(entry)
        waiting.insert(to - 1, entry)
        rest = iter(waiting)
        q.entries = [next(rest) if e.state in WAITING else e for e in q.entries]
        return q.waiting()


def resume(workspace: str | os.PathLike) -> None:
    """Clear a pause (the supervisor stopped starting entries, e.g. on a full disk)."""
    with editing(workspace) as q:
        q.paused = None


def entry_object(e: Entry) -> dict:
    """`queue ls --json`: a stable shape (new keys may come; these stay)."""
    return {
        "id": e.id,
        "name": e.name,
        "state": e.state,
        "run": f"runs/{e.name}" if e.state not in ("queued", "cancelled") else None,
        "method": e.config.get("method", "sft"),
        "verdict": e.verdict,
        "planned_bytes": e.planned_bytes,
        "device": e.device,
        "added": e.added,
        "started": e.started,
        "ended": e.ended,
        "reason": e.reason,
        "diagnosis": e.diagnosis,
        "sweep": e.sweep,
    }
