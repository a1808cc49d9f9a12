"""A launched run says what it is doing while it starts (#40 item 2): its phases in status.json, a start time that
never moves (Elapsed never goes back), and a normal finish that reads "finished" at once (no transient state)."""

from __future__ import annotations

import json
import time

import pytest
from test_runs import run_config

from core.runs.launcher import create_run, launch, run_state

PHASES = (
    "importing the libraries",
    "checking and preparing the data",
    "loading the model",
    "building the trainer",
    "first step",
)


@pytest.mark.slow
def test_a_launched_run_names_its_start_phases_and_its_start_time_never_moves(workspace, tiny_llama):
    cfg = run_config(workspace, tiny_llama, max_steps=3, logging_steps=10, logging_first_step=True)
    run_dir = create_run(workspace, "phases", cfg)
    launch(run_dir)
    seen, starts, states = [], set(), []
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):
            continue
        starts.add(status.get("started"))
        if status.get("phase") and (not seen or seen[-1] != status["phase"]):
            seen.append(status["phase"])
        info = run_state(run_dir)
        states.append(info.state)
        if info.state in ("finished", "failed"):
            break
        time.sleep(0.02)
    assert states[-1] == "finished", (states[-1], run_state(run_dir).reason)
    assert len(starts) == 1  # the launcher's start time, kept by the trainer
    assert seen[0] == "importing the libraries" and all(p in PHASES for p in seen), seen
    assert [PHASES.index(p) for p in seen] == sorted(PHASES.index(p) for p in seen)  # in order, none repeated
    assert "stopping" not in states  # a normal finish never reads as a stop
    final = json.loads((run_dir / "status.json").read_text())
    assert final["phase"] is None
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1  # logging_first_step (the demo's): a point after the first step, not at step 10
