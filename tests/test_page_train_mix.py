"""The Train page adds and weighs data sources (issue #50 item 4), through AppTest on a tiny local model: a row
each with its row count, format and first rows, the mix's length histogram, preflight naming the source, a
YAML with data.sources loaded into the editor and read back, and a launched run drawing the mix."""

import json
import time
from pathlib import Path

import pytest
import yaml
from streamlit.testing.v1 import AppTest

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "train.py")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def two_files(tmp_path):
    a = _jsonl(
        tmp_path / "general.jsonl",
        [{"instruction": f"Add one to {i}", "output": f"{i + 1}"} for i in range(60)],
    )
    b = _jsonl(tmp_path / "domain.jsonl", [{"text": f"{i} " + "z" * 120} for i in range(20)])
    return a, b


def _page(workspace: Path, model: Path, data: dict) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = {
        "model": {"path": str(model)},
        "data": data,
        "training": {
            "max_length": 192,
            "per_device_train_batch_size": 2,
            "max_steps": 2,
            "logging_steps": 1,
            "save_steps": 1000,
        },
    }
    at.run()
    assert not at.exception, at.exception
    return at


def _captions(at) -> list[str]:
    return [c.value for c in at.caption]


def test_a_second_source_is_added_weighed_previewed_and_launched(workspace, tiny_llama, two_files):
    a, b = two_files
    at = _page(workspace, tiny_llama, {"path": str(a)})
    at.button(key="tr_mix_start").click().run()
    assert at.text_input(key="tr_mx0_path").value == str(a)
    assert not any(w.key == "tr_data_path" for w in at.text_input)  # the one Dataset file became source 1
    at.text_input(key="tr_mx1_path").set_value(str(b)).run()
    at.number_input(key="tr_mx0_weight").set_value(1.0).run()
    at.number_input(key="tr_mx1_weight").set_value(3.0).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    captions = _captions(at)
    assert "60 rows, format **alpaca**" in captions and "20 rows, format **text**" in captions, captions
    raw = at.session_state["train_config"]
    assert raw["data"]["path"] is None and "format" not in raw["data"]["sources"][1]
    assert [s["weight"] for s in raw["data"]["sources"]] == [1.0, 3.0]
    # the mix's preview: drawn counts per source, its first rows with their source, the histogram of its draw
    drawn = next(c for c in captions if "rows drawn from 2 sources" in c)
    assert "general.jsonl" in drawn and "domain.jsonl 20 of 20" in drawn, drawn
    lengths = at.session_state["data_lengths"]
    long = sum(n > 100 for n in lengths)
    assert long and 0.55 <= long / len(lengths) <= 0.95, (long, len(lengths))  # B weighs 3 of 4, not 20 of 80
    assert at.get("vega_lite_chart"), "the mix's length histogram"
    assert any(s.value.startswith("Preflight: no problems") for s in at.success), (
        [s.value for s in at.success],
        [w.value for w in at.warning],
    )
    # launched: the run's config holds the sources, and it draws the mix
    assert not at.button(key="tr_launch").disabled
    at.button(key="tr_launch").click().run()
    # launched, the page goes on to the Monitor (a page AppTest's one-page app cannot switch to)
    assert all("pages/monitor.py" in e.message for e in at.exception), at.exception
    configs = list((workspace / "runs").glob("*/config.yaml"))
    assert len(configs) == 1
    saved = yaml.safe_load(configs[0].read_text())
    assert [s["path"] for s in saved["data"]["sources"]] == [str(a), str(b)]
    record, deadline = configs[0].parent / "mix.json", time.time() + 240
    while not record.exists() and time.time() < deadline:
        time.sleep(1)
    assert record.exists(), (
        (configs[0].parent / "stderr.log").read_text()[-2000:]
        if (configs[0].parent / "stderr.log").exists()
        else ""
    )
    assert [s["source"] for s in json.loads(record.read_text())["sources"]] == [
        "general.jsonl",
        "domain.jsonl",
    ]


def test_a_yaml_mix_fills_the_editor_and_names_a_bad_source(workspace, tiny_llama, two_files, tmp_path):
    a, _ = two_files
    bad = _jsonl(
        tmp_path / "empty.jsonl",
        [{"instruction": "Say hi", "output": "hi"}] * 3 + [{"instruction": "x", "output": ""}],
    )
    sources = [
        {"path": str(a), "rows": 30, "replace": True},
        {"path": str(bad), "rows": 4, "columns": {"output": "output"}},
    ]
    at = _page(workspace, tiny_llama, {"sources": sources, "mix": {"seed": 9}})
    assert at.text_input(key="tr_mx1_path").value == str(bad)
    assert any(c == "rows 30 (with replacement)" for c in _captions(at)), _captions(at)
    raw = at.session_state["train_config"]["data"]
    assert raw["sources"] == sources and raw["mix"] == {"seed": 9}  # read back as it came
    errors = [e.value for e in at.error]
    assert any("data.sources[1] (empty.jsonl): " in e and "4" in e for e in errors), errors
    assert at.button(key="tr_launch").disabled
    missing = tmp_path / "gone.jsonl"
    at.text_input(key="tr_mx1_path").set_value(str(missing)).run()
    assert any(e.value.startswith("data.sources[1] (gone.jsonl): ") for e in at.error), [
        e.value for e in at.error
    ]
    # removing the second source gives the one Dataset file back
    at.button(key="tr_mx1_remove").click().run()
    assert at.text_input(key="tr_data_path").value == str(a)
    assert "sources" not in at.session_state["train_config"]["data"]
