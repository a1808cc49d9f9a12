"""core.procs, the one process lifecycle, with real processes and real files: spawn with the folder's lock handed
down, liveness by lock and by pid + start time, stop (SIGTERM to the owner alone, then SIGKILL to its tree),
reaping, a tail that never blocks, the stale-temp cleaner, and a stall seen by the run directory's reader."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from core import logtail, procs, rundir, stopping, tempdirs
from core.runs.launcher import run_state

REPO = Path(__file__).resolve().parents[1]

# A folder's owner as small as it gets: takes (or adopts) the lock, records itself, then waits. "term": says bye on
# SIGTERM and exits 0; "ignore": ignores SIGTERM and has a child of its own.
OWNER = """
import os, signal, subprocess, sys, time
from core import procs

folder, mode = sys.argv[1], sys.argv[2]
fd = procs.adopt_claim() or procs.claim(folder)
procs.write_pid_info(folder)
child = None
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "300"])
elif mode == "parent":  # like a supervisor: on SIGTERM it ends its child and waits for it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    def end_child(*_):
        child.terminate()
        child.wait()
        sys.exit(0)
    signal.signal(signal.SIGTERM, end_child)
else:
    def bye(*_):
        print("bye", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
with open(os.path.join(folder, "ready.tmp"), "w") as fh:
    fh.write(str(child.pid) if child else "")
os.replace(os.path.join(folder, "ready.tmp"), os.path.join(folder, "ready"))
while True:
    time.sleep(0.05)
"""


def wait_until(predicate, timeout=60.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture()
def owner_script(tmp_path) -> Path:
    path = tmp_path / "owner.py"
    path.write_text(OWNER)
    return path


def _spawn_owner(folder: Path, script: Path, mode: str = "term", *extra: str) -> int:
    folder.mkdir(exist_ok=True)
    fd = procs.claim(folder)
    try:
        pid = procs.spawn(folder, [sys.executable, str(script), str(folder), mode, *extra], fd, cwd=REPO)
    finally:
        os.close(fd)
    assert wait_until(lambda: (folder / "ready").exists()), logtail.tail_text(folder / procs.STDERR)
    return pid


@pytest.fixture(autouse=True)
def _pythonpath(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    yield
    for proc in psutil.process_iter(["cmdline"]):  # a failed test leaves no owner behind
        if any(str(tmp_path) in part for part in proc.info["cmdline"] or ()):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_spawned_owner_holds_the_folder_and_a_stop_ends_and_reaps_it(tmp_path, owner_script):
    folder = tmp_path / "job"
    pid = _spawn_owner(folder, owner_script)
    info = procs.read_pid_info(folder)
    assert info["pid"] == pid and info["session_leader"] is True and procs.same_process(info)
    assert procs.alive(folder) and procs.lock_held(folder)
    with pytest.raises(procs.Busy, match=f"already running \\(pid {pid}\\)"):
        procs.claim(folder, wait_s=0.2)
    assert stopping.stop(folder, grace_s=60) == "exited"
    assert not procs.alive(folder) and not procs.pid_alive(pid)
    assert not psutil.pid_exists(pid)  # reaped: no zombie left behind in this (server) process
    assert logtail.tail_text(folder / procs.STDOUT) == "bye"
    assert stopping.stop(folder) is None  # nothing left to stop
    os.close(procs.claim(folder))  # and the folder can be owned again


def test_an_owner_that_ignores_sigterm_is_killed_with_its_children(tmp_path, owner_script):
    folder = tmp_path / "stubborn"
    pid = _spawn_owner(folder, owner_script, "ignore")
    child = int((folder / "ready").read_text())
    assert procs.pid_alive(child)
    assert stopping.stop(folder, grace_s=1.0) == "killed"
    assert not procs.alive(folder) and not procs.pid_alive(pid)
    assert wait_until(lambda: not procs.pid_alive(child), 30)


def test_stop_reaches_the_owner_only_never_the_group_of_the_shell_that_started_it(tmp_path, owner_script):
    """#21 item 1 in small: `python owner.py; echo next` shares the shell's process group."""
    folder, marker = tmp_path / "from-shell", tmp_path / "marker"
    folder.mkdir()
    shell = subprocess.Popen(
        ["bash", "-c", f"{sys.executable} {owner_script} {folder} term; echo next > {marker}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # the shell leads the session and the group its owner runs in
    )
    try:
        assert wait_until(lambda: (folder / "ready").exists())
        info = procs.read_pid_info(folder)
        assert info["session_leader"] is False and os.getpgid(info["pid"]) == shell.pid
        assert stopping.stop(folder, grace_s=60) == "exited"
        assert shell.wait(timeout=60) == 0 and marker.read_text().strip() == "next"
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()


def test_a_deleted_lock_file_does_not_make_a_live_owner_dead(tmp_path, owner_script):
    """#21 item 2 in small: the recorded pid + start time keep the folder owned."""
    folder = tmp_path / "unlocked"
    pid = _spawn_owner(folder, owner_script)
    (folder / procs.LOCK).unlink()
    assert procs.alive(folder) and not procs.lock_held(folder)
    with pytest.raises(procs.Busy) as refused:
        procs.claim(folder, wait_s=0.2)
    assert refused.value.pid == pid
    assert not procs.lock_held(folder)  # the refused claim let go of the new lock file
    assert stopping.stop(folder, grace_s=60) == "exited" and not procs.pid_alive(pid)
    assert not procs.alive(folder)


def test_an_owner_whose_lock_and_pid_files_were_deleted_is_found_by_its_command_line(tmp_path, owner_script):
    """Both records gone: the owner still holds the folder (no second owner, no delete of a live run), is seen
    alive and is stopped -- found by the `--run-dir FOLDER` of its command line, as core.train is."""
    folder = tmp_path / "bare"
    pid = _spawn_owner(folder, owner_script, "term", "--run-dir", str(folder))
    (folder / procs.LOCK).unlink()
    (folder / procs.PID).unlink()
    rundir.write_status(folder, state="running", step=3)
    assert procs.find_owner(folder)["pid"] == pid
    assert procs.alive(folder)
    with pytest.raises(procs.Busy) as refused:
        procs.claim(folder, wait_s=0.2)
    assert refused.value.pid == pid
    info = run_state(folder)
    assert (info.state, info.alive, info.pid) == ("running", True, pid)
    assert procs.find_owner(tmp_path / "other") is None  # another folder names no owner
    # machine 1 of a run on two machines names the run folder too, but owns only machines/machine-1 in it
    second = tmp_path / "second"
    _spawn_owner(second, owner_script, "term", "--run-dir", str(folder), "--machine-rank", "1")
    assert procs.find_owner(folder)["pid"] == pid
    assert stopping.stop(folder, grace_s=60) == "exited" and not procs.pid_alive(pid)
    assert not procs.alive(folder)


def test_a_pid_record_without_start_time_names_no_process(tmp_path):
    """An old plain-number pid file (or a hand-written one) whose pid another process now has: that process is
    neither the owner nor signalled by a stop."""
    folder = tmp_path / "old"
    folder.mkdir()
    other = subprocess.Popen(["sleep", "300"])
    try:
        for text in (str(other.pid), json.dumps({"pid": other.pid})):
            (folder / procs.PID).write_text(text)
            assert not procs.alive(folder)
            assert stopping.stop(folder, grace_s=1) is None
            assert other.poll() is None  # untouched
    finally:
        other.kill()
        other.wait()


def test_a_stop_continues_a_stopped_child_its_owner_waits_for(tmp_path, owner_script):
    """One rank stopped (SIGSTOP, a debugger): the supervisor ends it on SIGTERM and waits; a stop continues every
    stopped process of the tree so that it exits and checkpoints, instead of being killed at the grace's end."""
    folder = tmp_path / "supervisor"
    _spawn_owner(folder, owner_script, "parent")
    child = int((folder / "ready").read_text())
    os.kill(child, signal.SIGSTOP)
    assert wait_until(lambda: procs.is_stopped(child), 30)
    assert stopping.stop(folder, grace_s=20) == "exited"
    assert not procs.pid_alive(child)


def test_a_stopped_rank_is_a_stall_at_once_and_a_stopped_supervisor_is_not(tmp_path):
    folder = tmp_path / "ranked"
    (folder / rundir.RANKS).mkdir(parents=True)
    rank = subprocess.Popen(["sleep", "300"])
    try:
        record = {"rank": 1, "pid": rank.pid, "start_time": procs.process_start_time(rank.pid), "ended": None}
        (folder / rundir.RANKS / "rank-1.json").write_text(json.dumps(record))
        procs.write_pid_info(folder)  # this process as the owner (the supervisor)
        status = rundir.write_status(folder, state="running", step=5)
        assert rundir.stall(folder, status, "running", True) == (None, None)
        os.kill(rank.pid, signal.SIGSTOP)
        assert wait_until(lambda: procs.is_stopped(rank.pid), 30)
        quiet, why = rundir.stall(folder, status, "running", True)
        assert why.endswith("(rank 1 stopped)"), why
    finally:
        rank.kill()
        rank.wait()


def test_a_stopped_process_is_seen_stopped_and_a_stop_wakes_it_to_exit(tmp_path, owner_script):
    folder = tmp_path / "paused"
    pid = _spawn_owner(folder, owner_script)
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: procs.is_stopped(pid), 30) and procs.alive(folder)
    os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: not procs.is_stopped(pid), 30)
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: procs.is_stopped(pid), 30)
    assert stopping.stop(folder, grace_s=60) == "exited"  # not killed: continued, it handled its SIGTERM


