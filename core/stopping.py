"""Stopping the process that owns a folder (core.procs): SIGTERM to the owner alone, never to the process group of
whoever started it (a trainer started as `core.train ... | tee log` shares the shell job's group: signalling that
group would kill tee and the shell); the owner ends its own children as it exits. After the grace period SIGKILL
goes to the owner and all its descendants, and to its process group only when the owner leads its own session
(then everything in the group is its own).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from core.procs import (
    holds_lock,
    is_stopped,
    leads_session,
    lock_held,
    owner_info,
    read_pid_info,
    reap,
    same_process,
)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _send(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # psutil refuses a pid that now names another process
            proc.send_signal(sig)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (found by parentage, whatever their session)."""
    _send(_tree(pid), signal.SIGKILL)


def wait_gone(folder: str | os.PathLike, timeout: float, info: dict | None = None) -> bool:
    """Wait until the folder's owner is gone: its lock released and the recorded process exited."""
    info = info or read_pid_info(folder)
    deadline = time.monotonic() + timeout
    while True:
        reap()
        gone = not lock_held(folder) and not (info and info["pid"] != os.getpid() and same_process(info))
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)


def _wait_continuing(folder: str | os.PathLike, grace_s: float, info: dict, owner: psutil.Process) -> bool:
    """wait_gone, continuing any process of the tree that is stopped: a stopped process cannot act on the SIGTERM,
    nor can a stopped child it waits for (one rank of several). Checked all along, not once: a SIGSTOP sent just
    before the stop may land after a single check."""
    deadline = time.monotonic() + grace_s
    while True:
        with contextlib.suppress(psutil.Error):  # the owner's own object: a reused pid is never signalled
            _send([p for p in [owner, *owner.children(recursive=True)] if is_stopped(p.pid)], signal.SIGCONT)
        if wait_gone(folder, min(0.5, max(0.0, deadline - time.monotonic())), info):
            return True
        if time.monotonic() > deadline:
            return False


def stop(folder: str | os.PathLike, grace_s: float = 60.0) -> str | None:
    """Stop the folder's owner: SIGTERM to it alone (a stopped process is continued so it can act on it), wait
    until it is gone, then SIGKILL it with all its descendants. Returns "exited" (it ended within the grace
    period), "killed", or None when no recorded process of another pid owns the folder."""
    info = owner_info(folder)
    if not info or info["pid"] == os.getpid() or not same_process(info):
        return None
    pid = info["pid"]
    if not holds_lock(pid, folder):
        return None  # a pid file naming a process that does not own the folder (forged, or a stale copy)
    tree = _tree(pid)
    if not tree:
        return None
    owner = tree[0]
    _send([owner], signal.SIGTERM)
    if _wait_continuing(folder, grace_s, info, owner):
        return "exited"
    tree += [p for p in _tree(pid) if p not in tree]
    if info.get("session_leader") and leads_session(pid) and same_process(info):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    _send(tree, signal.SIGKILL)
    wait_gone(folder, 10.0, info)
    return "killed"
