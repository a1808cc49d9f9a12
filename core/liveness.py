"""A run's state as every reader sees it: its status file checked against its process (live_state), and the
reason given for a trainer that vanished without a word (vanished_reason, read_live_status). Reads only: a listing
never writes. The owner's side -- claiming the run, its stalls -- is core.rundir's, over core.procs.
"""

from __future__ import annotations

import os
from pathlib import Path

from core import logtail, procs
from core.procs import LOCK, STDERR
from core.rundir import LIVE_STATES, is_number, read_status, remote_alive


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
    last = logtail.tail_text(Path(run_dir) / STDERR, STDERR_TAIL_LINES).strip("\n")
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
        ended = status.get("updated") if is_number(status.get("updated")) else None
        status = {**status, "state": "failed", "reason": vanished_reason(run_dir), "ended": ended}
    return status, state, alive
