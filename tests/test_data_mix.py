"""Several data sources mixed into one run (`data.sources`, `data.mix`; issue #50 items 1, 2 and 6): the draw by
datasets' own interleave / concatenate / shuffle, the record of what was drawn in RUN/mix.json, and each bad input
refused in one sentence naming the source before anything is written."""

import json
from pathlib import Path

import pytest
import yaml

from core.recipe import methods, mix
from core.recipe.config import validate_config
from core.runs.__main__ import main as runs_main
from core.train.cli import main as train_main
from core.train.preflight import prepare_run
from tests.cli import in_process


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def two_sources(tmp_path):
    """A: 200 alpaca rows; B: 100 raw-text rows (two formats, one method's columns once tokenized)."""
    a = _jsonl(
        tmp_path / "general.jsonl", [{"instruction": f"Say a{i}", "output": f"a{i}"} for i in range(200)]
    )
    b = _jsonl(tmp_path / "domain.jsonl", [{"text": f"b{i} is b"} for i in range(100)])
    return a, b


def _cfg(model, sources, mix_section=None, method="sft", **data) -> dict:
    raw = {
        "method": method,
        "model": {"path": str(model)},
        "data": {"sources": sources, **({"mix": mix_section} if mix_section else {}), **data},
        "training": {"max_length": 64, "per_device_train_batch_size": 2, "max_steps": 2, "report_to": "none"},
    }
    return validate_config(raw)


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _by_source(record) -> list[int]:
    return [s["drawn"] for s in record["sources"]]


def test_interleave_draws_by_weight_the_same_for_one_seed(tiny_llama, two_sources):
    a, b = two_sources
    tok, sft = _tokenizer(tiny_llama), methods.get("sft")
    sources = [{"path": a, "weight": 3}, {"path": b, "weight": 1}]

    def drawn(seed):
        train, held, record = mix.draw(_cfg(tiny_llama, sources, {"seed": seed}), tok, sft)
        assert held is None and len(train) == record["train_rows"] == sum(_by_source(record))
        return record, [row["input_ids"] for row in train]

    first, rows = drawn(7)
    n_a, n_b = _by_source(first)
    # first_exhausted: the draw stops once A (200 rows, 3/4 of the draws) is used up: ~200 against ~67
    assert first["strategy"] == "interleave" and first["stopping_strategy"] == "first_exhausted"
    assert first["probabilities"] == [0.75, 0.25] and first["seed"] == 7
    assert 0.68 <= n_a / (n_a + n_b) <= 0.82, (n_a, n_b)
    again, rows_again = drawn(7)
    assert _by_source(again) == [n_a, n_b] and rows_again == rows
    other, rows_other = drawn(8)
    assert _by_source(other) != [n_a, n_b] and rows_other != rows
    # the record names each file by its fingerprint, so a rerun can tell it reads the same data
    files = first["sources"][0]["files"]
    assert files[0]["size"] == Path(a).stat().st_size and len(files[0]["sha256_first_mib"]) == 64


def test_rows_with_and_without_replacement_and_concat(tiny_llama, two_sources):
    a, b = two_sources
    tok, sft = _tokenizer(tiny_llama), methods.get("sft")
    sources = [{"path": a, "rows": 50}, {"path": b, "rows": 300, "replace": True}]
    train, _, record = mix.draw(_cfg(tiny_llama, sources), tok, sft)
    assert record["strategy"] == "concat" and _by_source(record) == [50, 300] and len(train) == 350
    ids = [tuple(r["input_ids"]) for r in train]
    assert len(set(ids[:50])) == 50  # without replacement: 50 different rows of A
    assert len(set(ids[50:])) <= 100 < 300  # with replacement: B's 100 rows, drawn again and again
    # concat of whole sources: every row of each, one after the other
    whole, _, record = mix.draw(_cfg(tiny_llama, [{"path": a}, {"path": b}]), tok, sft)
    assert _by_source(record) == [200, 100] and len(whole) == 300


def test_a_plain_data_path_config_is_unchanged(tiny_llama, two_sources):
    a, _ = two_sources
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama)},
            "data": {"path": a, "eval_split": 0.1},
            "training": {"max_length": 64},
        }
    )
    assert "sources" not in cfg["data"] and "mix" not in cfg["data"]
    tok, train, held, drawn = prepare_run(cfg)
    assert drawn is None and len(train) + len(held) == 200


