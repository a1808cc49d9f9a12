"""Merge safety and broken input (issue 11), on real files: tiny models built here, the CLI's main in this process
for its refusals (merge_main) and real `python -m core.merge` subprocesses for paths, exit status and kills.

A wrong base (another config, or the same config with other weights than the adapter recorded) or vocabulary
is refused unless forced; broken adapters, shards and configs get one sentence on
stderr and exit 2 with nothing written; a killed merge's temp folder is cleaned by the next merge into the same
folder; on the CLI relative paths start from the current folder and any writable --out is allowed, while the
page-facing functions keep writing only inside the workspace.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core import merge, tempdirs
from core.demo.toy import build_tiny_model

REPO = Path(__file__).resolve().parent.parent


def lora_model(base: Path, seed: int = 0, **lora_kwargs):
    """A real peft model on `base` (every trainable tensor perturbed, so verification sees it change the model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
        LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **lora_kwargs}),
    )
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def make_adapter(base: Path, out: Path, seed: int = 0, **lora_kwargs) -> Path:
    """A real peft adapter saved with save_pretrained, as adapters from elsewhere are (no fingerprint)."""
    lora_model(base, seed, **lora_kwargs).save_pretrained(str(out))
    return out


def run_cli(*args: str, cwd: Path = REPO, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    # PYTHONPATH: the CLI must also run from a folder other than the repo (relative-path cases).
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "core.merge", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def merge_main(*args: str) -> subprocess.CompletedProcess:
    """The merge CLI's main(argv) in this process (tests/cli.py: in_process): the same checks without a new
    interpreter; run_cli keeps the real `python -m core.merge` for the path and exit-status tests."""
    from core.merge.__main__ import main
    from tests.cli import in_process

    return in_process(main, *args)


def assert_refused(r: subprocess.CompletedProcess, out: Path, *phrases: str) -> None:
    """Exit 2, exactly one 'error: ...' line on stderr naming `phrases`, no traceback, nothing at `out`."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.merging-*"))


@pytest.fixture()
def adapter(tiny_llama, tmp_path) -> Path:
    return make_adapter(tiny_llama, tmp_path / "adapter")


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- the adapter's recorded base and vocabulary -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, differs",
    [({"num_hidden_layers": 3}, "num_hidden_layers 2 vs 3"), ({"vocab_size": 120}, "vocab_size 102 vs 120")],
)
def test_cli_refuses_a_base_other_than_the_recorded_one_unless_forced(
    overrides, differs, tiny_llama, adapter, tmp_path, workspace
):
    # Same hidden size, so every adapter tensor fits: today this merges silently into the wrong model.
    other = build_tiny_model(tmp_path / "other", "llama", **overrides)
    out = workspace / "exports" / "m"
    r = merge_main("--base", str(other), "--adapter", str(adapter), "--out", str(out))
    assert_refused(r, out, str(tiny_llama), str(other), differs, "--force")

    forced = merge_main("--base", str(other), "--adapter", str(adapter), "--out", str(out), "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert (out / "config.json").is_file() and "force" in forced.stdout


def test_page_functions_refuse_a_mismatched_base_unless_forced(tiny_llama, adapter, tmp_path, workspace):
    other = build_tiny_model(tmp_path / "other", "llama", num_hidden_layers=3)
    with pytest.raises(merge.MergeError, match="base_model_name_or_path"):
        merge.preflight(other, adapter, "exports/p", workspace=workspace)
    with pytest.raises(merge.MergeError, match="base_model_name_or_path"):
        merge.merge(other, adapter, "exports/p", workspace=workspace)
    assert not (workspace / "exports" / "p").exists()
    pf, _ = merge.preflight(other, adapter, "exports/p", workspace=workspace, force=True)
    assert pf.ok and any("num_hidden_layers" in n for n in pf.notes)


def test_a_copy_of_the_recorded_base_or_an_unknown_hub_id_is_accepted(
    tiny_llama, adapter, tmp_path, workspace
):
    # Same config content in another folder: the same model moved or copied, not a different one.
    copy = copy_model(tiny_llama, tmp_path / "copy")
    pf, _ = merge.preflight(copy, adapter, "exports/c", workspace=workspace)
    assert pf.ok
    # A hub id that is neither a local folder nor cached cannot be compared: merged, with a note saying so.
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "some-org/not-cached-anywhere"
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    pf, _ = merge.preflight(tiny_llama, adapter, "exports/c", workspace=workspace)
    assert pf.ok and any("some-org/not-cached-anywhere" in n for n in pf.notes)


# ---- the base weights the adapter was trained on (issue 21 item 4) ------------------------------------------


def trained_adapter(base: Path, run_dir: Path) -> Path:
    """A real adapter on `base` saved by the trainer's own save_final, as a run saves it (with the tokenizer and
    the record of its base)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from core.train.model import save_final

    cfg = {"lora": {"enabled": True}, "model": {"path": str(base)}}
    tok = AutoTokenizer.from_pretrained(str(base))
    return save_final(SimpleNamespace(model=lora_model(base)), tok, run_dir, cfg)


