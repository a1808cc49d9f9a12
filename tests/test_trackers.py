"""training.report_to (core.recipe.trackers): a real tiny run's TensorBoard event files and Trackio database land in
the run folder, the Monitor names the command that shows them, and a tracker this machine lacks is one sentence."""

import json
import os
import sqlite3
from pathlib import Path

import pytest
import yaml
from streamlit.testing.v1 import AppTest

from core.recipe import trackers
from core.rundir import read_metrics
from core.runs.launcher import create_run
from core.train.cli import main as train_main
from core.train.run import StopFlag, run_training

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "monitor.py")


def tiny_run(workspace: Path, model: Path, name: str, report_to) -> Path:
    data = workspace / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"instruction": f"twice {i}", "output": f"{2 * i}"}) + "\n" for i in range(24))
    )
    cfg = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "max_length": 48},
        "training": {
            "per_device_train_batch_size": 4,
            "max_steps": 4,
            "logging_steps": 1,
            "save_steps": 100,
            "learning_rate": 1e-2,
        },
    }
    if report_to is not None:
        cfg["training"]["report_to"] = report_to
    return create_run(workspace, name, cfg)


def train_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


@pytest.mark.slow  # trains a tiny real run (~5 s)
def test_tensorboard_run_writes_its_loss_into_the_run_folder_and_the_monitor_names_it(workspace, tiny_llama):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tiny_run(workspace, tiny_llama, "tb", "tensorboard")
    summary = run_training(run_dir / "config.yaml", run_dir, stop=StopFlag())
    assert summary["state"] == "finished"

    board = run_dir / "tensorboard"
    assert list(board.glob("events.out.tfevents.*")), sorted(p.name for p in run_dir.rglob("*"))
    assert not (run_dir / "checkpoints" / "runs").exists()  # not transformers' default folder
    events = EventAccumulator(str(board))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"], events.Tags()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    expected = train_losses(run_dir)
    assert sorted(logged) == sorted(expected) == [1, 2, 3, 4]
    assert all(logged[s] == pytest.approx(expected[s], rel=1e-5) for s in expected)

    at = AppTest.from_file(PAGE, default_timeout=60)
    at.session_state["workspace"] = str(workspace)
    at.session_state["monitor_run"] = str(run_dir)
    at.run()
    assert not at.exception, at.exception
    assert any(c.value == f"TensorBoard: `tensorboard --logdir {board}`" for c in at.caption), [
        c.value for c in at.caption
    ]
    assert not any(c.value.startswith("Trackio:") for c in at.caption)  # it wrote no Trackio database


@pytest.mark.slow  # trains a tiny real run (~5 s)
def test_a_run_that_reports_nowhere_leaves_no_tracker_folder(workspace, tiny_llama):
    run_dir = tiny_run(workspace, tiny_llama, "quiet", "none")
    assert run_training(run_dir / "config.yaml", run_dir, stop=StopFlag())["state"] == "finished"
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "trackio").exists()
    assert trackers.viewers(run_dir) == []


@pytest.mark.skipif(not trackers.installed("trackio"), reason="trackio is optional: pip install trackio")
@pytest.mark.slow  # trains a tiny real run (~5 s)
def test_trackio_run_writes_its_local_database_in_the_run_folder(workspace, tiny_llama, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", "/nonexistent-trackio-home")  # the engine's own folder must win
    run_dir = tiny_run(workspace, tiny_llama, "tracked", "trackio")
    assert run_training(run_dir / "config.yaml", run_dir, stop=StopFlag())["state"] == "finished"

    database = run_dir / "trackio" / "tracked.db"
    assert database.is_file(), sorted(p.name for p in run_dir.rglob("*"))
    with sqlite3.connect(database) as db:
        rows = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM metrics")]
    # Trackio counts its own steps (one per log call); the trainer's step is train/global_step
    logged = {m["train/global_step"]: m["train/loss"] for m in rows if "train/loss" in m}
    expected = train_losses(run_dir)
    assert sorted(logged) == sorted(expected) == [1, 2, 3, 4]
    assert all(logged[s] == pytest.approx(expected[s], rel=1e-5) for s in expected)
    name, command = trackers.viewers(run_dir)[-1]
    assert name == "Trackio" and command.endswith("trackio show --project tracked")


def test_trackio_missing_is_one_sentence_and_exit_2_before_anything_is_written(
    workspace, tiny_llama, monkeypatch, capsys
):
    if trackers.installed("trackio"):  # this machine has it: the refusal is tried as where it is missing
        monkeypatch.setattr(trackers, "installed", lambda name: name != "trackio")
    data = workspace / "d.jsonl"
    data.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    config = workspace / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_llama)},
                "data": {"path": str(data)},
                "training": {"report_to": ["trackio"]},
            }
        )
    )
    run_dir = workspace / "runs" / "refused"
    assert train_main([str(config), "--run-dir", str(run_dir)]) == 2
    out = capsys.readouterr()
    said = out.err + out.out
    assert (
        "training.report_to trackio needs the trackio package, which is not installed here: `pip install trackio`"
        in said
    )
    assert "Traceback" not in said
    assert not run_dir.exists()


def test_viewers_name_each_tracker_folder_with_a_command_a_shell_takes(tmp_path):
    run_dir = tmp_path / "my run"
    run_dir.mkdir()
    assert trackers.viewers(run_dir) == []
    (run_dir / "tensorboard").mkdir()
    (run_dir / "trackio").mkdir()
    assert trackers.viewers(run_dir) == [
        ("TensorBoard", f"tensorboard --logdir '{run_dir}/tensorboard'"),
        ("Trackio", f"TRACKIO_DIR='{run_dir}/trackio' trackio show --project 'my run'"),
    ]


def test_the_engine_reports_to_tensorboard_by_default_and_keeps_a_named_choice(tmp_path, monkeypatch):
    # set here so that monkeypatch restores them: route() points them at tmp_path for the rest of the process
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", "/elsewhere")
    monkeypatch.setenv("TRACKIO_DIR", "/elsewhere")
    assert trackers.route({"training": {}}, tmp_path, smoke=False) == "tensorboard"
    assert trackers.route({"training": {"report_to": "none"}}, tmp_path, smoke=False) is None
    assert trackers.route({"training": {}}, tmp_path, smoke=True) is None  # one step: nothing to watch
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tensorboard")
    assert os.environ["TRACKIO_DIR"] == str(tmp_path / "trackio")


def test_the_train_form_offers_the_trackers_and_names_a_missing_one_under_its_field(
    workspace, tiny_llama, monkeypatch
):
    monkeypatch.setattr(trackers, "installed", lambda name: name != "trackio")  # as on a machine without it
    data = workspace / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"a{i}", "output": f"b{i}"}) + "\n" for i in range(8)))
    at = AppTest.from_file(str(Path(PAGE).with_name("train.py")), default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = {"model": {"path": str(tiny_llama)}, "data": {"path": str(data)}}
    at.run()
    assert not at.exception, at.exception
    field = at.selectbox(key="tr_report_to")
    assert list(field.options) == ["tensorboard", "trackio", "none"] and field.value == "tensorboard"
    assert not any("report_to" in e.value for e in at.error)
    field.set_value("trackio").run()
    assert at.session_state["train_config"]["training"]["report_to"] == "trackio"
    assert any(
        "Report to (training.report_to) trackio needs the trackio package" in e.value
        and "pip install trackio" in e.value
        for e in at.error
    ), [e.value for e in at.error]
    assert at.button(key="tr_launch").disabled
