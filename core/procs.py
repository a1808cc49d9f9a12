"""The process lifecycle, written once for every process that owns a folder (a training run, a background job):
spawn it detached with the folder's lock handed to it, record who it is, tell whether it lives, reap it. Stopping
it is core.stopping's, the end of its logs core.logtail's, and the temporary folders killed processes leave behind
core.tempdirs'. Ground layer: stdlib, psutil, core.files.

Ownership. The owner holds an exclusive flock on FOLDER/lock for its whole life, whoever started it (a launcher
through `spawn`, which takes the lock first and hands the open descriptor down, or a terminal). The kernel drops
the lock the instant the process dies, so a dead owner is seen dead at once and a second owner cannot start.
FOLDER/pid records the owner's pid, its start time and whether it leads its own session: the pair (pid, start
time) names one process for ever (a reused pid does not match), so it is what `core.stopping.stop` signals, and it keeps
ownership when someone deletes the lock file ("a stale lock"): `alive` and `claim` check both. When both files
are gone, the owner is still found by its command line, which names the folder (`find_owner`). Either way an
owner is a process that holds the folder's lock open (`holds_lock`): a forged pid file, a wrapper that names the
folder (`timeout 300 python -m core.train … --run-dir D`) or a second start still waiting for the lock is none.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import psutil

from core.files import atomic_write_text

LOCK = "lock"  # held (flock) by the owner for its whole life
PID = "pid"  # {"pid", "start_time", "session_leader"} of the owner
STDOUT, STDERR = "stdout.log", "stderr.log"
LOCK_FD_ENV = (
    "LORA_COCKPIT_LOCK_FD"  # names the lock descriptor a launcher handed down to the process it started
)
# The folder the user started the app or a tool in (`lora-cockpit` sets it; spawn hands it down): a child runs from
# the package's folder, so that `-m core.X` imports this code and never a same-named file of the user's, then goes
# back to it (enter_start_folder), so that relative paths mean what they meant where they were typed
START_ENV = "LORA_COCKPIT_START_DIR"
SAME_START_S = 1.0  # start times are compared to this precision (clock granularity of /proc)


class Busy(RuntimeError):
    """Another live process owns the folder; `pid` names it when known."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


# ---- who a process is ---------------------------------------------------------------------------------------


def process_start_time(pid: int) -> float | None:
    """The process's start time; None when it is gone or a zombie (exited, not yet reaped: reaped here when it
    is a child of ours)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            reap()
            return None
        return proc.create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


def this_host() -> str:
    return socket.gethostname()


def elsewhere(info: dict | None) -> str | None:
    """The host a recorded process runs on when that is another machine (a folder on shared storage), else None:
    its pid means nothing here, and no signal from here reaches it."""
    host = (info or {}).get("host")
    return host if isinstance(host, str) and host and host != this_host() else None


def same_process(info: dict | None) -> bool:
    """The one liveness check of a recorded process: it exists, is not a zombie, and is the one recorded (on this
    machine: a record from another host is never a process here).

    `start_time` (what write_pid_info records) must match; a record that carries instead `started` (when its
    work began: older merge markers) matches a process created no later than that; a record with neither (an
    old plain-number pid file, a hand-written one) names no process for sure, so it matches none: a stop must
    never reach whatever process reused that pid."""
    if not info or not isinstance(info.get("pid"), int) or info["pid"] <= 0 or elsewhere(info):
        return False
    created = process_start_time(info["pid"])
    if created is None:
        return False
    start_time, started = info.get("start_time"), info.get("started")
    if isinstance(start_time, (int, float)):
        return abs(created - start_time) < SAME_START_S
    if isinstance(started, (int, float)):
        return created <= started + SAME_START_S
    return False


def pid_alive(pid: int | None) -> bool:
    """True while a process with this pid exists and is not a zombie (no start time to compare)."""
    return isinstance(pid, int) and pid > 0 and process_start_time(pid) is not None


def leads_session(pid: int) -> bool:
    """The process leads its own session (setsid): everything in its process group is its own."""
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def is_stopped(pid: int | None) -> bool:
    """The process is stopped (SIGSTOP, Ctrl+Z, a debugger): alive, but it will not run until continued."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except (psutil.Error, ValueError, OverflowError):
        return False


def write_pid_info(folder: str | os.PathLike, pid: int | None = None) -> dict:
    """Record the folder's owner: pid, start time (so a stop signals this process, never a later one that reused
    the pid), whether it leads its own session (so a stop never reaches its starter's process group) and the host
    (a folder on shared storage is read from other machines)."""
    pid = pid or os.getpid()
    info = {
        "pid": pid,
        "start_time": process_start_time(pid),
        "session_leader": leads_session(pid),
        "host": this_host(),
    }
    atomic_write_text(Path(folder) / PID, json.dumps(info))
    return info


