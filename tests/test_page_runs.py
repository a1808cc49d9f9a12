"""The Runs page through AppTest on real run directories (see test_page_monitor for how they are made), and
core.runs_admin.delete_run: never a live run, never a folder outside <workspace>/runs."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_page_monitor import failed_run, finished_run

from core.runs.admin import delete_run
from core.runs.launcher import RunError
from core.runs.rundir import write_status

ROOT = Path(__file__).resolve().parent.parent
PAGE = str(ROOT / "pages" / "runs.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama) -> tuple[Path, Path, Path]:
    ws = tmp_path_factory.mktemp("ws_runs")
    return ws, finished_run(ws, tiny_llama), failed_run(ws, tiny_llama)


@pytest.fixture()
def live_stand_in(workspace):
    """A run folder whose pid is a live process (a sleeping python standing in for the trainer) and whose
    status says running: what a live run looks like to the launcher, without paying for a real one."""
    run_dir = workspace / "runs" / "live"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model:\n  path: x\ndata:\n  path: y\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (run_dir / "pid").write_text(str(proc.pid))
    write_status(run_dir, state="running", step=3, max_steps=100)
    yield run_dir
    proc.kill()
    proc.wait()


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
    assert table.loc[done.name, "best eval loss"] == f"{min(evals):.4f}"
    # no "None" anywhere: a failed run without a loss and a CPU run without GPU samples say so (issue #16)
    assert table.loc[broken.name, "final loss"] == "– (no loss logged)"
    assert table.loc[done.name, "peak GPU memory (GiB)"] == "n/a (no GPU samples)"
    assert "None" not in table.to_string()
    status = json.loads((done / "status.json").read_text())
    assert table.loc[done.name, "steps"] == f"{status['step']} / {status['max_steps']}"
    assert table.loc[done.name, "duration"]


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
    assert any("is running" in e.value and "stop it on the Monitor page" in e.value for e in at.error)
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
