"""The run queue (#37): its file edited by several processes at once, sweeps, and the supervisor with real runs on
the CPU: one after another, a failure diagnosed and the queue going on, a kill -9 of the supervisor and an app
start that resume it with nothing lost or doubled, and a full disk that stops the queue with a sentence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_runs import run_config, wait_until

from core.recipe.config import ConfigError
from core.runs import queue as Q
from core.runs import sweep as S
from core.runs.launcher import run_state

ROOT = Path(__file__).resolve().parents[1]


def _entry_keys():
    return {
        "id", "name", "state", "run", "method", "verdict", "planned_bytes", "device", "added", "started", "ended",
        "reason", "diagnosis", "sweep",
    }  # fmt: skip


# ---- the queue file --------------------------------------------------------------------------------------------


ADDER = """
import sys
from core.runs import queue as Q
ws, who = sys.argv[1], sys.argv[2]
for i in range(15):
    Q.add(ws, {"method": "sft"}, f"{who}-{i}")
"""


def test_two_processes_adding_at_once_lose_nothing(tmp_path):
    script = tmp_path / "adder.py"
    script.write_text(ADDER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), who], env=env) for who in "ab"]
    assert [p.wait(120) for p in procs] == [0, 0]
    entries = Q.read_queue(tmp_path).entries
    assert len(entries) == 30 and len({e.id for e in entries}) == 30
    assert {e.name for e in entries} == {f"{w}-{i}" for w in "ab" for i in range(15)}


def test_waiting_entries_move_and_cancel_and_the_json_keeps_its_shape(tmp_path):
    for name in ("one", "two", "three"):
        Q.add(tmp_path, {"method": "sft"}, name)
    assert [e.name for e in Q.move(tmp_path, "three", 1)] == ["three", "one", "two"]
    assert Q.remove(tmp_path, "q1").state == "cancelled"
    assert [e.name for e in Q.read_queue(tmp_path).waiting()] == ["three", "two"]
    with pytest.raises(Q.QueueError, match="already ended"):
        Q.remove(tmp_path, "q1")
    with pytest.raises(Q.QueueError, match="--to must be between 1 and 2"):
        Q.move(tmp_path, "two", 3)
    with pytest.raises(Q.QueueError, match="The name 'two' is taken"):
        Q.add(tmp_path, {}, "two")
    with pytest.raises(Q.QueueError, match="No queue entry 'q9'"):
        Q.remove(tmp_path, "q9")
    objs = [Q.entry_object(e) for e in Q.read_queue(tmp_path).entries]
    assert all(set(o) == _entry_keys() for o in objs)
    out = subprocess.run(
        [sys.executable, "-m", "core.runs", "queue", "ls", "--json"],
        cwd=ROOT,
        env=dict(os.environ, LORA_COCKPIT_WORKSPACE=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and json.loads(out.stdout) == objs


def test_a_broken_queue_file_is_one_sentence_and_is_never_emptied(tmp_path):
    Q.add(tmp_path, {"method": "sft"}, "kept")
    path = Q.queue_dir(tmp_path) / Q.STATE_FILE
    path.write_text(path.read_text()[:40])  # truncated
    before = path.read_bytes()
    with pytest.raises(Q.QueueError, match="is not a queue file .* move it aside"):
        Q.add(tmp_path, {"method": "sft"}, "more")
    assert path.read_bytes() == before


# ---- sweeps ------------------------------------------------------------------------------------------------------


def test_a_grid_sweep_is_every_combination_and_a_random_one_is_seeded():
    grid = S.points({"parameters": {"training.learning_rate": [1e-4, 3e-4], "lora.r": [8, 16]}})
    assert grid == [
        {"training.learning_rate": 1e-4, "lora.r": 8},
        {"training.learning_rate": 1e-4, "lora.r": 16},
        {"training.learning_rate": 3e-4, "lora.r": 8},
        {"training.learning_rate": 3e-4, "lora.r": 16},
    ]
    spec = {
        "method": "random",
        "trials": 5,
        "seed": 3,
        "parameters": {"training.learning_rate": {"min": 1e-5, "max": 1e-3, "log": True}, "lora.r": [8, 16]},
    }
    drawn = S.points(spec)
    assert drawn == S.points(spec) and len(drawn) == 5
    assert all(1e-5 <= p["training.learning_rate"] <= 1e-3 and p["lora.r"] in (8, 16) for p in drawn)
    assert S.label(grid[0]) == "learning_rate=0.0001, r=8"


@pytest.mark.parametrize(
    ("sweep", "says"),
    [
        ({"parameters": {"learning_rate": [1]}}, "name a key by its path"),
        ({"parameters": {"training.learning_rate": []}}, "must be a non-empty list"),
        ({"method": "bayes", "parameters": {"lora.r": [8]}}, "sweep.method must be grid or random"),
        ({"method": "random", "parameters": {"lora.r": [8]}}, "sweep.trials must be a whole number"),
        ({"parameters": {"lora.r": list(range(1, 20)), "training.seed": list(range(20))}}, "at most 256"),
        ({"grid": {}}, "sweep.grid: unknown key"),
    ],
)
def test_bad_sweeps_are_one_sentence(sweep, says):
    with pytest.raises(S.SweepError, match=says.replace("(", r"\(")):
        S.points(sweep)


def test_a_sweep_point_is_validated_like_any_run_config(tiny_llama, tmp_path):
    base = run_config(tmp_path, tiny_llama)
    assert S.apply(base, {"lora.r": 8, "training.learning_rate": 1e-4})["lora"]["r"] == 8
    with pytest.raises(ConfigError, match="lora.r must be in"):
        S.apply(base, {"lora.r": 0})


# ---- the supervisor, with real runs ------------------------------------------------------------------------------


def _cli(workspace, *args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "core.runs", "queue", *args],
        cwd=ROOT,
        env=dict(os.environ, LORA_COCKPIT_WORKSPACE=str(workspace)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _yaml(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def _entries(workspace) -> dict[str, Q.Entry]:
    return {e.name: e for e in Q.read_queue(workspace).entries}


def _supervisor_pid(workspace) -> int | None:
    info = json.loads((Q.queue_dir(workspace) / "pid").read_text())
    return info["pid"]


@pytest.mark.slow
def test_a_queue_runs_one_after_another_goes_on_after_a_failure_and_survives_a_kill(workspace, tiny_llama):
    """Three configs (the second fails on purpose: its data is gone by the time it runs) and a sweep point that does
    not fit: one run at a time on the CPU, the failure recorded and the queue going on, a kill -9 of the supervisor
    mid-queue resumed by `queue resume` with every entry started exactly once."""
    # long enough to be still running when the supervisor is killed right after it started it
    good = _yaml(workspace / "a.yaml", run_config(workspace, tiny_llama, max_steps=120, save_steps=60))
    with Q.editing(workspace) as q:  # held while the three are added (each CLI call pays a cold start)
        q.paused = "paused by the test while it fills the queue"
    doomed_data = workspace / "doomed.jsonl"
    doomed_data.write_text((workspace / "data.jsonl").read_text())
    doomed = run_config(workspace, tiny_llama, max_steps=6)
    doomed["data"]["path"] = str(doomed_data)
    sweep = run_config(workspace, tiny_llama, max_steps=6)
    sweep["data"].pop("max_length")
    sweep["training"]["max_length"] = 256  # at batch 65536: ~100 GiB, more than a workstation has
    sweep["sweep"] = {"parameters": {"training.per_device_train_batch_size": [4, 65536]}}
    out = _cli(workspace, "add", str(good), "--name", "a")
    assert out.returncode == 0 and "a: queued, fits" in out.stdout and "supervisor: pid" in out.stdout, (
        out.stderr
    )
    assert _cli(workspace, "add", str(_yaml(workspace / "b.yaml", doomed)), "--name", "b").returncode == 0
    out = _cli(workspace, "add", str(_yaml(workspace / "c.yaml", sweep)), "--name", "c")
    assert out.returncode == 0, out.stderr
    assert "c-1 (per_device_train_batch_size=4): queued, fits" in out.stdout
    assert "c-2 (per_device_train_batch_size=65536): not queued, does not fit" in out.stdout
    doomed_data.unlink()  # b fails when its turn comes
    assert _entries(workspace)["a"].state == "queued"
    out = _cli(workspace, "resume")
    assert out.returncode == 0 and "supervisor: pid" in out.stdout, out.stdout + out.stderr
    assert wait_until(lambda: _entries(workspace)["a"].state == "running", 120)
    os.kill(_supervisor_pid(workspace), signal.SIGKILL)
    run_a = workspace / "runs" / "a"
    assert wait_until(
        lambda: run_state(run_a).state == "finished", 300
    )  # the trainer outlives its supervisor
    time.sleep(3)
    assert _entries(workspace)["b"].state == "queued" and not (workspace / "runs" / "b").exists()
    out = _cli(workspace, "resume")
    assert out.returncode == 0 and "supervisor: pid" in out.stdout, out.stdout + out.stderr
    assert wait_until(lambda: all(e.state in Q.ENDED for e in _entries(workspace).values()), 400), _entries(
        workspace
    )
    entries = _entries(workspace)
    assert {n: e.state for n, e in entries.items()} == {"a": "finished", "b": "failed", "c-1": "finished"}
    assert "doomed.jsonl does not exist" in entries["b"].reason
    assert entries["a"].ended <= entries["b"].started and entries["b"].ended <= entries["c-1"].started
    for name in ("a", "c-1"):  # each run started by exactly one trainer
        started = (workspace / "runs" / name / "stderr.log").read_text().count("core.train: pid")
        assert started == 1, (name, started)
    # b's refused by its preflight before it announced itself: by one trainer too
    refused = (workspace / "runs" / "b" / "stderr.log").read_text()
    assert refused.count("error: preflight:") == 1 and "core.train: pid" not in refused, refused
    listed = _cli(workspace, "ls").stdout
    assert "failed" in listed and "doomed.jsonl does not exist" in listed


@pytest.mark.slow
def test_the_app_starts_a_queue_that_was_left_with_work(workspace, tiny_llama):
    """An app (re)start finds a queue with a waiting entry and no supervisor: it starts one, and only one."""
    from streamlit.testing.v1 import AppTest

    from core.estimate.from_config import plan_json
    from core.recipe.config import validate_config
    from core.runs.supervisor import supervisor_alive

    cfg = validate_config(run_config(workspace, tiny_llama, max_steps=2))
    Q.add(workspace, cfg, "left-over", plan_json(cfg))
    assert not supervisor_alive(workspace)
    at = AppTest.from_file(str(ROOT / "dashboard.py"), default_timeout=120)
    at.session_state["workspace"] = str(workspace)
    at.run()
    assert not at.exception
    assert wait_until(lambda: supervisor_alive(workspace), 30)
    first = _supervisor_pid(workspace)
    AppTest.from_file(
        str(ROOT / "dashboard.py"), default_timeout=120
    ).run()  # a second session: no second one
    assert _supervisor_pid(workspace) == first
    assert wait_until(lambda: _entries(workspace)["left-over"].state == "finished", 300)


@pytest.mark.slow
def test_a_full_disk_stops_the_queue_with_a_sentence(tmp_path, tiny_llama):
    """The first entry's checkpoint cannot fit: it fails as a full disk and the queue pauses, saying so, instead of
    failing every later entry one by one."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)]).returncode
    ):
        pytest.skip("needs root to mount a tmpfs")
    try:
        ws = mnt / "ws"
        ws.mkdir()
        full = run_config(ws, tiny_llama, max_steps=400, save_steps=3)
        full["lora"] = {"enabled": False}  # a full fine-tune: MiBs per checkpoint
        for name in ("full", "after"):
            _yaml(ws / f"{name}.yaml", full)
        # the disk filled before the queue starts, leaving about 1 MiB: the first checkpoint cannot fit. Filled while
        # a run saves, the free space it measured could come back as the run rotated its checkpoints, and the run
        # then trained to its end (seen under load: the queue went on to the next entry and never paused)
        with open(mnt / "filler", "wb") as f:
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            f.write(b"\0" * max(0, free - (1 << 20)))
        for name in ("full", "after"):
            assert _cli(ws, "add", str(ws / f"{name}.yaml"), "--name", name).returncode == 0
        assert wait_until(lambda: Q.read_queue(ws).paused is not None, 400), _entries(ws)
        state = Q.read_queue(ws)
        assert (
            state.paused.startswith("full stopped on a full disk (disk full:")
            and "queue resume" in state.paused
        )
        assert {e.name: e.state for e in state.entries} == {"full": "failed", "after": "queued"}
        listed = _cli(ws, "ls").stdout
        assert listed.startswith("paused: full stopped on a full disk")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
