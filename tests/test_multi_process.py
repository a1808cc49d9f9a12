"""Issue #22 item 3 on this GPU-less box: a run on two processes (DDP over gloo, started by torchrun as the run's
supervisor starts it on a machine without CUDA), launched, stopped, resumed and killed the way users do it.

Real trainers on the tiny model, real subprocesses and files; nothing is timed (timeouts are generous)."""

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml
from test_runs import run_config, wait_until

from core import checkpoints, rundir
from core.monitor.watch import RunWatcher
from core.recipe.config import validate_config
from core.runs.launcher import RunError, create_run, launch, run_state, stop_run
from core.train import ranks
from tests.browser import free_port
from tests.cli import train

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch, workspace):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    for proc in psutil.process_iter(["cmdline"]):  # a failed test leaves no rank behind
        if any(str(workspace) in part for part in proc.info["cmdline"] or ()):
            proc.kill()


def _config(workspace, model, gpus: int, batch: int, **training) -> dict:
    cfg = run_config(workspace, model, per_device_train_batch_size=batch, **training)
    cfg["lora"]["lora_dropout"] = 0.0  # dropout draws differ per rank: without it the arithmetic is the same
    cfg["distributed"] = {"gpus": gpus}
    return validate_config(cfg)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines()]


def _processes_of(run_dir: Path) -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(str(run_dir) in part for part in p.info["cmdline"] or ())
    ]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_llama) -> Path:
    """The reference: one process, 8 steps of 4 rows (the data's content is the same in every workspace)."""
    ws = tmp_path_factory.mktemp("one_process")
    run_dir = ws / "runs" / "one"
    out = train(_config(ws, tiny_llama, 1, 4, max_steps=8, logging_steps=1), run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def _same_curve(reference: Path, run_dir: Path) -> None:
    pairs = zip(_metrics(reference), _metrics(run_dir), strict=True)
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in pairs), (_metrics(reference), _metrics(run_dir))


def test_two_processes_train_as_one_at_the_same_global_batch(workspace, tiny_llama, one_process):
    """Same loss curve as one process at the same global batch (2 x 2 rows against 1 x 4), metrics written once
    (by rank 0, with rank 1's memory), each rank's output kept, one adapter."""
    runs = {"one": one_process, "two": workspace / "runs" / "two"}
    with _port_taken(29500):  # another run of this box holds the default port: this one finds a free one
        out = train(_config(workspace, tiny_llama, 2, 2, max_steps=8, logging_steps=1), runs["two"])
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = (_metrics(runs[n]) for n in ("one", "two"))
    _same_curve(one_process, runs["two"])
    assert [r["step"] for r in two] == list(range(1, 9))  # once per logging step, not once per rank
    assert all("rank1_rss_bytes" in r and r["rank1_rss_bytes"] > 0 for r in two)
    assert not any(k.startswith("rank1_") for r in one for k in r)
    recs = ranks.records(runs["two"])
    assert sorted(recs) == [0, 1] and all(r["ended"]["state"] == "finished" for r in recs.values())
    assert "core.train: pid" in (runs["two"] / "ranks" / "rank-1.log").read_text()
    assert rundir.read_status(runs["two"])["state"] == "finished"
    adapter = runs["two"] / rundir.ADAPTER
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "training_args.bin").exists()
    assert _processes_of(runs["two"]) == []
    # the Monitor draws one memory line per process from rank 0's lines; a run on one process keeps its one line
    cpu = RunWatcher(runs["two"]).refresh().charts["cpu_memory"]
    assert set(cpu["series"]) == {"rank 0 (RSS)", "rank 1 (RSS)"} and (cpu["value"] > 0).all()
    assert set(RunWatcher(runs["one"]).refresh().charts["cpu_memory"]["series"]) == {"training process (RSS)"}


@contextlib.contextmanager
def _port_taken(port: int):
    """Listen on `port` of 127.0.0.1 meanwhile (if something else already does, it is taken all the same)."""
    import socket

    with socket.socket() as sock:
        with contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            sock.listen()
        yield


