"""The Runs page through AppTest on real run directories (see test_page_monitor for how they are made), and
core.runs.admin.delete_run: never a live run, never a folder outside <workspace>/runs."""

import json
import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_page_monitor import failed_run, finished_run

from core.rundir import write_status
from core.runs.admin import delete_run
from core.runs.launcher import RunError
from tests.conftest import stand_in_run

ROOT = Path(__file__).resolve().parent.parent
PAGE = str(ROOT / "pages" / "runs.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama) -> tuple[Path, Path, Path]:
    ws = tmp_path_factory.mktemp("ws_runs")
    return ws, finished_run(ws, tiny_llama), failed_run(ws, tiny_llama)


@pytest.fixture()
def live_stand_in(workspace):
    with stand_in_run(workspace / "runs" / "live", 60) as run_dir:
        yield run_dir


def _page(workspace: Path) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.session_state["workspace"] = str(workspace)
    at.run()
    assert not at.exception, at.exception
    return at


def test_no_runs_is_a_friendly_message(workspace):
    at = _page(workspace)
    assert any("No runs yet" in i.value for i in at.info)
    assert not at.error


@pytest.mark.slow  # builds two real runs (~20 s) shared by this module
def test_table_lists_every_run_with_its_figures(runs):
    ws, done, broken = runs
    table = _page(ws).dataframe[0].value.set_index("run")
    assert set(table.index) == {done.name, broken.name}
    assert table.loc[done.name, "state"] == "finished" and table.loc[broken.name, "state"] == "failed"
    metrics = [json.loads(line) for line in (done / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert table.loc[done.name, "final loss"] == f"{losses[-1]:.4f}"
    assert table.loc[done.name, "best eval"] == f"{min(evals):.4f}"
    # no "None" anywhere: a failed run without a loss and a CPU run without GPU samples say so (issue #16)
    assert table.loc[broken.name, "final loss"] == "– (no loss logged)"
    assert "peak GPU GiB" not in table  # no run has GPU samples: said once under the table, not in each row
    assert any(c.value.startswith("No GPU samples in these runs") for c in _page(ws).caption)
    assert "None" not in table.to_string()
    status = json.loads((done / "status.json").read_text())
    assert table.loc[done.name, "steps"] == f"{status['step']}/{status['max_steps']}"
    assert table.loc[done.name, "time"]
    # what each trained with (issue #40 item 5): the config's learning rate, LoRA rank and 4-bit loading
    assert (table.loc[done.name, "lr"], table.loc[done.name, "r"], table.loc[done.name, "4-bit"]) == (
        "0.0002",
        "16",
        "no",
    )
    assert table.loc[done.name, "eval (base → tuned)"] == "–"  # not evaluated yet: the column is still there
    assert "from the Hub" not in table and "note" not in table  # empty for every run


@pytest.mark.slow
def test_compare_draws_the_chosen_runs(runs):
    ws, done, broken = runs
    at = _page(ws)
    assert set(at.multiselect(key="runs_compare").value) == {done.name, broken.name}
    assert len(at.get("vega_lite_chart")) == 1
    at.multiselect(key="runs_compare").set_value([broken.name]).run()  # failed before any loss
    assert any("None of these runs has logged a loss" in c.value for c in at.caption)
    at.multiselect(key="runs_compare").set_value([]).run()
    assert not at.get("vega_lite_chart")


@pytest.mark.slow
def test_delete_needs_confirmation_then_removes_the_run(runs, workspace):
    _, done, _ = runs
    copy = shutil.copytree(done, workspace / "runs" / "finished-copy")
    at = _page(workspace)
    at.selectbox(key="runs_one").set_value(copy.name).run()
    assert at.button(key="runs_delete").disabled  # nothing happens without the checkbox
    at.checkbox(key=f"runs_sure_{copy.name}").check().run()
    at.button(key="runs_delete").click().run()
    assert not at.exception, at.exception
    assert not copy.exists()
    assert any(f"Deleted run {copy.name}" in s.value for s in at.success)
    assert any("No runs yet" in i.value for i in at.info)
    assert list((workspace / "runs").iterdir()) == []  # no hidden leftovers either


def test_delete_refuses_a_live_run_with_a_stand_in_process(live_stand_in, workspace):
    at = _page(workspace)
    at.checkbox(key="runs_sure_live").check().run()
    at.button(key="runs_delete").click().run()
    assert any("is running" in e.value and "Stop on the Monitor page" in e.value for e in at.error)
    assert (live_stand_in / "config.yaml").is_file()


def test_delete_run_refuses_folders_outside_the_runs_folder(workspace):
    other = workspace / "demo"
    other.mkdir()
    with pytest.raises(RunError, match="not a run folder"):
        delete_run(other, workspace)
    with pytest.raises(RunError, match="not a run folder"):
        delete_run(workspace / "runs" / ".." / "demo", workspace)
    assert other.is_dir()


@pytest.mark.slow
def test_open_in_monitor_switches_page_with_the_run_selected(runs):
    ws, done, _ = runs
    at = AppTest.from_file(str(ROOT / "dashboard.py"), default_timeout=120)
    at.session_state["workspace"] = str(ws)
    at.run()
    at.switch_page("pages/runs.py").run()
    at.selectbox(key="runs_one").set_value(done.name).run()
    at.button(key="runs_open").click().run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Monitor"
    assert at.session_state["monitor_run"] == str(done)
    assert at.selectbox(key="mon_run").value == str(done)


def _dpo_workspace(workspace: Path) -> tuple[Path, Path, Path]:
    """Two synthetic DPO runs in the trainer's format (one evaluated, one not) and a synthetic SFT run."""
    from test_watch import metric, write_dpo_run

    runs = workspace / "runs"
    evaluated = write_dpo_run(runs / "dpo-eval", "healthy", steps=100, state="finished", started=300.0)
    trained = write_dpo_run(
        runs / "dpo-train", "collapse", steps=60, eval_every=0, state="finished", started=200.0
    )
    sft = runs / "sft"
    sft.mkdir()
    (sft / "config.yaml").write_text("method: sft\nmodel: {path: m}\ndata: {path: d.jsonl}\n")
    (sft / "metrics.jsonl").write_text("".join(metric(s) for s in range(1, 31)))
    write_status(sft, state="finished", step=30, max_steps=30)
    return evaluated, trained, sft


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_table_shows_the_method_and_a_dpo_runs_reward_accuracy_and_margin(workspace):
    evaluated, trained, sft = _dpo_workspace(workspace)
    table = _page(workspace).dataframe[0].value.set_index("run")
    assert table.loc[evaluated.name, "method"] == "dpo" and table.loc[sft.name, "method"] == "sft"
    last_eval = [r for r in _records(evaluated) if "eval_rewards/accuracies" in r][-1]
    assert (
        table.loc[evaluated.name, "reward accuracy"] == f"{last_eval['eval_rewards/accuracies']:.2f} (eval)"
    )
    assert table.loc[evaluated.name, "reward margin"] == f"{last_eval['eval_rewards/margins']:.3g} (eval)"
    last = _records(trained)[-1]
    assert table.loc[trained.name, "reward accuracy"] == f"{last['rewards/accuracies']:.2f} (train)"
    assert table.loc[trained.name, "reward margin"] == f"{last['rewards/margins']:.3g} (train)"
    assert table.loc[sft.name, "reward accuracy"] == table.loc[sft.name, "reward margin"] == ""
    assert "None" not in table.to_string() and "nan" not in table.to_string()


def test_table_of_sft_runs_has_no_reward_columns(workspace):
    from test_watch import metric

    sft = workspace / "runs" / "sft"
    sft.mkdir(parents=True)
    (sft / "config.yaml").write_text(
        "model: {path: m}\ndata: {path: d.jsonl}\n"
    )  # no method: SFT, the default
    (sft / "metrics.jsonl").write_text("".join(metric(s) for s in range(1, 11)))
    table = _page(workspace).dataframe[0].value.set_index("run")
    assert table.loc["sft", "method"] == "sft"
    assert "reward accuracy" not in table.columns and "reward margin" not in table.columns


def test_compare_offers_the_dpo_metrics_the_chosen_runs_have(workspace):
    import pyarrow as pa

    evaluated, trained, sft = _dpo_workspace(workspace)
    at = _page(workspace)
    at.multiselect(key="runs_compare").set_value([sft.name]).run()
    assert not [s for s in at.selectbox if s.key == "runs_metric"]  # an SFT run: loss only, no selector
    assert len(at.get("vega_lite_chart")) == 1
    at.multiselect(key="runs_compare").set_value([evaluated.name, trained.name, sft.name]).run()
    assert at.selectbox(key="runs_metric").options == [
        "loss",
        "preference accuracy (rewards/accuracies)",
        "reward margin (rewards/margins)",
    ]
    at.selectbox(key="runs_metric").set_value("rewards/accuracies").run()
    assert not at.exception, at.exception
    (chart,) = at.get("vega_lite_chart")
    spec = json.loads(chart.proto.spec)
    assert spec["layer"][0]["encoding"]["y"]["title"] == "preference accuracy (rewards/accuracies) (smoothed)"
    frames = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets]
    assert set(frames[0]["run"]) == {evaluated.name, trained.name}  # the SFT run has no accuracy to draw
    assert frames[1]["value"].tolist() == [0.5]  # the chance line
    assert any(
        c.value == f"Not drawn (no rewards/accuracies logged: not DPO runs): {sft.name}" for c in at.caption
    )
    at.toggle(key="runs_smoothed").set_value(False).run()
    frames = [
        pa.ipc.open_stream(d.data.data).read_all().to_pandas()
        for d in at.get("vega_lite_chart")[0].proto.datasets
    ]
    raw = frames[0][frames[0]["run"] == trained.name]["value"].tolist()
    expected = [r["rewards/accuracies"] for r in _records(trained)]
    assert raw == expected  # every logged point, not smoothed
    at.selectbox(key="runs_metric").set_value("rewards/margins").run()
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert spec["encoding"]["y"]["title"] == "reward margin (rewards/margins)"


def test_one_run_shows_the_data_mix_it_drew_and_a_broken_record_shows_nothing(runs):
    """#50 item 2: a run of several data sources shows, under One run, what it drew from each (RUN/mix.json as
    `runs show` prints it); an unreadable record is left out and the page still renders."""
    ws, finished, _failed = runs
    record = {
        "strategy": "interleave",
        "stopping_strategy": "first_exhausted",
        "seed": 7,
        "train_rows": 90,
        "eval_rows": 10,
        "sources": [
            {"source": "chat.jsonl", "weight": 3, "drawn": 75, "available": 80, "train": 68, "eval": 7},
            {"source": "domain.jsonl", "weight": 1, "drawn": 25, "available": 40, "train": 22, "eval": 3},
        ],
    }
    mix_file = finished / "mix.json"
    try:
        mix_file.write_text(json.dumps(record))
        at = _page(ws)
        at.selectbox(key="runs_one").set_value(finished.name).run()
        shown = "\n".join(c.value for c in at.code)
        assert "interleave, first_exhausted, seed 7" in shown, shown
        assert "chat.jsonl: weight 3, 75 of 80 rows drawn" in shown and "domain.jsonl: weight 1" in shown
        mix_file.write_text('{"sources": [')  # truncated
        at = _page(ws)
        at.selectbox(key="runs_one").set_value(finished.name).run()
        assert not at.exception and not any("Data mix" in c.value for c in at.caption)
    finally:
        mix_file.unlink(missing_ok=True)
