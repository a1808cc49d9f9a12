"""A run on several processes (`distributed` asks for more than one): the supervisor and its ranks.

The process the launcher (or a terminal) starts is the run's owner, as for one process: it holds the run's lock
and pid file for the run's whole life, sets the run directory up (config, plan, status) and then supervises: it
starts the ranks through the field's launcher — `accelerate launch --config_file <run>/accelerate.yaml` on GPUs,
`torch.distributed.run` (torchrun) on a machine without CUDA, where accelerate's CPU multi-process path falls back
to one process — and watches them. What each side does:

- ranks train; rank 0 alone writes status.json, metrics.jsonl (with every rank's memory) and samples; each rank
  writes its record `ranks/rank-K.json` (pid, start time, and how it ended) and rank K > 0 its output to
  `ranks/rank-K.log` (rank 0's goes to the run's stdout.log / stderr.log);
- a stop signal reaches the supervisor alone (core.stopping.stop), which passes it to every rank; the ranks agree on
  the step to stop at (an all-reduce of their flags at each step end: one rank leaving while another waits in a
  collective would hang both), save one checkpoint together and exit as stopped;
- a rank that dies without a word (SIGKILL, the out-of-memory killer, a segfault) is seen by the supervisor within
  a poll: the run is failed at once, naming the rank and its last lines, and the other ranks are ended;
- the supervisor's death ends its launcher and the ranks (PR_SET_PDEATHSIG down the chain): no rank outlives the
  lock, so a second trainer never meets a first one's leftovers.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from core import logtail, procs, rundir, stopping
from core.files import atomic_write_text, read_json_object
from core.recipe import distributed

SPEC_ENV = "LORA_COCKPIT_RANKS"  # what the supervisor hands every rank (JSON): run dir, checkpoint, strategy
RANKS = rundir.RANKS
MACHINES = "machines"  # in the run directory: machine-K/, what machine K > 0 of a run on several owns
POLL_S = 0.25
TAIL_LINES = 20
REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- the rank's side ------------------------------------------------------------------------------------------


def spec() -> dict | None:
    """The supervisor's hand-down when this process is one of a run's ranks, else None."""
    text = os.environ.get(SPEC_ENV)
    if not text or "RANK" not in os.environ:
        return None
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        if isinstance(data, dict) and isinstance(data.get("run_dir"), str):
            return data
    return None


def rank() -> int:
    """This process's global rank (0 without a launcher)."""
    with contextlib.suppress(ValueError):
        return int(os.environ.get("RANK", "0"))
    return 0


def world() -> int:
    with contextlib.suppress(ValueError):
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    return 1


def is_main() -> bool:
    return rank() == 0


def _record_path(run_dir: Path, k: int) -> Path:
    return Path(run_dir) / RANKS / f"rank-{k}.json"


def output_name(k: int) -> str:
    """Where rank K's output goes, in the run directory: rank 0's is the run's stderr.log."""
    return rundir.STDERR if k == 0 else f"{RANKS}/rank-{k}.log"


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel SIGKILLs this process when its parent dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def become_rank(run_dir: Path) -> None:
    """First thing a rank does: die with its launcher, put rank K > 0's output in ranks/rank-K.log, and record
    itself (the supervisor watches that record; it signals only ranks that have one, so after the stop handler
    is installed)."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the launcher died before the line above: nothing to train for
        os._exit(1)
    k = rank()
    if k > 0:
        fd = os.open(Path(run_dir) / output_name(k), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    me = os.getpid()
    machine = (spec() or {}).get("machine", 0)
    record = {
        "rank": k,
        "machine": machine,
        "pid": me,
        "start_time": procs.process_start_time(me),
        "ended": None,
    }
    atomic_write_text(_record_path(run_dir, k), json.dumps(record))


def end_rank(run_dir: Path, state: str, reason: str | None = None) -> None:
    """The rank's last word before it exits: finished / stopped / failed and why (the supervisor reads it)."""
    path = _record_path(run_dir, rank())
    record = read_json_object(path) or {"rank": rank(), "pid": os.getpid()}
    record["ended"] = {"state": state, "reason": reason, "time": time.time()}
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(record))


def agree(device, *flags: bool) -> list[bool]:
    """Each flag true on any rank is true on all (an all-reduce MAX); the flags as they are with one process."""
    if world() == 1:  # every step of every run: nothing to import or ask
        return [bool(f) for f in flags]
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def gather(device, values: list[float]) -> list[list[float]] | None:
    """Every rank's `values` (rank order), on every rank; None with one process."""
    if world() == 1:
        return None
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


# ---- the supervisor's side ------------------------------------------------------------------------------------


def launch_argv(
    cfg: dict, config_path: Path, run_dir: Path, on_cuda: bool, home: Path | None = None
) -> list[str]:
    """The command that starts every rank of this machine: accelerate with this machine's accelerate.yaml (in
    `home`, the folder the supervisor owns: the run directory on the main machine) on GPUs, torchrun on a machine
    without CUDA (gloo)."""
    d = cfg["distributed"]
    train = ["-m", "core.train", str(config_path), "--run-dir", str(run_dir)]
    if on_cuda:
        conf = Path(home or run_dir) / distributed.ACCELERATE_FILE
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(conf), *train]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={distributed.gpus_per_machine(cfg)}",
    ]
    if d["num_machines"] == 1 and d["main_process_port"] is None:
        # torchrun finds a free port itself: two runs of this box at once do not meet on 29500 (accelerate does
        # the same on GPUs when that port is taken)
        return [*argv, "--standalone", *train]
    argv += [
        f"--nnodes={d['num_machines']}",
        f"--node-rank={d['machine_rank']}",
        f"--master-addr={d['main_process_ip'] or '127.0.0.1'}",
        f"--master-port={d['main_process_port'] or 29500}",
    ]
    return [*argv, *train]