def read_pid_info(folder: str | os.PathLike) -> dict | None:
    """{"pid", "start_time", ...} (an old plain-number pid file gives start_time None); None when absent."""
    try:
        text = _read_small(Path(folder) / PID).strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text.isdigit():
        return {"pid": int(text), "start_time": None}
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def _read_small(path: Path, limit: int = 4096) -> str:
    """A small regular file's text; never blocks on a FIFO nor reads a device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, limit).decode("utf-8")
    finally:
        os.close(fd)


# ---- the folder's lock ----------------------------------------------------------------------------------------


def _try_flock(fd: int) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def other_owner(folder: str | os.PathLike, mine: int | None = None) -> dict | None:
    """The recorded owner (pid info) when it is another process that still runs and holds the folder's lock open,
    else None. Without a record (its pid file deleted), a live process whose command line names the folder and
    that holds the folder's lock. `mine`: the lock descriptor this process holds (claim), never another's."""
    info = read_pid_info(folder)
    if info is None:
        return find_owner(folder, mine=mine)
    if info["pid"] == os.getpid() or not same_process(info) or not holds_lock(info["pid"], folder, mine):
        return None
    return info


def holds_lock(pid: int, folder: str | os.PathLike, mine: int | None = None) -> bool:
    """The process has the folder's lock file open -- the one there now, or one deleted under it -- and that file
    is locked: what every owner does for its whole life, and what a process that only names the folder (its
    wrapper, a second start still waiting for the lock, an unrelated pid written into a forged pid file) does not.
    The file `mine` (this process's own lock descriptor) never counts. Where /proc cannot be read (another OS),
    every process counts, as before this check."""
    lock = os.path.abspath(Path(folder) / LOCK)
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except PermissionError:
        return True  # another user's process: it may be the owner, and nothing here can signal it anyway
    except OSError:
        return not os.path.isdir("/proc/self/fd")
    own = None
    if mine is not None:
        with contextlib.suppress(OSError):
            st = os.fstat(mine)
            own = (st.st_dev, st.st_ino)
    for name in fds:
        path = f"{fd_dir}/{name}"
        try:
            if os.readlink(path) not in (lock, lock + " (deleted)"):
                continue
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == own:
                continue
            probe = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            # held: by this process, which has it open (a file deleted under its owner has no other holder)
            if not _try_flock(probe):
                return True
        finally:
            os.close(probe)  # a probe that got the lock lets go of it at once
    return False


# How an owner's command line names its folder (core.train, its supervisor and ranks)
OWNER_FLAG = "--run-dir"


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
    return None


def find_owner(folder: str | os.PathLike, flag: str = OWNER_FLAG, mine: int | None = None) -> dict | None:
    """The pid info of the live process of this machine that owns `folder` by its command line (`flag FOLDER` or
    `flag=FOLDER`, relative to its working directory) when the folder's own records are gone: one that holds the
    folder's lock (holds_lock), the oldest if several. This process and its ancestors never count (a wrapper such
    as `timeout` or `/usr/bin/time` names the folder too), nor does a process of another machine of the run
    (machine K > 0 names the run folder but holds only machines/machine-K's lock). A scan of this user's
    processes: only for a folder without a pid record."""
    try:
        target = Path(folder).resolve()
    except (OSError, RuntimeError):
        return None
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in _parents(me))}
    infos = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            argv, pid = proc.info["cmdline"] or [], proc.info["pid"]
            named = _flag_value(argv, flag)
            # cheap tests first: the process's cwd and a resolve only for a matching folder name
            if pid in skip or not named or Path(named).name != target.name:
                continue
            path = Path(named) if os.path.isabs(named) else Path(proc.cwd()) / named
            if path.resolve() != target or not holds_lock(pid, target, mine):
                continue
        except (psutil.Error, OSError, RuntimeError):
            continue
        if (t := process_start_time(pid)) is not None:
            infos.append(
                {"pid": pid, "start_time": t, "session_leader": leads_session(pid), "host": this_host()}
            )
    return min(infos, key=lambda i: i["start_time"]) if infos else None


def owner_info(folder: str | os.PathLike) -> dict | None:
    """Who owns the folder, as every reader asks it: its pid record, or (that file deleted) the live process its
    command line names (find_owner). A check that reads only the record misses an owner the others still see."""
    return read_pid_info(folder) or find_owner(folder)


def _parents(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.parents()
    except psutil.Error:
        return []


def claim(folder: str | os.PathLike, wait_s: float = 1.0, label: str | None = None) -> int:
    """Take the folder's lock: an open fd that holds it (keep it open for the owner's life), or raise Busy.

    Busy too when the recorded owner (pid + start time) still runs: its lock file was deleted under it. Retries
    for `wait_s` (a reader testing the lock holds it for microseconds; an owner may be exiting)."""
    path = Path(folder) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        owner = None
        if _try_flock(fd):
            owner = other_owner(folder, mine=fd)
            if owner is None:
                return fd
        if time.monotonic() > deadline:
            os.close(fd)
            owner = owner or read_pid_info(folder)
            pid = owner["pid"] if owner else None
            who = f" (pid {pid})" if pid else ""
            raise Busy(f"{label or Path(folder).name} is already running{who}.", pid)
        time.sleep(0.02)


def adopt_claim() -> int | None:
    """The lock fd a launcher handed down ($LORA_COCKPIT_LOCK_FD), still locked by the same open file."""
    value = os.environ.pop(LOCK_FD_ENV, None)
    if not value or not value.isdigit():
        return None
    fd = int(value)
    try:
        os.fstat(fd)
    except OSError:
        return None
    os.set_inheritable(fd, False)  # data loader workers and other children must not keep the folder "alive"
    return fd


def disown(folder: str | os.PathLike, fd: int) -> None:
    """An owner that ends without exiting (work run inside a longer-lived process): drop its pid record, then
    its lock, so the folder reads as ended from here on."""
    info = read_pid_info(folder)
    if info and info["pid"] == os.getpid():
        with contextlib.suppress(OSError):
            (Path(folder) / PID).unlink()
    os.close(fd)


def lock_held(folder: str | os.PathLike) -> bool:
    """A process holds FOLDER/lock."""
    try:
        fd = os.open(Path(folder) / LOCK, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return not _try_flock(fd)  # got it: nobody holds it (closing the fd below releases it at once)
    finally:
        os.close(fd)


def alive(folder: str | os.PathLike) -> bool:
    """The one liveness check of a folder's owner: its lock is held, or the recorded process (pid + start time)
    still runs (someone deleted the lock file under it). This process's own record counts only with the lock."""
    reap()
    if not lock_held(folder):
        return other_owner(folder) is not None
    info = read_pid_info(folder)
    if info and info["pid"] != os.getpid() and not same_process(info):
        # the recorded process is gone (or a zombie) while the lock is still held: the kernel is still tearing
        # down its threads and files, or a forked child still shares it; that goes within moments. (A launcher
        # that has just spawned an owner records it at once.)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if not lock_held(folder):
                return False
    return True


