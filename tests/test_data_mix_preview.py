"""A mix of data.sources before training (issue #50 item 4): each source's row count, format and first rows; the
mix's token lengths drawn as the mix draws (weights, rows, seed) for the histogram and the planner's rows
(`core.estimate --data-lengths`); preflight naming the source and the row of each problem."""

import json
from pathlib import Path

import pytest

from core.recipe import mix_preview
from core.recipe.config import dump_config, validate_config
from core.recipe.data import DataError
from core.train.preflight import run_preflight
from tests.cli import in_process

SHORT, LONG = "ab", "x" * 60  # rows of A are a few tokens long, rows of B about 60


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def short_and_long(tmp_path):
    a = _jsonl(tmp_path / "short.jsonl", [{"instruction": f"{i}", "output": SHORT} for i in range(400)])
    b = _jsonl(tmp_path / "long.jsonl", [{"text": f"{i} {LONG}"} for i in range(100)])
    return a, b


def _cfg(model, sources, **training) -> dict:
    return validate_config(
        {
            "model": {"path": str(model)},
            "data": {"sources": sources, "mix": {"seed": 5}},
            "training": {"max_length": 128, **training},
        }
    )


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def test_the_mix_lengths_follow_the_weights_not_the_sizes(tiny_llama, short_and_long):
    a, b = short_and_long
    tok = _tokenizer(tiny_llama)
    # B is a quarter of A's size but weighs 3 to A's 1: three of four drawn rows are long
    cfg = _cfg(tiny_llama, [{"path": a, "weight": 1}, {"path": b, "weight": 3}])
    pv = mix_preview.preview(cfg, tok, n=4, length_rows=5000)
    short, long = pv["sources"]
    assert (short["rows"], short["format"], long["rows"], long["format"]) == (400, "alpaca", 100, "text")
    assert pv["total_rows"] == short["drawn"] + long["drawn"] == len(pv["lengths"])
    n_long = sum(n > 40 for n in pv["lengths"])
    assert n_long == long["drawn"] and 0.65 <= n_long / len(pv["lengths"]) <= 0.85, (short, long)
    assert pv["rows"][0]["row"] == 1 and {r["source"] for r in pv["rows"]} <= {"short.jsonl", "long.jsonl"}
    # the same seed, the same draw; the histogram of one source alone would be all short
    assert mix_preview.preview(cfg, tok, n=0)["lengths"] == pv["lengths"]
    # at most length_rows tokenized, picked from the draw with its seed: still three in four long
    few = mix_preview.preview(cfg, tok, n=0, length_rows=60)["lengths"]
    assert len(few) == 60 and 0.55 <= sum(n > 40 for n in few) / 60 <= 0.95
    # rows per source: exactly those counts
    rows = mix_preview.preview(_cfg(tiny_llama, [{"path": a, "rows": 10}, {"path": b, "rows": 30}]), tok, n=0)
    assert [s["drawn"] for s in rows["sources"]] == [10, 30] and sum(n > 40 for n in rows["lengths"]) == 30
    assert mix_preview.row_count(cfg["data"]) == 500


def test_each_source_is_summarised_and_a_bad_one_named(tmp_path, tiny_llama, short_and_long):
    a, b = short_and_long
    tok = _tokenizer(tiny_llama)
    cfg = _cfg(tiny_llama, [{"path": a, "weight": 1}, {"path": str(tmp_path / "gone.jsonl"), "weight": 1}])
    first = mix_preview.source_summary(cfg, 0, tok, n=2)
    assert first["rows"] == 400 and first["format"] == "alpaca" and len(first["preview"]) == 2
    assert first["preview"][0]["completion"].startswith(SHORT) and first["problem"] is None
    gone = mix_preview.source_summary(cfg, 1, tok)
    assert gone["rows"] is None and gone["problem"].startswith("data.sources[1] (gone.jsonl): ")
    with pytest.raises(DataError, match=r"^data\.sources\[1\] \(gone\.jsonl\): "):
        mix_preview.preview(cfg, tok)


def test_preflight_names_the_source_and_the_row(tmp_path, tiny_llama, short_and_long):
    a, _ = short_and_long
    rows = [{"instruction": "Say hi", "output": "hi"}] * 5
    rows[3] = {"instruction": "Say nothing", "output": ""}
    bad = _jsonl(tmp_path / "domain.jsonl", rows)
    cfg = _cfg(tiny_llama, [{"path": a, "weight": 1}, {"path": bad, "weight": 1}])
    findings = run_preflight(cfg)
    named = [f for f in findings if f.message.startswith("data.sources[1] (domain.jsonl): ")]
    assert named and all(not f.message.startswith("data.sources[0]") for f in findings), findings
    assert any(f.rows == [4] and "4" in f.message for f in named), named


def test_the_planner_plans_the_mix_rows(tmp_path, tiny_llama, short_and_long):
    """core.estimate --config run.yaml --data-lengths: the largest batch of the rows the mix draws."""
    from core.estimate.cli import main

    a, b = short_and_long

    def planned(weights):
        cfg = _cfg(
            tiny_llama,
            [{"path": a, "weight": weights[0]}, {"path": b, "weight": weights[1]}],
            per_device_train_batch_size=4,
            padding_free=True,
        )
        dump_config(cfg, tmp_path / "run.yaml")
        out = in_process(
            main, "--config", str(tmp_path / "run.yaml"), "--data-lengths", "--device", "cpu", "--json"
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["data_batch"]

    mostly_long, mostly_short = planned((1, 3)), planned((3, 1))
    assert (
        mostly_long["rows"]
        == mix_preview.preview(
            _cfg(tiny_llama, [{"path": a, "weight": 1}, {"path": b, "weight": 3}]),
            _tokenizer(tiny_llama),
            n=0,
        )["total_rows"]
    )
    # the four longest rows the draw holds: long rows in both mixes, so the same batch; a short-only mix is less
    assert 0 < mostly_short["batch_tokens"] <= mostly_long["batch_tokens"] <= 4 * 128
    only_short = planned((1, 0.0001))
    assert only_short["rows"] > 0