def test_a_live_run_that_stopped_reporting_reads_as_stalled(tmp_path, owner_script):
    """#21 item 6 by time: alive, running, but no step for far longer than its usual step."""
    run_dir = tmp_path / "hung"
    _spawn_owner(run_dir, owner_script)
    now = time.time()
    status = {"state": "running", "step": 40, "step_s": 2.0, "started": now - 900, "updated": now - 500}
    (run_dir / rundir.STATUS).write_text(json.dumps(status))
    before = (run_dir / rundir.STATUS).read_bytes()
    info = run_state(run_dir)
    assert (info.state, info.alive) == ("running", True)
    assert info.stalled_s >= 500 and info.stall == "no step for 8 min; a step usually takes 2 s"
    # within ten usual steps (and two minutes) it is not
    (run_dir / rundir.STATUS).write_text(json.dumps({**status, "updated": time.time() - 60}))
    assert run_state(run_dir).stall is None
    # a slow step (30 s) moves the limit: 10 x 30 s
    (run_dir / rundir.STATUS).write_text(json.dumps({**status, "step_s": 30.0, "updated": time.time() - 250}))
    assert run_state(run_dir).stall is None
    (run_dir / rundir.STATUS).write_bytes(before)
    assert run_state(run_dir).stall is not None
    assert (run_dir / rundir.STATUS).read_bytes() == before  # reading wrote nothing
    stopping.stop(run_dir, grace_s=60)
    assert (
        run_state(run_dir).stall is None
    )  # no process, no stall (it reads as failed: it never said it ended)