# ---- spawning and reaping ---------------------------------------------------------------------------------------

_children: list[subprocess.Popen] = []  # processes spawned here, reaped as they end (no zombies in a server)


def spawn(
    folder: str | os.PathLike, argv: list[str], lock_fd: int, cwd: str | os.PathLike | None = None
) -> int:
    """Start `argv` as the detached owner of `folder` (whose lock `lock_fd` holds); returns its pid.

    It runs in its own session (it outlives the caller and is stopped apart from it), stdin from /dev/null,
    stdout/stderr appended to FOLDER/stdout.log and stderr.log (files, never pipes: a full pipe would block it
    when nobody reads), with the lock descriptor kept open in it and named by $LORA_COCKPIT_LOCK_FD, and the
    starter's folder by $LORA_COCKPIT_START_DIR (enter_start_folder). Its pid is recorded before this returns.
    The caller closes its own `lock_fd` afterwards. OSError when it cannot start."""
    folder = Path(folder)
    start = os.environ.get(START_ENV) or os.getcwd()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{LOCK_FD_ENV: str(lock_fd), START_ENV: start})
    with open(folder / STDOUT, "ab") as out, open(folder / STDERR, "ab") as err:
        proc = subprocess.Popen(
            argv,
            cwd=None if cwd is None else str(cwd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            env=env,
            pass_fds=(lock_fd,),
        )
    _children.append(proc)
    write_pid_info(folder, proc.pid)
    return proc.pid


def enter_start_folder() -> None:
    """A child started by `spawn` (a trainer, a job) goes to its starter's folder: a data path typed as
    `mydata.jsonl` there is found here, and nothing the child writes by a relative name lands in the package."""
    folder = os.environ.get(START_ENV)
    if folder and os.path.isabs(folder) and os.path.isdir(folder):
        os.chdir(folder)


def reap() -> None:
    """Collect the children spawned here that have ended, so none lingers as a zombie."""
    for proc in list(_children):
        if proc.poll() is not None:
            _children.remove(proc)
