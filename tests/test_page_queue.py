"""The run queue on the pages (#37): the Runs page shows the queue with each entry's plan verdict, cancels and
reorders waiting entries, and ranks a sweep's points; the Train page's Add to queue and Sweep these queue the form's
config (a 2 x 2 sweep of real tiny runs, ranked by eval loss once they ran)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_runs import run_config, wait_until

from core import procs, stopping
from core.recipe.config import validate_config
from core.runs import queue as Q

ROOT = Path(__file__).resolve().parents[1]
RUNS_PAGE = str(ROOT / "pages" / "runs.py")


def _page(path: str, workspace: Path) -> AppTest:
    at = AppTest.from_file(path, default_timeout=120)
    at.session_state["workspace"] = str(workspace)
    at.run()
    assert not at.exception, at.exception
    return at


def _plan(verdict: str, total: int) -> dict:
    return {"verdict": verdict, "device_total_bytes": total, "plan": {"device": "cpu"}}


def _finished_run(workspace: Path, name: str, eval_losses: list[float]) -> None:
    run = workspace / "runs" / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
    lines = [{"time": 1000.0 + s, "step": s, "loss": 2.0 - s / 100} for s in (5, 10)]
    lines += [
        {"time": 1000.0 + 5 * (i + 1), "step": 5 * (i + 1), "eval_loss": v} for i, v in enumerate(eval_losses)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run / "status.json").write_text(
        json.dumps({"state": "finished", "step": 10, "started": 1000.0, "ended": 1010.0})
    )


def test_the_runs_page_shows_the_queue_and_moves_and_cancels_waiting_entries(workspace):
    for name, total in (("first", 2**20), ("second", 2**30), ("third", 3 * 2**30)):
        Q.add(workspace, {"method": "sft"}, name, _plan("fits", total))
    at = _page(RUNS_PAGE, workspace)
    assert any(s.value == "Queue" for s in at.subheader)
    table = at.dataframe[0].value
    assert list(table["run"]) == ["first", "second", "third"] and set(table["plan"]) == {"fits"}
    assert list(table["planned"]) == ["1.0 MiB", "1.00 GiB", "3.00 GiB"]
    assert at.button(
        key="runs_queue_resume"
    )  # work waits and no supervisor lives: the page offers to start it
    at.selectbox(key="runs_queue_entry").set_value("q3").run()
    at.button(key="runs_queue_first").click().run()
    assert [e.name for e in Q.read_queue(workspace).waiting()] == ["third", "first", "second"]
    at.selectbox(key="runs_queue_entry").set_value("q1").run()
    at.button(key="runs_queue_cancel").click().run()
    assert Q.read_queue(workspace).find("q1").state == "cancelled"
    assert not at.exception


def test_a_sweep_is_ranked_by_eval_loss_with_its_keys_as_columns(workspace):
    losses = {"lr-1": [1.2, 0.9], "lr-2": [1.0, 0.5], "lr-3": [1.5, 1.4], "lr-4": [1.1, 0.7]}
    for i, (name, evals) in enumerate(losses.items()):
        values = {"training.learning_rate": [1e-4, 3e-4][i % 2], "lora.r": [8, 16][i // 2]}
        entry = Q.add(
            workspace, {"method": "sft"}, name, _plan("fits", 2**20), sweep={"id": "lr", "values": values}
        )
        with Q.editing(workspace) as q:
            q.find(entry.id).state = "finished"
        _finished_run(workspace, name, evals)
    at = _page(RUNS_PAGE, workspace)
    assert any(s.value == "Sweeps" for s in at.subheader)
    ranked = next(
        df.value for df in at.dataframe if "best eval loss" in df.value and "learning_rate" in df.value
    )
    assert list(ranked["run"]) == ["lr-2", "lr-4", "lr-1", "lr-3"]  # lowest best eval loss first
    assert list(ranked["r"]) == [8, 16, 8, 16] and list(ranked["learning_rate"]) == [3e-4, 3e-4, 1e-4, 1e-4]


@pytest.fixture()
def no_queue_left(workspace):
    yield
    folder = Q.queue_dir(workspace)
    info = procs.read_pid_info(folder) if folder.is_dir() else None
    if info and procs.same_process(info):
        os.kill(info["pid"], signal.SIGKILL)
    for run in (workspace / "runs").glob("*"):
        stopping.stop(run, grace_s=30)


@pytest.mark.slow
def test_sweep_these_queues_a_2x2_grid_that_runs_and_is_ranked(workspace, tiny_llama, no_queue_left):
    """The Train page's Sweep these on a config: learning rate x LoRA rank, four runs one after another, then the
    Runs page ranks them by eval loss."""
    cfg = run_config(workspace, tiny_llama, max_steps=6, eval_steps=3, logging_steps=3)
    cfg["data"]["eval_split"] = 0.2
    at = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=240)
    at.session_state["workspace"] = str(workspace)
    # the form filled from this config, as a YAML upload is
    at.session_state["tr_pending"] = validate_config(cfg)
    at.run()
    assert not at.exception, at.exception
    at.text_input(key="tr_name").set_value("grid").run()
    at.selectbox(key="tr_sweep_key0").set_value("training.learning_rate").run()
    at.text_input(key="tr_sweep_values0").set_value("1e-3, 5e-3").run()
    at.selectbox(key="tr_sweep_key1").set_value("lora.r").run()
    at.text_input(key="tr_sweep_values1").set_value("4, 8").run()
    at.button(key="tr_sweep").click().run()
    assert not at.exception, at.exception
    assert any("Queued grid-1, grid-2, grid-3, grid-4" in s.value for s in at.success), [
        e.value for e in at.error
    ]
    entries = Q.read_queue(workspace).entries
    assert [e.sweep["values"] for e in entries] == [
        {"training.learning_rate": 1e-3, "lora.r": 4},
        {"training.learning_rate": 1e-3, "lora.r": 8},
        {"training.learning_rate": 5e-3, "lora.r": 4},
        {"training.learning_rate": 5e-3, "lora.r": 8},
    ]
    assert wait_until(lambda: all(e.state in Q.ENDED for e in Q.read_queue(workspace).entries), 600)
    assert {e.state for e in Q.read_queue(workspace).entries} == {"finished"}
    runs = _page(RUNS_PAGE, workspace)
    ranked = next(df.value for df in runs.dataframe if "best eval loss" in df.value and "r" in df.value)
    assert sorted(ranked["run"]) == ["grid-1", "grid-2", "grid-3", "grid-4"]
    assert list(ranked["best eval loss"]) == sorted(ranked["best eval loss"])
