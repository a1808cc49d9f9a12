"""Early stopping (#37 item 3): a run on a plateau stops before its last step, says so, and keeps its best
checkpoint as the adapter. A real tiny run on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from test_runs import run_config

from core import rundir
from core.recipe.config import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[1]


def test_early_stopping_needs_evaluations_to_judge_by(tiny_llama, tmp_path):
    cfg = run_config(tmp_path, tiny_llama, early_stopping_patience=2)
    with pytest.raises(
        ConfigError, match="early_stopping_patience needs evaluations to judge by: set data.eval_split"
    ):
        validate_config(cfg)
    cfg["data"]["eval_split"] = 0.1
    from core.recipe.engine_args import training_args

    args = training_args(
        validate_config({**cfg, "training": {**cfg["training"], "eval_steps": 5}}), has_eval=True
    )
    # the best checkpoint must be on disk to be kept: a save at every evaluation, judged by the eval loss
    assert (args.load_best_model_at_end, args.metric_for_best_model, args.save_steps) == (
        True,
        "eval_loss",
        5,
    )
    assert args.greater_is_better is False


@pytest.mark.slow
def test_a_run_on_a_plateau_stops_early_and_keeps_its_best_checkpoint(tiny_llama, tmp_path):
    cfg = run_config(
        tmp_path,
        tiny_llama,
        max_steps=400,
        logging_steps=5,
        eval_steps=5,
        learning_rate=1e-2,
        early_stopping_patience=2,
        early_stopping_threshold=0.01,
        save_total_limit=1,
    )
    cfg["data"]["eval_split"] = 0.2
    path = tmp_path / "es.yaml"
    path.write_text(yaml.safe_dump(validate_config(cfg)))
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(path), "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    status = rundir.read_status(run_dir)
    early = status["early_stop"]
    assert status["state"] == "finished" and early["step"] < 400, status
    assert status["reason"].startswith(
        f"stopped early at step {early['step']}: eval_loss did not improve for 2"
    )
    # the best is the lowest eval loss (a gain under the threshold still counts towards patience)
    best = run_dir / "checkpoints" / f"checkpoint-{early['best_step']}"
    assert best.is_dir()  # kept beyond save_total_limit: it is the best
    kept, adapter = (load_file(p / "adapter_model.safetensors") for p in (best, run_dir / "adapter"))
    assert kept.keys() == adapter.keys() and all((kept[k] == adapter[k]).all() for k in kept)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["eval_loss"] for r in evals if "eval_loss" in r}
    assert min(losses, key=losses.get) == early["best_step"] and losses[early["best_step"]] == pytest.approx(
        early["best"]
    )
    split = json.loads((run_dir / "eval_split.json").read_text())
    assert split["share"] == 0.2 and split["seed"] == 42 and split["eval_rows"] > 0
