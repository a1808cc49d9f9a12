"""Broken input to the trainer is one sentence and exit 2, never a traceback (issue #11): a missing or incomplete
model folder, a corrupt config.json, corrupt weights, an empty conversation. Real CLI subprocesses."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.train.config import validate_config

ROOT = Path(__file__).resolve().parents[1]


def _break(kind: str, model: Path, tmp: Path) -> Path:
    folder = tmp / kind
    if kind == "missing":
        return folder
    shutil.copytree(model, folder)
    if kind == "incomplete":
        for p in folder.iterdir():
            if p.name != "config.json":
                p.unlink()
    elif kind == "corrupt-config":
        (folder / "config.json").write_text("{not json")
    elif kind == "truncated-weights":
        shard = next(folder.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "garbage-weights":
        next(folder.glob("*.safetensors")).write_bytes(b"\xff" * 64)
    return folder


def _config(tmp: Path, model: Path, rows: list[dict]) -> Path:
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = validate_config(
        {"model": {"path": str(model)}, "data": {"path": str(data)}, "training": {"max_steps": 1}}
    )
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


ROWS = [{"instruction": "Say hi", "output": "hi"}] * 4


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "does not exist. Nothing is downloaded here"),
        ("incomplete", "has no tokenizer files"),
        ("corrupt-config", "config.json is not valid JSON"),
        ("truncated-weights", "is truncated"),
        ("garbage-weights", "is not a valid safetensors file"),
    ],
)
def test_broken_model_folder_is_one_sentence(tmp_path, tiny_llama, kind, message):

    cfg = _config(tmp_path, _break(kind, tiny_llama, tmp_path), ROWS)
    for extra in (["--dry-run"], ["--run-dir", str(tmp_path / "run")]):
        out = subprocess.run(
            [sys.executable, "-m", "core.train", str(cfg), *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and len(errors) == 1 and message in errors[0], out.stderr[-2000:]
        assert "Traceback" not in out.stderr


def test_empty_conversation_is_a_preflight_row_not_a_crash(tmp_path, tiny_llama):

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    cfg = _config(tmp_path, tiny_llama, [{"messages": []}, good, {"messages": ["not a message"]}, good])
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(cfg), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "rows 1, 3" in out.stderr and "empty" in out.stderr


def test_preflight_and_demo_clis_say_one_sentence(tmp_path, tiny_llama):
    cfg = _config(tmp_path, tmp_path / "no-such-model", ROWS)
    for argv, message in (
        (["-m", "core.preflight", str(cfg)], "model.path: the folder"),
        (
            ["-m", "core.demo", "--out", "/proc/lora-cockpit-demo"],
            "cannot write the demo into /proc/lora-cockpit-demo",
        ),
    ):
        out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and len(errors) == 1 and message in errors[0], out.stderr[-1500:]
        assert "Traceback" not in out.stderr


def test_weights_that_contradict_config_json_are_one_sentence_before_loading(tiny_llama, tmp_path):
    """Issue #21 item 13: --dry-run passed and training raised a size-mismatch traceback."""
    import json
    import shutil
    import subprocess
    import sys

    from core.train.findings import check_model_folder
    from tests.cli import REPO

    assert check_model_folder(str(tiny_llama)) is None
    for key, value, says in (
        ("vocab_size", 500, "config.json says vocab_size 500"),
        ("num_hidden_layers", 5, "config.json says num_hidden_layers 5"),
    ):
        model = tmp_path / key
        shutil.copytree(tiny_llama, model)
        cfg = json.loads((model / "config.json").read_text())
        cfg[key] = value
        (model / "config.json").write_text(json.dumps(cfg))
        problem = check_model_folder(str(model))
        assert problem and says in problem and "put the matching config.json back" in problem, problem
        data = tmp_path / "d.jsonl"
        data.write_text('{"text": "hello"}\n')
        run = tmp_path / f"{key}.yaml"
        run.write_text(f"model: {{path: {model}}}\ndata: {{path: {data}}}\n")
        out = subprocess.run(
            [sys.executable, "-m", "core.train", str(run), "--dry-run"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[
            -2000:
        ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"128"', 'hidden_size is "128", not a number'),
        ("true", "hidden_size is true, not a number"),
        ("[128]", "is not a valid llama config"),
        (None, "is nested too deeply to be a model config"),
    ],
)
def test_a_config_json_of_the_wrong_shape_is_one_sentence_in_the_planner(
    tmp_path, tiny_llama, value, message
):
    """config.json sizes of the wrong type, or a file nested 200k deep: `core.estimate` says so in one sentence
    (it once showed huggingface_hub's validation traceback, or a RecursionError)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    if value is None:
        (folder / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    else:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["hidden_size"] = json.loads(value)
        (folder / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "core.estimate", "--model", str(folder), "--method", "lora"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr[-2000:]