def test_tail_reads_only_regular_files_and_never_blocks(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text("".join(f"line {i}\n" for i in range(5000)))
    assert logtail.tail_text(log, n_lines=2) == "line 4998\nline 4999"
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.log"
    zero.symlink_to("/dev/zero")
    # in a child process, so that a regression hangs or eats memory there, bounded by the timeout
    code = (
        "import sys; from core.logtail import tail_text; "
        "print(repr(tail_text(sys.argv[1])), repr(tail_text(sys.argv[2])), repr(tail_text(sys.argv[3])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(fifo), str(zero), str(tmp_path / "missing")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.split() == ["''", "''", "''"], out.stderr


def test_stale_temps_are_removed_only_when_marked_and_their_owner_is_gone(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(done.stdout)
    dead = tmp_path / ".out.1.partial"
    dead.mkdir()
    (dead / tempdirs.TEMP_OWNER).write_text(json.dumps({"pid": dead_pid, "start_time": time.time() - 5}))
    unmarked = tmp_path / ".out.2.partial"  # not ours: never touched
    unmarked.mkdir()
    other = tmp_path / ".out.3.partial"  # another live process's (the parent of this test)
    other.mkdir()
    parent = psutil.Process().parent()
    (other / tempdirs.TEMP_OWNER).write_text(
        json.dumps({"pid": parent.pid, "start_time": parent.create_time()})
    )
    mine = tmp_path / ".out.4.partial"
    mine.mkdir()
    tempdirs.mark_temp(mine)
    assert tempdirs.clean_stale_temps(tmp_path, ".out.*.partial") == [dead]
    assert unmarked.is_dir() and other.is_dir() and mine.is_dir()
    tempdirs.unmark_temp(mine)  # this process no longer works in it (a failed rename, say)
    assert tempdirs.clean_stale_temps(tmp_path, ".out.*.partial") == [mine]


# A start as core.train does it when no launcher handed it a lock: wait for the go file (so that racing starts meet
# at claim), claim, record, say "owner" and hold; or print the refusal and exit 2.
STARTER = """
import os, sys, time
from core import procs

folder, go = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.005)
try:
    fd = procs.claim(folder)
except procs.Busy as exc:
    print(exc, flush=True)
    sys.exit(2)
procs.write_pid_info(folder)
print("owner", flush=True)
time.sleep(300)
"""


def _start(tmp_path, folder: Path, go: Path, *wrapper: str) -> subprocess.Popen:
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    argv = [*wrapper, sys.executable, str(script), str(folder), str(go), procs.OWNER_FLAG, str(folder)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    "wrapper",
    [("timeout", "300"), ("sh", "-c", 'timeout 300 "$@"; true', "sh")],
    ids=["timeout", "a-shell-that-forks"],
)
def test_a_start_under_a_wrapper_that_names_the_folder_owns_it(tmp_path, wrapper):
    """#42: `timeout 300 python -m core.train … --run-dir D` refused itself, its wrapper `timeout` counting as the
    folder's owner. A process's own ancestors never own its folder."""
    folder, go = tmp_path / "wrapped", tmp_path / "go"
    folder.mkdir()
    go.touch()
    proc = _start(tmp_path, folder, go, *wrapper)
    try:
        assert proc.stdout.readline().strip() == "owner"
        info = procs.read_pid_info(folder)
        assert procs.alive(folder) and info["pid"] != proc.pid  # the trainer, not its wrapper
    finally:
        proc.kill()
        proc.wait()


def test_of_two_starts_at_once_exactly_one_owns_the_folder_and_the_other_names_it(tmp_path):
    """#42: two starts on one folder at the same moment both refused, each naming the other (each saw the other's
    command line). The one that takes the lock owns it; the other waits, then refuses naming the winner."""
    for attempt in range(10):
        folder, go = tmp_path / f"race-{attempt}", tmp_path / f"go-{attempt}"
        folder.mkdir()
        pair = [_start(tmp_path, folder, go) for _ in range(2)]
        try:
            time.sleep(0.3)  # both past their imports, polling for the go file
            go.touch()
            first = [p.stdout.readline().strip() for p in pair]
            winners = [p for p, line in zip(pair, first, strict=True) if line == "owner"]
            assert len(winners) == 1, (attempt, first)
            loser = next(p for p in pair if p is not winners[0])
            assert loser.wait(30) == 2
            assert f"(pid {winners[0].pid})" in next(line for line in first if line != "owner")
            assert procs.read_pid_info(folder)["pid"] == winners[0].pid and procs.alive(folder)
        finally:
            for p in pair:
                p.kill()
                p.wait()


def test_a_pid_file_naming_an_unrelated_live_process_is_no_owner(tmp_path):
    """#42: a pid file forged with the pid and start time of a live `sleep` made the folder read alive, and a stop
    would have signalled that sleep. An owner holds the folder's lock open; the sleep does not."""
    folder = tmp_path / "forged"
    folder.mkdir()
    (folder / procs.LOCK).touch()
    other = subprocess.Popen(["sleep", "300"])
    try:
        procs.write_pid_info(folder, other.pid)
        assert procs.same_process(procs.read_pid_info(folder))  # the record names that process exactly
        assert not procs.alive(folder)
        assert stopping.stop(folder, grace_s=1) is None and other.poll() is None
        fd = procs.claim(folder, wait_s=0.2)  # a new owner gets in
        os.close(fd)
        rundir.write_status(folder, state="running", step=3)
        info = run_state(folder)
        assert (info.state, info.alive) == ("failed", False)
    finally:
        other.kill()
        other.wait()


def test_the_run_watcher_warns_of_a_stopped_trainer_and_says_deleted_when_its_folder_goes(
    tmp_path, owner_script
):
    """#42 §5: the page and `show` reported a SIGSTOPped trainer's stall while RunWatcher's own warnings list stayed
    empty; after `rm -rf` of the run folder the watcher read "unknown"."""
    import shutil

    from core.monitor.watch import RunWatcher

    run_dir = tmp_path / "sleepy"
    pid = _spawn_owner(run_dir, owner_script)
    now = time.time()
    status = {"state": "running", "step": 4, "step_s": 1.0, "started": now - 60, "updated": now - 5}
    (run_dir / rundir.STATUS).write_text(json.dumps(status))
    watcher = RunWatcher(run_dir)
    assert [w.code for w in watcher.refresh().warnings] == []
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: procs.is_stopped(pid))
        snap = watcher.refresh()
        assert snap.stall and "process stopped" in snap.stall
        stalled = [w for w in snap.warnings if w.code == "stalled"]
        assert len(stalled) == 1 and stalled[0].detail == snap.stall
    finally:
        stopping.stop(run_dir, grace_s=60)
    shutil.rmtree(run_dir)
    assert watcher.refresh().state == "deleted"


@pytest.mark.parametrize("deleted", [(procs.PID,), (procs.PID, procs.LOCK)])
def test_a_stopped_owner_found_by_its_command_line_is_a_stall(tmp_path, owner_script, deleted):
    """#38 item 7: a SIGSTOPped trainer whose pid file is gone (the lock file too) read plain `running`: the
    listing found its pid by the `--run-dir` of its command line, the stopped-process rule read only the pid
    file. Both now ask the same question (procs.owner_info)."""
    run_dir = tmp_path / "bare"
    pid = _spawn_owner(run_dir, owner_script, "term", "--run-dir", str(run_dir))
    rundir.write_status(run_dir, state="running", step=4, step_s=1.0)
    for name in deleted:
        (run_dir / name).unlink()
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: procs.is_stopped(pid))
        info = run_state(run_dir)
        assert (info.state, info.alive, info.pid) == ("running", True, pid)
        assert info.stall and info.stall.endswith("(process stopped)"), info
    finally:
        assert (
            stopping.stop(run_dir, grace_s=60) == "exited"
        )  # found the same way, and continued to act on it
    assert not procs.pid_alive(pid)