SRUN = """#!/bin/bash
# srun on one box: the job's one task a node, on two "nodes" at once
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=1 "$@" & worker=$!
SLURM_NODEID=0 "$@"; main=$?
wait $worker; exit $((main | $?))
"""


def test_two_machines_on_one_box_train_one_run_from_the_exported_slurm_script(
    workspace, tiny_llama, one_process
):
    """A run on two "machines": `core.runs export NAME --slurm` writes the sbatch script, run here with srun and
    scontrol stand-ins (the only fakes: no cluster) so that its one task a node starts on two nodes of one box,
    --machine-rank 0 and 1, torchrun --nnodes 2 meeting on 127.0.0.1, one run directory as on shared storage.
    Machine 1 owns machines/machine-1/, the main machine the run; the loss is one process's at that global batch."""
    import stat
    import subprocess

    from tests.cli import runs as runs_cli

    cfg = _config(workspace, tiny_llama, 1, 2, max_steps=8, logging_steps=1)
    cfg["distributed"].update(num_machines=2, main_process_ip="127.0.0.1", main_process_port=free_port())
    run_dir = create_run(workspace, "nodes", cfg)
    out = runs_cli(workspace, "export", "nodes", "--slurm")
    assert out.returncode == 0, out.stderr
    script = Path(out.stdout.strip())
    assert script == run_dir / "slurm.sbatch"
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=1" in text and "--machine-rank" in text
    shims = workspace / "bin"
    shims.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n")):
        (shims / name).write_text(body)
        (shims / name).chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-2]")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert rundir.read_status(run_dir)["state"] == "finished"
    assert rundir.read_status(run_dir / "machines" / "machine-1")["state"] == "finished"
    assert {k: r["machine"] for k, r in ranks.records(run_dir).items()} == {0: 0, 1: 1}
    assert runs_cli(workspace, "export", "nodes", "--slurm").stdout.strip().endswith("slurm-2.sbatch")
    assert script.read_text() == text  # the first script (perhaps edited) is kept
    _same_curve(one_process, run_dir)


def test_stop_checkpoints_every_rank_resume_continues_and_a_killed_rank_fails_the_run(workspace, tiny_llama):
    """The launcher's Stop: every rank stops at the same step and one checkpoint holds both ranks' state; Resume
    continues from it on two processes (another number is refused with a sentence); SIGKILL of rank 1 shows the
    run failed at once, with that rank's last lines, and no process of the run is left."""
    cfg = _config(workspace, tiny_llama, 2, 2, max_steps=5000, save_steps=1000, logging_steps=5)
    run_dir = create_run(workspace, "ddp", cfg)
    launch(run_dir)
    assert wait_until(lambda: run_state(run_dir).step >= 10, 300), run_state(run_dir)
    assert stop_run(run_dir) == "stopped"
    status = rundir.read_status(run_dir)
    step = status["step"]
    assert "stopped by SIGTERM" in status["reason"]
    checkpoint = checkpoints.latest_checkpoint(run_dir)
    assert checkpoint.name == f"checkpoint-{step}"
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    assert all(r["ended"]["state"] == "stopped" for r in ranks.records(run_dir).values())
    assert _processes_of(run_dir) == []

    # another world size: refused before anything starts, with the way out
    changed = dict(cfg, distributed={**cfg["distributed"], "gpus": 1})
    (run_dir / rundir.CONFIG).write_text(yaml.safe_dump(changed))
    with pytest.raises(RunError, match="trained by 2 processes and this config starts 1"):
        launch(run_dir, resume=True)
    (run_dir / rundir.CONFIG).write_text(yaml.safe_dump(cfg))

    launch(run_dir, resume=True)
    assert wait_until(lambda: run_state(run_dir).step >= step + 10, 300), run_state(run_dir)
    recs = ranks.records(run_dir)
    assert sorted(recs) == [0, 1]
    os.kill(recs[1]["pid"], signal.SIGKILL)
    killed = time.time()
    assert wait_until(lambda: run_state(run_dir).state == "failed", 30)
    reason = run_state(run_dir).reason
    assert f"rank 1 (pid {recs[1]['pid']}) ended without a word" in reason and "ranks/rank-1.log" in reason
    assert "core.train: pid" in reason  # the rank's own last lines
    # failed is written at once; the supervisor then ends the launcher and its ranks and exits
    assert wait_until(lambda: not run_state(run_dir).alive, 60)
    assert _processes_of(run_dir) == [], "a rank outlived the run"
    assert time.time() - killed < 60
    steps = [r["step"] for r in _metrics(run_dir)]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)  # the resume's lines follow the stop's
    assert max(steps) > step