@pytest.fixture()
def finetune(tiny_llama, tmp_path) -> Path:
    """Another fine-tune of the same model: config.json identical, other weights (Llama-3.1-8B vs -Instruct)."""
    other = build_tiny_model(tmp_path / "finetune", "llama", seed=1)
    assert (other / "config.json").read_text() == (tiny_llama / "config.json").read_text()
    return other


@pytest.mark.slow
def test_cli_refuses_another_finetune_of_the_base_the_adapter_was_trained_on(
    tiny_llama, finetune, tmp_path, workspace
):
    adapter = trained_adapter(tiny_llama, tmp_path / "run")
    out = workspace / "exports" / "m"
    r = merge_main("--base", str(finetune), "--adapter", str(adapter), "--out", str(out))
    assert_refused(
        r, out, f"trained on {tiny_llama}", str(finetune), "other values", "--force", "Merge anyway"
    )
    assert json.loads((adapter / "base_fingerprint.json").read_text())["base"] == str(tiny_llama)

    same = merge_main("--base", str(tiny_llama), "--adapter", str(adapter), "--out", str(out))
    assert same.returncode == 0, same.stderr[-3000:]
    assert "verification (full): PASSED" in same.stdout and "note:" not in same.stdout, same.stdout

    forced_out = workspace / "exports" / "forced"
    forced = merge_main(
        "--base", str(finetune), "--adapter", str(adapter), "--out", str(forced_out), "--force"
    )
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert (forced_out / "config.json").is_file()
    notes = [line for line in forced.stdout.splitlines() if line.strip().startswith("note:")]
    assert any("Merging anyway (forced)" in n and f"trained on {tiny_llama}" in n for n in notes), (
        forced.stdout
    )


def test_page_functions_refuse_another_finetune_unless_forced(tiny_llama, finetune, tmp_path, workspace):
    adapter = trained_adapter(tiny_llama, tmp_path / "run")
    with pytest.raises(merge.MergeError, match="holds other weights"):
        merge.preflight(finetune, adapter, "exports/f", workspace=workspace)
    pf, _ = merge.preflight(finetune, adapter, "exports/f", workspace=workspace, force=True)
    assert pf.ok and any("forced" in n and "other weights" in n for n in pf.notes)
    # The same weights anywhere (a copy in another folder) are the base it was trained on: no note at all.
    pf, _ = merge.preflight(
        copy_model(tiny_llama, tmp_path / "copy"), adapter, "exports/c", workspace=workspace
    )
    assert pf.ok and pf.notes == []


def test_an_adapter_without_a_recorded_base_merges_with_a_note(tiny_llama, adapter, workspace):
    pf, _ = merge.preflight(tiny_llama, adapter, "exports/n", workspace=workspace)
    assert pf.ok and any("no base_fingerprint.json" in n and "only config.json" in n for n in pf.notes)
    (adapter / "base_fingerprint.json").write_text("{not json")
    pf, _ = merge.preflight(tiny_llama, adapter, "exports/n", workspace=workspace)
    assert pf.ok and any("base_fingerprint.json cannot be read" in n for n in pf.notes)