records = rundir.rank_records


def _clear(run_dir: Path, machine: int) -> None:
    """A new launch: this machine's records of the previous launch go (every rank's output stays, appended)."""
    folder = Path(run_dir) / RANKS
    folder.mkdir(exist_ok=True)
    for k in records(run_dir, machine):
        _record_path(run_dir, k).unlink(missing_ok=True)


def _dead(recs: dict[int, dict]) -> dict | None:
    """The first rank that is gone without its last word."""
    for k in sorted(recs):
        rec = recs[k]
        if not rec.get("ended") and not procs.same_process(rec):
            return rec
    return None


def _killed_reason(run_dir: Path, rec: dict) -> str:
    k = rec["rank"]
    step = (rundir.read_status(run_dir) or {}).get("step")
    where = output_name(k)
    return (
        f"rank {k} (pid {rec['pid']}) ended without a word at step {step or 0} (killed: SIGKILL, the "
        f"out-of-memory killer or a crash), so the other ranks were ended too; its last lines ({where}):\n"
        + logtail.tail_text(Path(run_dir) / where, TAIL_LINES)
    )


def _end_all(child: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank under it (a rank died: the others would wait for it for ever)."""
    stopping.kill_tree(child.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=30)


def supervise(
    cfg: dict, config_path: Path, run_dir: Path, home: Path, on_cuda: bool, handed: dict, stop
) -> str | None:
    """Start this machine's ranks and watch them until they end. Returns None when they ended well (and, on the
    main machine, rank 0 wrote the run's end state), else the reason the run failed (the caller writes it into
    `home`, the folder it owns). `handed` goes to every rank (checkpoint, strategy, ...); `stop` is the
    supervisor's StopFlag, passed on to the ranks once set."""
    machine = cfg["distributed"]["machine_rank"]
    _clear(run_dir, machine)
    argv = launch_argv(cfg, config_path, run_dir, on_cuda, home)
    print(f"launch: {shlex.join(argv)}", flush=True)
    spec_text = json.dumps({**handed, "run_dir": str(run_dir), "machine": machine})
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{SPEC_ENV: spec_text})
    env.pop(procs.LOCK_FD_ENV, None)
    # its own session: a Ctrl+C in the terminal reaches the supervisor alone, which stops the ranks in step
    child = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 (prctl only; the child has not run anything yet)
    )
    signalled: set[int] = set()
    failed = None
    while child.poll() is None:
        recs = records(run_dir, machine)
        if stop.signal:
            for rec in recs.values():
                if rec["pid"] not in signalled and not rec.get("ended") and procs.same_process(rec):
                    signalled.add(rec["pid"])
                    with contextlib.suppress(OSError):
                        os.kill(rec["pid"], signal.SIGTERM)
        dead = _dead(recs)
        if dead is not None and child.poll() is None:
            failed = _killed_reason(run_dir, dead)
            with contextlib.suppress(
                OSError
            ):  # at once: the next refresh shows it (unless the folder is gone)
                rundir.write_status(home, state="failed", reason=failed)
            _end_all(child)
            break
        time.sleep(POLL_S)
    return failed or _outcome(
        run_dir, child.returncode, distributed.gpus_per_machine(cfg), machine, child.pid
    )


def _outcome(run_dir: Path, returncode: int, here: int, machine: int, launcher_pid: int = 0) -> str | None:
    """After the launcher exited: None when this machine's `here` ranks ended well and (on the main machine) the
    run's end state is written, else why not. The launcher killed by a signal is named first: its ranks die with
    it, without a word of their own."""
    recs = records(run_dir, machine)
    if returncode < 0 and any(not r.get("ended") for r in recs.values()):
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        step = (rundir.read_status(run_dir) or {}).get("step")
        return (
            f"the launcher (torchrun, pid {launcher_pid}) was killed by {name} at step {step or 0} (from outside, or "
            "the out-of-memory killer), and its ranks ended with it."
        )
    dead = next((r for r in recs.values() if not r.get("ended")), None)
    if dead is not None:
        return _killed_reason(run_dir, dead)
    failures = [r for k, r in sorted(recs.items()) if r["ended"]["state"] == "failed"]
    if failures:
        first = failures[0]
        return f"rank {first['rank']}: {first['ended']['reason']}"
    state = (rundir.read_status(run_dir) or {}).get("state") if machine == 0 else "finished"
    if returncode == 0 and len(recs) == here and state in ("finished", "stopped"):
        return None
    return (
        f"the launcher exited with {returncode} and {len(recs)} of {here} ranks started; its last lines "
        f"(stderr.log):\n" + logtail.tail_text(Path(run_dir) / rundir.STDERR, TAIL_LINES)
    )
