"""Training on a Hub model and a Hub dataset by id (issue #35), against olah on 127.0.0.1 (tests/hub_server.py):
the run fetches both (progress in the run folder), records their commits, trains, and refuses a resume once the
model's branch points at another commit; the Train page launches a run on the ids from the cache (offline). The
tests run in this order: the last one moves the model's main branch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.hub_server import HubServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        subprocess.run([sys.executable, "-c", "import olah"], capture_output=True).returncode != 0,
        reason="olah is not installed (pip install -r requirements.txt)",
    ),
]

README = (
    "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train.jsonl\n---\n"
)
ROWS = [{"question": f"Repeat: {w}", "answer": w} for w in ("abc", "hello", "xyz", "data") * 8]


def run_config(**training) -> dict:
    """A demo-size run: 4 steps of a rank-4 adapter on 32 rows, question/answer mapped to alpaca."""
    return {
        "model": {"path": "acme/tiny"},
        "data": {
            "path": "acme/rows",
            "columns": {"instruction": "question", "output": "answer"},
            "eval_split": 0.125,  # 4 rows held out: what the evaluation reads back at the recorded commit
        },
        "lora": {"r": 4, "lora_alpha": 8},
        "training": {
            "max_length": 64,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "max_steps": 4,
            "save_steps": 2,
            "logging_steps": 1,
            "learning_rate": 1e-3,
            "gradient_checkpointing": False,
            **training,
        },
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from core.demo.toy import build_tiny_model

    root = tmp_path_factory.mktemp("hub")
    server = HubServer(root / "server")
    server.commit_tiny = server.publish_folder("acme/tiny", build_tiny_model(root / "tiny", "llama"))
    rows = "".join(json.dumps(r) + "\n" for r in ROWS)
    server.commit_rows = server.publish("acme/rows", {"README.md": README, "train.jsonl": rows}, "dataset")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def trained(hub, tmp_path_factory):
    """One run trained by `python -m core.train` on the two ids, neither in the cache beforehand."""
    root = tmp_path_factory.mktemp("trained")
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(run_config()))
    run = root / "run"
    proc = hub.run(["-m", "core.train", str(config), "--run-dir", str(run)], root / "hf")
    return root / "hf", config, run, proc


def test_a_run_on_hub_ids_fetches_them_records_their_commits_and_trains(hub, trained, monkeypatch):
    from core.hub.fetch import complete_folder
    from core.hub.ids import HubRef
    from core.train.sources import labels

    home, _, run, proc = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    sources = json.loads((run / "sources.json").read_text())
    assert sources["model"] == {
        "id": "acme/tiny",
        "revision": "main",
        "commit": hub.commit_tiny,
        "type": "model",
    }
    assert sources["data"]["commit"] == hub.commit_rows and sources["data"]["type"] == "dataset"
    assert labels(run) == {
        "model": f"acme/tiny @ {hub.commit_tiny[:7]}",
        "data": f"acme/rows @ {hub.commit_rows[:7]}",
    }
    progress = json.loads((run / "download.json").read_text())  # the last report the Monitor drew
    assert progress["final"] and progress["bytes_done"] == progress["bytes_total"] > 0
    assert "hub: acme/tiny" in proc.stdout and "hub: model.path acme/tiny is acme/tiny @ " in proc.stdout
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 4
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    # the fail-fast preflight's streamed sample (datasets reads a file this small whole, twice: its features, then
    # its rows), then the download of the whole split: once
    assert hub.gets("acme/rows", "train.jsonl", "dataset") == 3
    monkeypatch.setenv("HF_HOME", str(home))  # the cache the run filled: complete, never half-written
    assert complete_folder(HubRef("acme/tiny", None)) is not None
    assert complete_folder(HubRef("acme/rows", None, "dataset")) is not None


def test_the_pages_launch_a_run_on_the_ids_and_show_the_cache(hub, trained, tmp_path, monkeypatch):
    """Offline (the tests' own setting), through the router: the sidebar names the Hub, the Train page previews,
    checks and launches a run on the two ids from the cache the first run filled, the Monitor follows it, and the
    Models page lists the cached model and dataset."""
    from streamlit.testing.v1 import AppTest

    from core.runs.launcher import wait_for

    monkeypatch.setenv("HF_HOME", str(trained[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    ws = tmp_path / "ws"
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "dashboard.py"), default_timeout=300)
    at.session_state["workspace"] = str(ws)
    at.session_state["train_config"] = run_config(max_steps=2)
    at.run()
    assert any(hub.endpoint in c.value and "offline" in c.value for c in at.sidebar.caption)
    at.switch_page("pages/train.py").run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert any(s.value.startswith("Preflight: no problems") for s in at.success)
    assert at.dataframe[0].value["completion"].iloc[0].startswith("abc")  # the dataset's rows, from the cache
    at.button(key="tr_launch").click().run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Monitor"
    run = Path(at.session_state["monitor_run"])
    info = wait_for(run, timeout=600)
    assert info.state == "finished", (info.reason, (run / "stderr.log").read_text()[-2000:])
    assert json.loads((run / "sources.json").read_text())["model"]["commit"] == hub.commit_tiny
    at.switch_page("pages/models.py").run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert set(table["id"]) == {"acme/tiny", "acme/rows"} and set(table["type"]) == {"model", "dataset"}
    assert all("main @ " in r for r in table["revisions"]) and not any(
        "partial" in r for r in table["revisions"]
    )


def test_evaluate_merge_and_gguf_take_the_hub_id(hub, trained, tmp_path):
    """Every CLI that takes a model path takes the id (offline here: the run's cache holds it)."""
    home, _, run, _ = trained
    proc = hub.run(
        ["-m", "core.eval", "--run", str(run), "--limit", "4", "--max-new-tokens", "4"], home, True
    )
    assert proc.returncode == 0 and "eval: exact match" in proc.stdout, proc.stderr[-2000:]
    out = tmp_path / "merged"
    args = ["--base", "acme/tiny", "--adapter", str(run / "adapter"), "--out", str(out), "--verify", "quick"]
    proc = hub.run(["-m", "core.merge", *args], home, True)
    assert proc.returncode == 0 and (out / "config.json").is_file(), proc.stderr[-2000:]
    gguf = tmp_path / "tiny.gguf"
    proc = hub.run(
        ["-m", "core.gguf", "--model", "acme/tiny", "--out", str(gguf), "--verify", "quick"], home, True
    )
    assert proc.returncode == 0 and gguf.is_file(), proc.stderr[-2000:]
    proc = hub.run(["-m", "core.merge", "--base", "acme/other", *args[2:]], home, True)
    assert proc.returncode == 2 and "acme/other is not in the local Hugging Face cache" in proc.stderr


def test_resume_on_another_commit_is_refused_in_one_sentence(hub, trained):
    home, config, run, _ = trained
    new = hub.publish("acme/tiny", {"README.md": "a new commit on main"})
    proc = hub.run(["-m", "core.train", str(config), "--run-dir", str(run), "--resume"], home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert f"is now acme/tiny @ {new[:7]}, but this run trained on acme/tiny @ {hub.commit_tiny[:7]}" in line
    assert f"model.path: acme/tiny@{hub.commit_tiny}" in line  # how to resume it
    assert json.loads((run / "status.json").read_text())["state"] == "finished"  # nothing touched