def test_a_killed_supervisor_takes_its_ranks_with_it(workspace, tiny_llama):
    """SIGKILL of the process that owns the run (the OOM killer's usual pick: the biggest is a rank, but any can
    go): the lock is released, so no rank may outlive it — a Resume would otherwise meet a first trainer's ranks
    still writing into the folder."""
    cfg = _config(workspace, tiny_llama, 2, 2, max_steps=5000, save_steps=1000, logging_steps=5)
    run_dir = create_run(workspace, "orphans", cfg)
    owner = launch(run_dir)
    assert wait_until(lambda: run_state(run_dir).step >= 5, 300), run_state(run_dir)
    assert sorted(ranks.records(run_dir)) == [0, 1]
    os.kill(owner, signal.SIGKILL)
    assert wait_until(lambda: _processes_of(run_dir) == [], 30), "a rank outlived its supervisor"
    info = run_state(run_dir)
    assert (info.state, info.alive) == ("failed", False)


def test_the_smoke_test_of_a_run_on_two_gpus_is_one_process_planned_as_one(workspace, tiny_llama):
    from core.runs.launcher import wait_for_smoke

    run_dir = create_run(workspace, "smoke2", _config(workspace, tiny_llama, 2, 2))
    launch(run_dir, smoke=True)
    result = wait_for_smoke(run_dir, timeout=300)
    assert result["state"] == "finished", result
    assert result["estimate_bytes"] and result["peak_bytes"]  # the plan of the one process it measured
    assert not (run_dir / ranks.RANKS).exists()


def test_a_run_folder_deleted_under_two_ranks_stops_both_and_recreates_nothing(workspace, tiny_llama):
    import shutil

    cfg = _config(workspace, tiny_llama, 2, 2, max_steps=5000, save_steps=1000, logging_steps=5)
    run_dir = create_run(workspace, "deleted", cfg)
    launch(run_dir)
    assert wait_until(lambda: run_state(run_dir).step >= 5, 300), run_state(run_dir)
    assert len(_processes_of(run_dir)) >= 3  # the supervisor, torchrun and two ranks
    shutil.rmtree(run_dir)
    # the ranks agree on the step to stop at (one alone would leave the other waiting in a collective)
    assert wait_until(lambda: _processes_of(run_dir) == [], 120), "a process kept training"
    assert not run_dir.exists()  # nothing wrote into it again


def test_a_killed_launcher_is_named_not_the_rank_that_died_with_it(tmp_path):
    """torchrun SIGKILLed alone: its ranks die with it without a word; the reason names the launcher."""
    (tmp_path / ranks.RANKS).mkdir()
    for k in (0, 1):
        rec = {"rank": k, "machine": 0, "pid": 10**6 + k, "start_time": 1.0, "ended": None}
        (tmp_path / ranks.RANKS / f"rank-{k}.json").write_text(json.dumps(rec))
    reason = ranks._outcome(tmp_path, -9, 2, 0, 4242)
    assert reason.startswith("the launcher (torchrun, pid 4242) was killed by SIGKILL"), reason
    # a launcher that exited by itself with ranks gone silent: those ranks are the reason, as before
    assert ranks._outcome(tmp_path, 1, 2, 0, 4242).startswith("rank 0 (pid 1000000) ended without a word")