def test_fingerprint_reads_little_and_ignores_where_and_how_the_weights_are_stored(
    tiny_llama, finetune, tmp_path
):
    from transformers import AutoModelForCausalLM

    from core.merge.fingerprint import WINDOW, _windows, fingerprint

    fp = fingerprint(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    (tmp_path / "bin").mkdir()  # a classic PyTorch checkpoint (transformers 5 no longer writes .bin)
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    shutil.copy(tiny_llama / "config.json", tmp_path / "bin")
    for same in (copy_model(tiny_llama, tmp_path / "copy"), tmp_path / "sharded", tmp_path / "bin"):
        assert fingerprint(same) == fp, same
    other = fingerprint(finetune)
    assert other.layout == fp.layout and other.values != fp.values
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    assert fp.differs_from(fingerprint(tmp_path / "bf16")) == "other tensor names, shapes or dtypes"
    # An 8B model's embedding (128,256 x 4,096 bf16, 1 GB) is sampled in three windows, not read.
    windows = _windows(128_256 * 4096, 2)
    assert len(windows) == 3 and sum(stop - start for start, stop in windows) * 2 == 3 * WINDOW


def _adapter_with_tokenizer(tiny_llama: Path, adapter: Path, edit) -> None:
    """Save a tokenizer into the adapter folder (as the trainer does), changed by `edit`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    tok.save_pretrained(str(adapter))
    edit(tok, adapter)


def _renumber(tok, adapter: Path) -> None:
    data = json.loads((adapter / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # a tokenizer of another model: same tokens, other ids
    (adapter / "tokenizer.json").write_text(json.dumps(data))


def _add_tokens(tok, adapter: Path) -> None:
    tok.add_tokens(["<tool>", "</tool>", "<think>"])  # added in training, embeddings never saved
    tok.save_pretrained(str(adapter))


@pytest.mark.parametrize(
    "edit, phrase",
    [(_renumber, "numbers tokens differently"), (_add_tokens, "105 tokens but the merged model")],
)
def test_vocabulary_mismatch_is_refused_unless_forced(edit, phrase, tiny_llama, adapter, workspace):
    _adapter_with_tokenizer(tiny_llama, adapter, edit)
    with pytest.raises(merge.MergeError, match=phrase):
        merge.preflight(tiny_llama, adapter, "exports/v", workspace=workspace)
    pf, _ = merge.preflight(tiny_llama, adapter, "exports/v", workspace=workspace, force=True)
    assert pf.ok and any(phrase in n for n in pf.notes)


# ---- broken input: one sentence, exit 2, nothing written ----------------------------------------------------


def _config_not_json(adapter: Path, base: Path) -> tuple[Path, Path, tuple]:
    (adapter / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"')
    return base, adapter, (str(adapter / "adapter_config.json"), "not valid JSON", "save_pretrained")


def _config_not_object(adapter: Path, base: Path):
    (adapter / "adapter_config.json").write_text('["q_proj"]')
    return base, adapter, (str(adapter / "adapter_config.json"), "JSON object", "save_pretrained")


def _drop(key: str):
    def case(adapter: Path, base: Path):
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        del cfg[key]
        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
        return base, adapter, (str(adapter / "adapter_config.json"), f"no {key!r}", "save_pretrained")

    case.__name__ = f"_config_without_{key}"
    return case


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _adapter_header_cut(adapter: Path, base: Path):
    _truncate(adapter / "adapter_model.safetensors", 40)  # inside the JSON header
    return base, adapter, (str(adapter / "adapter_model.safetensors"), "truncated", "again")


def _adapter_data_cut(adapter: Path, base: Path):
    _truncate(adapter / "adapter_model.safetensors", -100)  # header intact, tensor data short
    return base, adapter, (str(adapter / "adapter_model.safetensors"), "truncated", "again")


def _base_header_garbage(adapter: Path, base: Path):
    shard = base / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:24] = b"\xff" * 16  # header length intact, JSON destroyed
    shard.write_bytes(bytes(data))
    return base, adapter, (str(shard), "corrupt", "again")


def _base_shard_cut(adapter: Path, base: Path):
    _truncate(base / "model.safetensors", 100)
    return base, adapter, (str(base / "model.safetensors"), "truncated", "again")


def _base_without_config(adapter: Path, base: Path):
    (base / "config.json").unlink()
    return base, adapter, (str(base), "config.json", "--base")


def _base_config_not_json(adapter: Path, base: Path):
    (base / "config.json").write_text('{"model_type": "llama", ')
    return base, adapter, (str(base / "config.json"), "not valid JSON", "again")


def _base_config_not_object(adapter: Path, base: Path):
    (base / "config.json").write_text("42")
    return base, adapter, (str(base / "config.json"), "JSON object", "again")


def _alpha_nan(adapter: Path, base: Path):
    # json reads NaN: the update's scale would be unknown (the merge once fell back to a default alpha, silently)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["lora_alpha"] = float("nan")
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    return base, adapter, ("lora_alpha nan", "not a finite number")


def _config_nested(adapter: Path, base: Path):
    (adapter / "adapter_config.json").write_text("[" * 200_000 + "]" * 200_000)
    return base, adapter, (str(adapter / "adapter_config.json"), "nested too deeply")


def _base_config_implausible(adapter: Path, base: Path):
    # the export would carry this config.json on: refused as estimate, train and gguf refuse it
    cfg = json.loads((base / "config.json").read_text())
    cfg["hidden_size"] = 10**12
    (base / "config.json").write_text(json.dumps(cfg))
    return base, adapter, (str(base / "config.json"), "which no real model has")


def _adapter_missing(adapter: Path, base: Path):
    missing = adapter.parent / "no-such-adapter"
    return base, missing, (str(missing), "does not exist", "--adapter")


BROKEN = [
    _config_not_json,
    _config_not_object,
    _drop("r"),
    _drop("target_modules"),
    _adapter_header_cut,
    _adapter_data_cut,
    _base_header_garbage,
    _base_shard_cut,
    _base_without_config,
    _base_config_not_json,
    _base_config_not_object,
    _adapter_missing,
    _alpha_nan,
    _config_nested,
    _base_config_implausible,
]


@pytest.mark.parametrize("broken", BROKEN, ids=[c.__name__.strip("_") for c in BROKEN])
def test_cli_broken_input_is_one_sentence_exit_2_nothing_written(
    broken, tiny_llama, adapter, tmp_path, workspace
):
    base = copy_model(tiny_llama, tmp_path / "base")
    base_arg, adapter_arg, phrases = broken(adapter, base)
    out = workspace / "exports" / "broken"
    r = merge_main("--base", str(base_arg), "--adapter", str(adapter_arg), "--out", str(out))
    assert_refused(r, out, *phrases)


def test_page_listing_survives_a_corrupt_adapter_config(tiny_llama, workspace):
    """The page lists runs by reading adapter_config.json: a broken one must not crash the listing."""
    run = workspace / "runs" / "broken"
    make_adapter(tiny_llama, run / "adapter")
    (run / "adapter" / "adapter_config.json").write_text("[]")
    assert [c.run for c in merge.list_adapters(workspace)] == ["broken"]
    with pytest.raises(merge.MergeError, match="JSON object"):
        merge.preflight(tiny_llama, run / "adapter", "exports/b", workspace=workspace)


# ---- a killed merge's temp folder ---------------------------------------------------------------------------


@pytest.mark.slow
def test_temp_of_a_killed_merge_is_cleaned_by_the_next_merge_into_the_same_folder(tmp_path, workspace):
    base = build_tiny_model(tmp_path / "base", "llama", hidden_size=128)
    adapter = make_adapter(base, tmp_path / "adapter", target_modules="all-linear")
    exports = workspace / "exports"
    first = [
        *("--base", str(base), "--adapter", str(adapter), "--out", str(exports / "first")),
        *("--shard-size", "100KB"),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), **{merge.PAUSE_ENV: "120"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.merge", *first],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not list(exports.glob(".first.merging-*/.paused")) and time.time() < deadline:
            assert proc.poll() is None, "the merge ended before pausing"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    (killed,) = exports.glob(".first.merging-*")
    # Not ours to delete: a folder without our marker, and the temp of a merge that is still running.
    (exports / ".mine.merging-1").mkdir()
    live = exports / f".busy.merging-{os.getpid()}"
    live.mkdir()
    (live / merge.TEMP_MARKER).write_text(json.dumps({"pid": os.getpid(), "started": time.time()}))

    r = run_cli("--base", str(base), "--adapter", str(adapter), "--out", str(exports / "second"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not killed.exists()
    assert (exports / ".mine.merging-1").is_dir() and live.is_dir()
    assert (exports / "second" / "config.json").is_file() and not (exports / "first").exists()


def test_temp_whose_pid_was_reused_by_another_process_is_stale(tmp_path):
    # After a reboot or in a fresh container the dead merge's pid can belong to an unrelated, newer process.
    stale = tmp_path / ".old.merging-1"
    stale.mkdir()
    (stale / merge.TEMP_MARKER).write_text(json.dumps({"pid": os.getppid(), "started": 0.0}))
    assert (
        tempdirs.clean_stale_temps(tmp_path, merge.TEMP_GLOB, merge.TEMP_MARKER) == [stale]
        and not stale.exists()
    )


# ---- CLI path rules -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_relative_paths_start_from_the_current_folder(tiny_llama, adapter, tmp_path, workspace):
    cwd = tmp_path / "here"
    cwd.mkdir()
    base_rel = os.path.relpath(tiny_llama, cwd)
    adapter_rel = os.path.relpath(adapter, cwd)
    r = run_cli("--base", base_rel, "--adapter", adapter_rel, "--out", "exports/rel", cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (cwd / "exports" / "rel" / "config.json").is_file()
    assert not (workspace / "exports" / "rel").exists()


@pytest.mark.slow
def test_cli_writes_anywhere_writable_and_refuses_unwritable(tiny_llama, adapter, tmp_path, workspace):
    out = tmp_path / "elsewhere" / "model"  # outside the workspace: the user owns the shell
    r = run_cli("--base", str(tiny_llama), "--adapter", str(adapter), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "config.json").is_file()

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "model"
    r = run_cli("--base", str(tiny_llama), "--adapter", str(adapter), "--out", str(bad))
    assert_refused(r, bad, str(blocker), "not a folder", "--out")


def test_page_functions_still_write_only_inside_the_workspace(tiny_llama, adapter, tmp_path, workspace):
    for call in (merge.preflight, merge.merge):
        with pytest.raises(merge.MergeError, match="outside the workspace"):
            call(tiny_llama, adapter, tmp_path / "elsewhere", workspace=workspace)
        with pytest.raises(merge.MergeError, match="outside the workspace"):
            call(tiny_llama, adapter, "../escape", workspace=workspace)
    assert not (tmp_path / "elsewhere").exists()
