"""Evaluation per data source (issue #50 item 3): a run on a mix of data.sources holding rows out logs each
source's eval loss (eval_<source>_loss) beside the overall eval_loss, in the same metrics line; the overall is the
row-weighted mean of the sources', as transformers' eval_loss is over one dataset."""

import json
import math
import random
from pathlib import Path

import pytest
import yaml

from core.recipe import methods, mix
from core.recipe.config import validate_config
from core.train.cli import main as train_main
from tests.cli import in_process


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def easy_and_hard(tmp_path):
    """general: one sentence again and again (learned at once); noise: random letters (never learned)."""
    easy = _jsonl(tmp_path / "general.jsonl", [{"text": "the cat sat on the mat"} for _ in range(60)])
    rng = random.Random(0)
    noise = [{"text": "".join(rng.choice("qxzjkvw ") for _ in range(40))} for _ in range(40)]
    return easy, _jsonl(tmp_path / "noise.jsonl", noise)


def test_held_out_rows_are_grouped_by_source_and_named_for_their_metric(tiny_llama, easy_and_hard):
    from transformers import AutoTokenizer

    easy, hard = easy_and_hard
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama)},
            "data": {
                "sources": [{"path": easy, "weight": 1}, {"path": hard, "weight": 1}],
                "eval_split": 0.25,
            },
            "training": {"max_length": 64},
        }
    )
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    _, held, record = mix.draw(cfg, tok, methods.get("sft"))
    parts = mix.eval_parts(held, record)
    general, noise = record["sources"]
    assert general["eval_metric"] == "eval_general_loss" and noise["eval_metric"] == "eval_noise_loss"
    assert list(parts) == ["general", "noise"]
    assert len(parts["general"]) == general["eval"] > 0 and len(parts["noise"]) == noise["eval"] > 0

    def texts(rows):
        return [tok.decode(r["input_ids"], skip_special_tokens=True) for r in rows]

    assert all("the cat sat" in t for t in texts(parts["general"]))
    assert not any("the cat sat" in t for t in texts(parts["noise"]))
    # one data.path, or no held-out rows: nothing per source
    assert mix.eval_parts(held, None) is None and mix.eval_parts(None, record) is None
    assert mix.eval_names([{"path": "a/x.jsonl"}, {"path": "b/x.jsonl"}, {"path": "acme/Rows-2"}]) == [
        "x_0",
        "x_1",
        "rows_2",
    ]


@pytest.mark.slow
def test_a_mixed_run_logs_each_sources_eval_loss(tmp_path, demo_built, easy_and_hard, workspace):
    """The demo's base, pretrained on the demo's rows, against rows of random letters: each source's eval loss
    is its own (low on the demo's rows, high on the letters) and the overall is their row-weighted mean."""
    _, hard = easy_and_hard
    demo = demo_built.copy(tmp_path / "demo")
    run_dir = workspace / "runs" / "per-source"
    easy = tmp_path / "demo.jsonl"
    easy.write_text((demo / "train.jsonl").read_text())
    raw = {
        "model": {"path": str(demo / "base")},
        "lora": {"r": 8, "lora_alpha": 16},
        "data": {
            "sources": [{"path": str(easy), "weight": 1}, {"path": hard, "weight": 1}],
            "eval_split": 0.2,
        },
        "training": {
            "max_length": 64,
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 3,
            "learning_rate": 1e-3,
            "max_steps": 4,
            "logging_steps": 2,
            "eval_steps": 2,
            "save_steps": 1000,
            "report_to": "none",
            "gradient_checkpointing": False,
        },
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    done = in_process(train_main, str(config), "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    record = json.loads((run_dir / "mix.json").read_text())
    n = {s["eval_metric"]: s["eval"] for s in record["sources"]}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval_loss" in line]
    assert [e["step"] for e in evals] == [2, 4], evals
    for e in evals:  # one line per evaluation: the overall loss and each source's
        assert set(n) <= set(e), e
        weighted = sum(e[k] * rows for k, rows in n.items()) / sum(n.values())
        assert math.isclose(e["eval_loss"], weighted, rel_tol=1e-5), (e, n)
    # the base knows the demo's rows, not the random letters: the two sources' losses part
    last = evals[-1]
    assert last["eval_demo_loss"] + 0.5 < last["eval_noise_loss"], last
    # training lines carry no eval loss of a source
    assert not any(k in line for line in lines if "loss" in line for k in n)
    # the Monitor's loss chart draws each source's eval loss beside the overall one
    from core.monitor.watch import RunWatcher

    loss = RunWatcher(run_dir).refresh().charts["loss"]
    assert {"eval", "eval: demo", "eval: noise"} <= set(loss["series"]), set(loss["series"])
    noise = loss[loss.series == "eval: noise"]
    assert list(noise.step) == [2, 4] and math.isclose(
        noise.value.iloc[-1], last["eval_noise_loss"], rel_tol=1e-5
    )
