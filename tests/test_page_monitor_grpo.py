"""The Monitor and Runs pages of a GRPO run through AppTest (issue #34 item 6), on one real GRPO run shared by the
module: trl.GRPOTrainer through the trainer's own code path, two reward functions (exact match against the
`answer` column and a length preset), 6 steps logged every 2 (~15 s on 2 CPU cores). The tiny random model's
4-token completions are always cut at the limit and score alike: the run's own health warnings."""

import json
import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core import rundir
from core.monitor.completions import COMPLETIONS
from core.runs.launcher import create_run
from core.train.run import StopFlag, run_training
from tests.test_page_monitor import _page, _titled_charts

PAGES = Path(__file__).resolve().parent.parent / "pages"
REWARD_TITLES = ("Reward (mean of each group's completions)", "Reward of each function (mean, std)")


def grpo_config(model: Path, data: Path) -> dict:
    return {
        "method": "grpo",
        "model": {"path": str(model)},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": str(data)},
        "rewards": [{"type": "match", "column": "answer"}, {"type": "length", "max": 3, "name": "short"}],
        "training": {
            "per_device_train_batch_size": 4,
            "num_generations": 2,
            "max_completion_length": 4,
            "max_prompt_length": 32,
            "max_steps": 6,
            "logging_steps": 2,
            "save_steps": 100,
            "learning_rate": 1e-3,
            "gradient_checkpointing": False,
        },
    }


def write_prompts(path: Path) -> Path:
    words = ["abc", "dog", "cat", "sun", "red", "sky", "box", "map"]
    path.write_text(
        "".join(json.dumps({"prompt": f"Uppercase: {w}", "answer": w.upper()}) + "\n" for w in words)
    )
    return path


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_llama) -> Path:
    ws = tmp_path_factory.mktemp("ws_grpo")
    run_dir = create_run(ws, "grpo-real", grpo_config(tiny_llama, write_prompts(ws / "prompts.jsonl")))
    run_training(run_dir / rundir.CONFIG, run_dir, stop=StopFlag())
    assert json.loads((run_dir / rundir.STATUS).read_text())["state"] == "finished"
    return run_dir


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / rundir.METRICS).read_text().splitlines() if line]


def _completions(at):
    """The sample completions table: the dataframe with a completion column."""
    return next(d.value for d in at.dataframe if "completion" in d.value.columns)


@pytest.mark.slow
def test_a_grpo_run_shows_its_reward_curves_its_completions_and_its_health(grpo_run):
    at = _page(grpo_run.parent.parent, grpo_run)
    assert any(" · GRPO · " in label for label in at.selectbox(key="mon_run").options)
    charts = _titled_charts(at)
    assert all(t in charts for t in REWARD_TITLES), list(charts)
    assert {"Completion length (tokens)", "Learning signal", "Learning rate"} <= set(charts)
    assert "KL to the reference (beta > 0)" not in charts  # beta 0: TRL logs no KL, the chart is left out
    assert set(charts[REWARD_TITLES[0]][1][0]["series"]) >= {
        "reward",
        "reward (smoothed)",
        "std within a group",
    }
    assert set(charts[REWARD_TITLES[1]][1][0]["series"]) >= {"match", "match std", "short", "short std"}
    last = _records(grpo_run)[-1]
    assert any(c.value.startswith(f"last reward {last['reward']:.3f}") for c in at.caption)
    table = _completions(at)
    assert list(table.columns) == ["step", "prompt", "completion", "match", "short", "advantage"]
    assert set(table["step"]) == {6, 4, 2} and table["step"].iloc[0] == 6  # newest first
    assert table["prompt"].str.startswith("Uppercase: ").all()
    assert table["match"].isin([0.0, 1.0]).all()
    warned = " ".join(w.value for w in at.warning)
    assert "Completions are always cut at the length limit" in warned  # 4 tokens: never an end of turn
    assert "training.max_completion_length" in warned


@pytest.mark.slow
def test_a_half_written_completions_file_is_named_and_the_table_still_shows(grpo_run, tmp_path):
    ws = tmp_path / "ws"
    run = shutil.copytree(grpo_run, ws / "runs" / grpo_run.name)
    folder = run / COMPLETIONS
    newest = (folder / "completions_00006.parquet").read_bytes()
    (folder / "completions_00008.parquet").write_bytes(newest[:100])  # TRL writes in place: caught mid-write
    at = _page(ws, run)
    assert any(
        c.value.startswith("Not shown: completions_00008.parquet: not a readable parquet file yet")
        for c in at.caption
    )
    table = _completions(at)
    assert set(table["step"]) == {6, 4}  # the newest three files, one of them unreadable


def test_kl_and_entropy_charts_show_once_logged(workspace):
    """KL only with beta > 0: a run that logs it gets its chart (and no completions table without files)."""
    run = workspace / "runs" / "grpo-kl"
    run.mkdir(parents=True)
    (run / rundir.CONFIG).write_text("method: grpo\nmodel: {path: m}\ndata: {path: d.jsonl}\n")
    lines = [{"time": float(s), "step": s, "loss": 0.0, "reward": 0.5, "kl": 0.01 * s} for s in (1, 2)]
    (run / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    at = _page(workspace, run)
    charts = _titled_charts(at)
    assert "KL to the reference (beta > 0)" in charts and "Entropy of the completions" not in charts
    assert not any(d for d in at.dataframe if "completion" in d.value.columns)


@pytest.mark.slow
def test_the_runs_page_lists_a_grpo_run_by_its_reward(grpo_run):
    at = AppTest.from_file(str(PAGES / "runs.py"), default_timeout=60)
    at.session_state["workspace"] = str(grpo_run.parent.parent)
    at.run()
    assert not at.exception, at.exception
    row = at.dataframe[0].value.set_index("run").loc[grpo_run.name]
    assert row["method"] == "grpo"
    assert row["reward"] == f"{_records(grpo_run)[-1]['reward']:.3f} (train)"
    assert "reward accuracy" not in at.dataframe[0].value.columns  # a DPO figure: no DPO run here