@pytest.mark.slow
def test_a_mixed_run_trains_and_records_what_it_drew(tmp_path, tiny_llama, two_sources, workspace):
    a, b = two_sources
    run_dir = workspace / "runs" / "mixed"
    config = tmp_path / "run.yaml"
    raw = {
        "model": {"path": str(tiny_llama)},
        "lora": {"r": 4, "lora_alpha": 8},
        "data": {
            "sources": [{"path": a, "weight": 3}, {"path": b, "weight": 1}],
            "mix": {"strategy": "interleave", "stopping_strategy": "all_exhausted", "seed": 3},
            "eval_split": 0.1,
        },
        "training": {
            "max_length": 64,
            "per_device_train_batch_size": 4,
            "max_steps": 3,
            "logging_steps": 1,
            "eval_steps": 3,
            "save_steps": 1000,
            "report_to": "none",
            "gradient_checkpointing": False,
        },
    }
    config.write_text(yaml.safe_dump(raw))
    done = in_process(train_main, str(config), "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    record = json.loads((run_dir / "mix.json").read_text())
    assert record["seed"] == 3 and record["stopping_strategy"] == "all_exhausted"
    assert sum(s["train"] for s in record["sources"]) == record["train_rows"]
    assert sum(s["eval"] for s in record["sources"]) == record["eval_rows"] > 0
    # all_exhausted: A is drawn whole at least once, B again and again at its share
    general, domain = record["sources"]
    assert general["drawn"] >= 200 and domain["available"] == 100 and general["source"] == "general.jsonl"
    shown = in_process(runs_main, "show", "mixed", "--workspace", str(workspace))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any(
        line.strip().startswith("data         2 sources: general.jsonl, domain.jsonl") for line in lines
    )
    src = [line for line in lines if line.strip().startswith("source ")]
    assert len(src) == 2 and "general.jsonl: weight 3" in src[0] and "domain.jsonl: weight 1" in src[1]
    assert f"{general['drawn']} of 200 rows drawn" in src[0] and "sha256 " in src[0]


def _refused(tmp_path, raw: dict) -> str:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "runs" / "bad"
    done = in_process(train_main, str(config), "--run-dir", str(run_dir))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert not run_dir.exists() and not (tmp_path / "runs").exists()  # nothing written
    return done.stderr


def test_bad_sources_are_refused_in_one_sentence_naming_the_source(tmp_path, tiny_llama, two_sources):
    a, b = two_sources
    prefs = _jsonl(tmp_path / "prefs.jsonl", [{"prompt": "Hi", "chosen": "Hello", "rejected": "Go"}] * 8)

    def raw(sources, **data):
        return {
            "model": {"path": str(tiny_llama)},
            "data": {"sources": sources, **data},
            "training": {"max_length": 64},
        }

    cases = [
        (
            raw([{"path": a, "weight": 3}, {"path": b, "weight": 0}]),
            "data.sources[1] (domain.jsonl): weight must be > 0 (got 0).",
        ),
        (
            raw([{"path": a, "weight": 0}, {"path": b, "weight": 0}]),
            "data.sources: every weight is 0, so nothing would be drawn",
        ),
        (
            raw([{"path": a, "weight": 3}, {"path": b, "rows": 10}]),
            "data.sources: data.sources[0] (general.jsonl) gives a weight and data.sources[1] (domain.jsonl) gives "
            "rows",
        ),
        (
            raw([{"path": a}, {"path": b, "rows": 500}]),
            "data.sources[1] (domain.jsonl): rows 500 is more than the 100 rows it has, and rows are drawn without "
            "replacement",
        ),
        (
            raw([{"path": a}, {"path": str(tmp_path / "missing.jsonl")}]),
            "data.sources[1] (missing.jsonl): ",
        ),
        (
            raw([{"path": a}, {"path": prefs}]),
            "data.sources[1] (prefs.jsonl): its rows are DPO data",
        ),
        (
            {**raw([{"path": a}]), "data": {"path": a, "sources": [{"path": b}]}},
            "data.path and data.sources are both set",
        ),
    ]
    for config, sentence in cases:
        err = _refused(tmp_path, config)
        assert sentence in err, (sentence, err)
    assert "does not exist" in _refused(tmp_path, cases[4][0])


def test_preference_sources_of_two_shapes_cannot_mix(tmp_path, tiny_llama):
    """DPO pairs as texts and as message lists: one Arrow column holds one type, so the mix is refused naming
    both sources, before the run folder."""
    standard = _jsonl(
        tmp_path / "std.jsonl", [{"prompt": f"Q{i}", "chosen": "yes", "rejected": "no"} for i in range(8)]
    )
    conv = [
        {
            "chosen": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "yes"}],
            "rejected": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "no"}],
        }
        for i in range(8)
    ]
    chat = _jsonl(tmp_path / "chat.jsonl", conv)
    raw = {
        "method": "dpo",
        "model": {"path": str(tiny_llama)},
        "data": {"sources": [{"path": standard, "weight": 1}, {"path": chat, "weight": 1}]},
        "training": {"max_length": 64, "per_device_train_batch_size": 2},
    }
    err = _refused(tmp_path, raw)
    assert "data.sources[1] (chat.jsonl) cannot be mixed with data.sources[0] (std.jsonl)" in err, err


HUB_README = (
    "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train.jsonl\n---\n"
)


@pytest.mark.slow
def test_a_hub_source_mixes_with_a_file_at_its_recorded_commit(tmp_path, tiny_llama, two_sources):
    """One source served by the project's Hub test server (olah on 127.0.0.1), one local file: the Hub source is
    fetched whole at its commit (never a streamed sample), mapped by its own columns, and mix.json names the commit."""
    pytest.importorskip("olah")
    from tests.hub_server import HubServer

    server = HubServer(tmp_path / "server")
    rows = "".join(json.dumps({"question": f"Repeat: h{i}", "answer": f"h{i}"}) + "\n" for i in range(40))
    commit = server.publish("acme/rows", {"README.md": HUB_README, "train.jsonl": rows}, "dataset")
    a, _ = two_sources
    raw = {
        "model": {"path": str(tiny_llama)},
        "data": {
            "sources": [
                {"path": a, "rows": 20},
                {"path": "acme/rows", "columns": {"instruction": "question", "output": "answer"}, "rows": 30},
            ]
        },
        "training": {"max_length": 64, "max_steps": 1, "report_to": "none", "gradient_checkpointing": False},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    server.start()
    try:
        done = server.run(
            ["-m", "core.train", str(config), "--run-dir", str(tmp_path / "run")], tmp_path / "hf"
        )
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "mix.json").read_text())
    hub = record["sources"][1]
    assert hub["hub"] == {"id": "acme/rows", "revision": "main", "commit": commit}
    assert hub["available"] == 40 and hub["drawn"] == 30 and record["sources"][0]["drawn"] == 20
