"""Broken input to the trainer is one sentence and exit 2, never a traceback (issue #11): a missing or incomplete
model folder, a corrupt config.json, corrupt weights, an empty conversation. Real CLI subprocesses."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.recipe.config import validate_config

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


def _main(module: str, *args) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (core.train, core.preflight) as its main(argv) in this process (tests/cli.py:
    in_process): the refusals without a new interpreter each; test_empty_conversation_is_a_preflight_row_not_a_crash
    and test_preflight_and_demo_clis_say_one_sentence keep the real commands (exit status, stderr)."""
    from core.train.cli import main as train_main
    from core.train.preflight import main as preflight_main
    from tests.cli import in_process

    return in_process({"core.train": train_main, "core.preflight": preflight_main}[module], *args)


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
        out = _main("core.train", str(cfg), *extra)
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

    from core.recipe.findings import check_model_folder
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
        (None, "config.json is nested too deeply to be read"),
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
        [sys.executable, "-m", "core.estimate", "--model", str(folder), "--tuning", "lora"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr[-2000:]


# ---- issue #42 item 2: a bad model folder is found at preflight, not after loading --------------------------


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_safetensors(path: Path, header: dict, data: bytes, size: int | None = None) -> None:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head + data)
        if size is not None:
            fh.truncate(8 + len(head) + size)  # a hole: nothing of it is written to disk


def _bad_folder(kind: str, model: Path, tmp: Path) -> Path:
    """A copy of `model` with one thing wrong that config.json, a header or the tokenizer's file shows."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp / kind
    shutil.copytree(model, folder)
    shard = folder / "model.safetensors"
    if kind == "wrong-shape":  # one projection of another model's size
        tensors = load_file(shard)
        tensors["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(48, 64)
        save_file(tensors, shard, metadata={"format": "pt"})
    elif kind == "broken-tokenizer":
        (folder / "tokenizer.json").write_text("")
    elif kind == "sparse-1tb":  # a header claiming a terabyte, over a file that holds a few hundred KiB
        header, data = _header(shard)
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        huge = 250_000_000_000  # float32s: 1 TB
        header["extra.weight"] = {"dtype": "F32", "shape": [huge], "data_offsets": [end, end + 4 * huge]}
        try:
            _write_safetensors(shard, header, data, size=end + 4 * huge)
        except OSError as exc:
            pytest.skip(f"this filesystem holds no 1 TB sparse file ({exc.strerror})")
    return folder


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        (
            "wrong-shape",
            [
                "model.safetensors: the tensor model.layers.1.self_attn.q_proj.weight is [48, 64], config.json "
                "implies [64, 64]",
                "put the matching config.json back",
            ],
        ),
        ("broken-tokenizer", ["the tokenizer file", "tokenizer.json is not valid JSON (it is empty)"]),
        (
            "sparse-1tb",
            [
                "header claims 931.32 GiB of tensors",
                "extra.weight alone 931.32 GiB",
                "config.json implies at most 340.2 KiB",
                "copy or download them again",
            ],
        ),
    ],
)
def test_a_bad_model_folder_is_refused_by_preflight_and_dry_run_in_one_sentence(
    tiny_llama, tmp_path, kind, says
):
    """Issue #42 item 2: dry-run and preflight passed wrong-shape weights and a 1 TB sparse file (training then
    ended in a size-mismatch traceback or a MemoryError), and said "Expecting value: line 1 column 1 (char 0)"
    for an empty tokenizer.json, naming no file."""
    model = _bad_folder(kind, tiny_llama, tmp_path)
    cfg = _config(tmp_path, model, ROWS)
    commands = [["core.train", str(cfg), "--dry-run"], ["core.preflight", str(cfg)]]
    if kind == "wrong-shape":  # the trainer refuses it too, before loading
        commands.append(["core.train", str(cfg), "--run-dir", str(tmp_path / "run")])
    for command in commands:
        out = _main(*command)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and len(errors) == 1, (command, out.stderr[-2000:])
        assert str(model) in errors[0] and all(s in errors[0] for s in says), (command, errors[0])
        assert "Traceback" not in out.stderr
    (model / "model.safetensors").unlink()


def test_models_whose_weights_fit_their_config_pass_the_shape_check(tiny_llama_tied, tiny_gpt2, tmp_path):
    """The shape check reads names as transformers loads them: tied embeddings stored once, GPT-2's prefix-less
    names, a base model saved without its head, a sharded checkpoint."""
    from transformers import AutoModel

    from core.demo.toy import build_tiny_model, tiny_config
    from core.train.preflight import check_model

    sharded = build_tiny_model(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    headless = tmp_path / "headless"
    AutoModel.from_config(tiny_config("llama")).save_pretrained(headless)  # names without "model."
    shutil.copy(tiny_llama_tied / "tokenizer.json", headless)
    for model in (tiny_llama_tied, tiny_gpt2, sharded, headless):
        assert check_model(str(model)) is None, model
    # and the same reading finds a wrong tensor in a shard, or under a name without the prefix
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sharded / index["weight_map"]["model.norm.weight"]
    header, data = _header(shard)
    header["model.norm.weight"]["shape"] = [16, 4]  # the same bytes, another shape
    _write_safetensors(shard, header, data)
    header, data = _header(headless / "model.safetensors")
    header["norm.weight"]["shape"] = [8, 8]
    _write_safetensors(headless / "model.safetensors", header, data)
    for model, name in ((sharded, "model.norm.weight"), (headless, "the tensor norm.weight")):
        problem = check_model(str(model))
        assert problem and name in problem and "config.json implies [64]" in problem, problem
