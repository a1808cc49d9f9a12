"""The queue's supervisor: `python -m core.runs.supervisor WORKSPACE`, one per workspace, started by `queue add`,
`queue resume` or the app when the queue has work and no supervisor lives.

Each tick it reads what the runs it started did (a run's folder and lock are the truth, core.runs.launcher), records
the ended ones (a failed run with its diagnosis; the queue goes on with the next entry), and starts the next waiting
entry when there is room by the plans: on a GPU, when its planned device total fits in what NVML reports free
(less what runs started moments ago will still take), so two small runs share a card and a large one waits; on a
CPU, one run at a time (a run uses every core). A run launched by hand, outside the queue, holds the queue until it
ends (its memory is in no plan here). A full disk stops the queue with a sentence instead of failing
every later entry one by one. It exits when nothing waits or runs.

Killed at any moment (kill -9 too) and started again, it neither loses nor repeats an entry: an entry is marked
"launching" before its run folder is made, the run's folder tells whether it was created and launched, and the
run's own lock makes a second launch impossible. The trainers run in their own sessions: they outlive it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from core import procs
from core.fmt import command
from core.runs import queue as Q
from core.runs.launcher import REPO_ROOT, RunError, create_run, launch, live_runs, run_state
from core.workspace import WorkspaceError, runs_dir

POLL_S = 2.0
SETTLING_S = 120.0  # a run started this recently has not taken its memory yet: count its plan instead
LABEL = "the queue's supervisor"


def supervisor_alive(workspace: str | os.PathLike) -> bool:
    folder = Q.queue_dir(workspace)
    return folder.is_dir() and procs.alive(folder)


def ensure_running(workspace: str | os.PathLike) -> int | None:
    """Start the supervisor when the queue has work and none runs; its pid, or None when there is nothing to do
    or one already runs (a second start is refused by the queue folder's lock, never doubled)."""
    state = Q.read_queue(workspace)
    if not (state.waiting() or state.active()) or supervisor_alive(workspace):
        return None
    folder = Q.queue_dir(workspace)
    try:
        fd = procs.claim(folder, wait_s=0.2, label=LABEL)
    except procs.Busy:
        return None
    try:
        argv = [sys.executable, "-m", "core.runs.supervisor", str(Path(workspace).expanduser().resolve())]
        return procs.spawn(folder, argv, fd, cwd=REPO_ROOT)
    except OSError as exc:
        raise Q.QueueError(f"Could not start {LABEL} ({exc}).") from None
    finally:
        os.close(fd)


# ---- one tick ---------------------------------------------------------------------------------------------------


def reconcile(workspace, state: Q.QueueState) -> None:
    """Bring each started entry up to date with its run's folder."""
    for entry in state.active():
        run_dir = runs_dir(workspace) / entry.name
        if not run_dir.is_dir():
            if entry.state == "launching":
                continue  # chosen, its folder not made yet: start_entry makes it
            entry.state, entry.ended, entry.reason = (
                "failed",
                time.time(),
                f"its run folder {run_dir} is gone",
            )
            continue
        info = run_state(run_dir)
        if info.state == "new" or info.alive:
            continue  # not launched yet (start_entry launches it), or training
        entry.state = info.state if info.state in ("finished", "failed", "stopped") else "failed"
        entry.ended, entry.reason = time.time(), info.reason
        if entry.state == "failed":
            entry.diagnosis = _diagnosis(run_dir)
            if _disk_full(info.reason):
                state.paused = (
                    f"{entry.name} stopped on a full disk ({info.reason}); the queue waits: free space, then "
                    f"`{command('queue')} resume`."
                )


def _diagnosis(run_dir: Path) -> str | None:
    from core.monitor.diagnose import diagnose_run

    try:
        d = diagnose_run(run_dir)
    except Exception:  # a run's broken files must not stop the queue
        return None
    if d.rule == "unknown":
        return None  # the run's reason says all there is
    return f"{d.title}: {d.fixes[0]}" if d.fixes else d.title


def _disk_full(reason: str | None) -> bool:
    return isinstance(reason, str) and reason.startswith("disk full")


def next_entry(workspace, state: Q.QueueState) -> Q.Entry | None:
    """The first waiting entry, when there is room for it now."""
    if state.paused or not state.waiting():
        return None
    entry, active = state.waiting()[0], state.active()
    started = {e.name for e in active}
    if any(r.name not in started for r in live_runs(workspace)):
        # a run launched by hand: its memory is not in the plans here (nor yet in NVML's figures while it loads),
        # so what was queued beside it ("Add to queue" on the Train page) waits for it to end
        return None
    if not active:
        return entry
    if entry.device != "cuda" or any(e.device != "cuda" for e in active):
        return None  # on a CPU one run at a time: a run keeps every core busy
    settling = sum(e.planned_bytes or 0 for e in active if (e.started or 0) > time.time() - SETTLING_S)
    free = _gpu_free(entry.config)
    return entry if free is not None and (entry.planned_bytes or 0) <= free - settling else None


def _gpu_free(config: dict) -> int | None:
    """The least free memory among the GPUs a run of `config` uses (NVML), None where NVML cannot tell."""
    from core import gpu
    from core.recipe import distributed

    ids = distributed.gpu_ids(config) or list(range(distributed.gpus_per_machine(config)))
    frees = [
        s.memory_total - s.memory_used
        for s in gpu.in_use(ids)
        if s.memory_total and s.memory_used is not None
    ]
    return min(frees) if frees else None


def start_entry(workspace, entry_id: str) -> None:
    """Create and launch the entry's run (each step only if its folder says it was not done yet)."""
    with Q.editing(workspace) as state:
        entry = state.find(entry_id)
        config, name = entry.config, entry.name
    run_dir = runs_dir(workspace) / name
    try:
        if not run_dir.is_dir():
            create_run(workspace, name, config)
        if run_state(run_dir).state == "new":
            launch(run_dir)
        outcome = ("running", None)
    except (RunError, WorkspaceError) as exc:
        outcome = ("failed", str(exc))
    with Q.editing(workspace) as state:
        entry = state.find(entry_id)
        entry.state, entry.reason = outcome
        if outcome[0] == "failed":
            entry.ended = time.time()


def tick(workspace) -> bool:
    """One pass: reconcile, start what fits. False once nothing waits or runs (the supervisor may exit)."""
    with Q.editing(workspace) as state:
        reconcile(workspace, state)
        chosen = next_entry(workspace, state)
        if chosen is not None:
            chosen.state, chosen.started = "launching", time.time()  # written before anything is made
        busy = bool(state.active()) or (bool(state.waiting()) and not state.paused)
    if chosen is not None:
        start_entry(workspace, chosen.id)
    with Q.editing(workspace) as state:  # launching entries whose start was interrupted are started again
        again = [
            e.id for e in state.active() if e.state == "launching" and e.id != getattr(chosen, "id", None)
        ]
    for entry_id in again:
        start_entry(workspace, entry_id)
    return busy


def main(argv: list[str] | None = None) -> int:
    from core.train.state import StopFlag

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m core.runs.supervisor WORKSPACE", file=sys.stderr)
        return 2
    workspace = Path(args[0])
    procs.enter_start_folder()  # a queued config's relative paths: from where `queue add` or the app was started
    folder = Q.queue_dir(workspace)
    stop = StopFlag().install()
    try:
        lock = procs.adopt_claim() or procs.claim(folder, label=LABEL)  # noqa: F841 - held until exit
    except procs.Busy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    procs.write_pid_info(folder)
    print(f"{LABEL}: pid {os.getpid()} for {workspace}", flush=True)
    while not stop.signal:
        try:
            if not tick(workspace):
                break
        except Q.QueueError as exc:  # a broken queue file: say so once and end (nothing is lost or guessed)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        time.sleep(POLL_S)
    print(
        f"{LABEL}: {'stopped by ' + str(stop.signal) if stop.signal else 'nothing left to run'}", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
