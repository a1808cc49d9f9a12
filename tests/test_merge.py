"""The streaming merge against peft on tiny real models.

Oracle: peft's *unmerged* PeftModel forward (max |logits Δ| <= 1e-4), and peft's own merged weights (atol 1e-5)
wherever peft merges correctly (not for tied embeddings, where peft writes the delta into the shared tensor).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from core import merge
from core.demo.toy import build_tiny_model
from core.merge import delta

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [torch.tensor([[1, 10, 20, 30, 40, 50, 60, 70]]), torch.tensor([[5, 99, 3, 42, 7]])]


def make_adapter(base: Path, out: Path, seed: int = 0, noise: float = 0.05, **lora_kwargs) -> Path:
    """A real peft adapter whose every trainable tensor is perturbed, so it changes the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for _, p in peft_model.named_parameters():
            if p.requires_grad and noise:
                p.add_(noise * torch.randn_like(p))
    peft_model.save_pretrained(str(out))
    return out


@torch.no_grad()
def logits_of(model) -> list[torch.Tensor]:
    return [model(input_ids=p).logits.float() for p in PROMPTS]


def peft_oracle(base: Path, adapter: Path):
    """(unmerged base+adapter logits, base logits, peft merged state dict)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    pm = PeftModel.from_pretrained(model, str(adapter)).eval()
    ref = logits_of(pm)
    with pm.disable_adapter():
        base_logits = logits_of(pm)
    merged_sd = {k: v.clone() for k, v in pm.merge_and_unload().state_dict().items()}
    return ref, base_logits, merged_sd


def load_export(out: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    return model, tok


def export_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


CASES = {
    # name: (base fixture, lora kwargs, compare with peft's merged weights)
    "llama_all_linear": ("tiny_llama", dict(r=4, lora_alpha=8, target_modules="all-linear"), True),
    "llama_lm_head_embed": (
        "tiny_llama",
        dict(r=4, target_modules=["q_proj", "lm_head", "embed_tokens"]),
        True,
    ),
    "llama_tied_lm_head_embed": (
        "tiny_llama_tied",
        dict(r=4, target_modules=["q_proj", "v_proj", "lm_head", "embed_tokens"]),
        False,
    ),
    "llama_tied_modules_to_save": (
        "tiny_llama_tied",
        dict(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]),
        False,
    ),
    "llama_modules_to_save_lm_head": (
        "tiny_llama",
        dict(r=4, target_modules=["q_proj", "down_proj"], modules_to_save=["lm_head"]),
        True,
    ),
    "llama_rslora": (
        "tiny_llama",
        dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "o_proj"]),
        True,
    ),
    "llama_rank_alpha_pattern": (
        "tiny_llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "up_proj"],
            rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 8},
            alpha_pattern={"up_proj": 32},
        ),
        True,
    ),
    "llama_dora": ("tiny_llama", dict(r=4, use_dora=True, target_modules=["q_proj", "gate_proj"]), True),
    "gpt2_conv1d": (
        "tiny_gpt2",
        dict(r=4, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),
        True,
    ),
    "gpt2_conv1d_dora": (
        "tiny_gpt2",
        dict(r=4, use_dora=True, target_modules=["c_attn"], fan_in_fan_out=True),
        True,
    ),
    "gpt2_lora_bias": (
        "tiny_gpt2",
        dict(r=4, lora_bias=True, target_modules=["c_fc"], fan_in_fan_out=True),
        True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_matches_peft_unmerged_forward(case, request, tmp_path, workspace):
    fixture, lora_kwargs, compare_weights = CASES[case]
    base = request.getfixturevalue(fixture)
    adapter = make_adapter(base, tmp_path / "adapter", **lora_kwargs)
    ref, base_logits, peft_sd = peft_oracle(base, adapter)

    result = merge.merge(base, adapter, "exports/" + case, workspace=workspace)
    out = Path(result.out_dir)
    assert out == workspace / "exports" / case
    assert result.verification.passed and result.verification.mode == "full"

    merged, tok = load_export(out)
    got = logits_of(merged)
    assert max_diff(got, ref) <= 1e-4
    assert max_diff(got, base_logits) > 1e-2  # the adapter did something and it is in the export
    assert tok("hi")["input_ids"]  # tokenizer copied and loads

    tensors = export_tensors(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    if compare_weights:
        for key, value in tensors.items():
            assert torch.allclose(value, peft_sd[key], atol=1e-5), key
    if fixture == "tiny_llama_tied":
        # lm_head written on its own, untied: peft's merge writes into the shared tensor and is wrong here.
        assert "lm_head.weight" in tensors and config["tie_word_embeddings"] is False
        assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("case", ["llama_lm_head_embed", "gpt2_conv1d", "llama_dora"])
def test_row_chunked_merge_matches(case, request, tmp_path, workspace, monkeypatch):
    """Very large tensors are merged in row blocks; force tiny blocks so every kind of layer is split."""
    fixture, lora_kwargs, _ = CASES[case]
    base = request.getfixturevalue(fixture)
    adapter = make_adapter(base, tmp_path / "adapter", **lora_kwargs)
    ref, _, _ = peft_oracle(base, adapter)
    monkeypatch.setattr(delta, "CHUNK_BYTES", 3 * 64 * 4 + 4)  # 3 rows of a 64-wide fp32 tensor
    out = Path(merge.merge(base, adapter, "exports/chunked", workspace=workspace).out_dir)
    assert max_diff(logits_of(load_export(out)[0]), ref) <= 1e-4


def test_peft_merge_is_wrong_on_tied_embeddings_and_ours_is_not(tiny_llama_tied, tmp_path, workspace):
    """Why the tied case needs care: peft's merged model deviates from its own unmerged forward."""
    from transformers import AutoModelForCausalLM

    adapter = make_adapter(tiny_llama_tied, tmp_path / "a", target_modules=["lm_head", "embed_tokens"], r=4)
    ref, _, peft_sd = peft_oracle(tiny_llama_tied, adapter)
    peft_model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied), dtype=torch.float32)
    peft_model.load_state_dict(peft_sd, strict=False)
    assert max_diff(logits_of(peft_model.eval()), ref) > 1e-2
    out = Path(merge.merge(tiny_llama_tied, adapter, "exports/tied", workspace=workspace).out_dir)
    assert max_diff(logits_of(load_export(out)[0]), ref) <= 1e-4


def test_resized_vocabulary_via_modules_to_save(tiny_llama, tmp_path, workspace):
    """Added tokens: the adapter carries full, resized embedding and head copies; vocab_size follows."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def resized():
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        torch.manual_seed(3)
        model.resize_token_embeddings(110)
        return model

    pm = get_peft_model(
        resized(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    )
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    pm.save_pretrained(str(tmp_path / "adapter"))
    ref = logits_of(PeftModel.from_pretrained(resized(), str(tmp_path / "adapter")).eval())

    result = merge.merge(tiny_llama, tmp_path / "adapter", "exports/resized", workspace=workspace)
    out = Path(result.out_dir)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 110
    assert any("vocabulary" in n for n in result.preflight.notes)
    assert max_diff(logits_of(load_export(out)[0]), ref) <= 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_device_without_gpu_is_a_clear_error(tiny_llama, tmp_path, workspace):
    adapter = make_adapter(tiny_llama, tmp_path / "a", r=4, target_modules=["q_proj"])
    with pytest.raises(merge.MergeError, match="sees no CUDA GPU"):
        merge.merge(tiny_llama, adapter, "exports/gpu", device="cuda", workspace=workspace)


@pytest.mark.slow
def test_sharded_base_and_sharded_bf16_output(tmp_path, workspace):
    base = build_tiny_model(tmp_path / "base", "llama", max_shard_size="100KB", hidden_size=128)
    assert len(list(base.glob("model-*.safetensors"))) >= 3
    adapter = make_adapter(base, tmp_path / "adapter", r=4, target_modules="all-linear")
    ref, _, _ = peft_oracle(base, adapter)
    seen = []
    result = merge.merge(
        base,
        adapter,
        "exports/sharded",
        dtype="fp32",
        shard_size="200KB",
        workspace=workspace,
        progress=seen.append,
    )
    out = Path(result.out_dir)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = export_tensors(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert max_diff(logits_of(load_export(out)[0]), ref) <= 1e-4
    last = seen[-1]
    assert last.phase == "done" and last.tensors_done == last.tensors_total == len(tensors)
    assert last.bytes_written == index["metadata"]["total_size"]

    # bf16 export: rounded once, checked with bf16 tolerances, loads with the bf16 dtype recorded.
    result = merge.merge(
        base, adapter, "exports/sharded-bf16", dtype="bf16", shard_size="200KB", workspace=workspace
    )
    v = result.verification
    assert v.passed and v.dtype == "bfloat16" and 1e-4 < v.max_abs_diff <= v.tolerance
    out = Path(result.out_dir)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in export_tensors(out).values())


def test_bin_base_is_read_whole_with_a_warning(tmp_path, workspace):
    from transformers import AutoModelForCausalLM

    st_base = build_tiny_model(tmp_path / "st", "llama")
    bin_base = tmp_path / "bin"
    bin_base.mkdir()
    # A classic PyTorch checkpoint, as older hub models ship them (transformers 5 no longer writes .bin).
    model = AutoModelForCausalLM.from_pretrained(str(st_base))
    torch.save(model.state_dict(), bin_base / "pytorch_model.bin")
    (bin_base / "config.json").write_text((st_base / "config.json").read_text())
    for f in st_base.glob("tokenizer*"):
        (bin_base / f.name).write_bytes(f.read_bytes())
    adapter = make_adapter(st_base, tmp_path / "adapter", r=4, target_modules=["q_proj", "v_proj"])
    ref, _, _ = peft_oracle(st_base, adapter)
    result = merge.merge(bin_base, adapter, "exports/from-bin", workspace=workspace)
    assert any(".bin" in n and "whole" in n for n in result.preflight.notes)
    assert max_diff(logits_of(load_export(Path(result.out_dir))[0]), ref) <= 1e-4


def test_qlora_adapter_gets_the_deviation_note(tiny_llama, tmp_path, workspace):
    run = workspace / "runs" / "q1"
    adapter = make_adapter(tiny_llama, run / "adapter", r=4, target_modules=["q_proj"])
    (run / "config.yaml").write_text(f"model:\n  path: {tiny_llama}\nquantization:\n  load_in_4bit: true\n")
    pf, _ = merge.preflight(tiny_llama, adapter, "exports/q1", workspace=workspace)
    assert pf.qlora and any("4-bit" in n and "deviation" in n for n in pf.notes)
    assert any(f"output in {pf.out_dtype}" in n for n in pf.notes)  # not "bf16/fp16" for a float32 export
    assert pf.ok and pf.ram_available > 0 and pf.disk_free > 0 and pf.disk_needed >= pf.out_bytes
    assert merge.guess_base(adapter) == (str(tiny_llama), "run config.yaml model.path")
    assert [c.run for c in merge.list_adapters(workspace)] == ["q1"]
    result = merge.merge(tiny_llama, adapter, "exports/q1", workspace=workspace)
    v = result.verification
    # the bf16/fp32 merge is exact against base+adapter; against the NF4 base it deviates, and that is reported
    assert v.passed and v.max_abs_diff <= 1e-4
    assert v.qlora_deviation is not None and v.qlora_deviation > v.max_abs_diff
    assert any("QLoRA" in line for line in v.lines())


def test_qlora_is_told_from_the_run_configs_real_keys(tiny_llama, tmp_path, workspace):
    """Issue 20: QLoRA is quantization.load_in_4bit of the config.yaml that core.train/launcher write (the
    validated config, every section filled in), not keys the config never has (bits, mode, kind)."""
    from core.merge.discover import is_qlora
    from core.runs.launcher import create_run

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    for name, quant in (("q", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}), ("l", {})):
        cfg = {"model": {"path": str(tiny_llama)}, "data": {"path": str(data)}, "quantization": quant}
        run = create_run(workspace, name, cfg)
        adapter = make_adapter(tiny_llama, run / "adapter", r=4, target_modules=["q_proj"])
        written = (run / "config.yaml").read_text()
        assert "load_in_4bit: " + ("true" if quant else "false") in written and "bits" not in written
        assert is_qlora(adapter) is bool(quant) and is_qlora(run) is bool(quant)
    assert is_qlora(make_adapter(tiny_llama, tmp_path / "loose", r=4, target_modules=["q_proj"])) is False


# ---- refusals: clear messages, nothing written --------------------------------------------------------------


def test_refusals_have_clear_messages(tiny_llama, tiny_gpt2, tmp_path, workspace):
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = make_adapter(tiny_llama, tmp_path / "ok", r=4, target_modules=["q_proj"])
    cases = []

    ia3 = tmp_path / "ia3"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_llama)),
        IA3Config(target_modules=["k_proj"], feedforward_modules=[]),
    ).save_pretrained(str(ia3))
    cases.append((tiny_llama, ia3, "only LoRA"))
    cases.append((tiny_gpt2, adapter, "trained on a LlamaForCausalLM"))
    wide = build_tiny_model(tmp_path / "wide", "llama", hidden_size=32, intermediate_size=64, tokenizer=False)
    cases.append((wide, adapter, "does not fit the base"))
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    sd["base_model.model.model.layers.0.self_attn.nonexistent.lora_A.weight"] = torch.zeros(4, 64)
    sd["base_model.model.model.layers.0.self_attn.nonexistent.lora_B.weight"] = torch.zeros(64, 4)
    save_file(sd, str(stray / "adapter_model.safetensors"))
    cases.append((tiny_llama, stray, "does not exist in the base architecture"))
    quant = tmp_path / "quant"
    quant.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quant / "config.json").write_text(json.dumps(cfg))
    (quant / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes())
    cases.append((quant, adapter, "stored quantized"))

    for base, ad, message in cases:
        with pytest.raises(merge.MergeError, match=message):
            merge.merge(base, ad, "exports/x", workspace=workspace)
    assert not (workspace / "exports" / "x").exists()

    with pytest.raises(merge.MergeError, match="outside the workspace"):
        merge.merge(tiny_llama, adapter, tmp_path / "elsewhere", workspace=workspace)
    (workspace / "exports" / "mine").mkdir(parents=True)
    (workspace / "exports" / "mine" / "keep.txt").write_text("user data")
    with pytest.raises(merge.MergeError, match="already exists"):
        merge.merge(tiny_llama, adapter, "exports/mine", workspace=workspace)
    assert (workspace / "exports" / "mine" / "keep.txt").read_text() == "user data"


def test_untrained_adapter_is_refused_by_verification(tiny_llama, tmp_path, workspace):
    adapter = make_adapter(tiny_llama, tmp_path / "zero", noise=0.0, r=4, target_modules=["q_proj"])  # B = 0
    with pytest.raises(merge.MergeError, match="indistinguishable from the base"):
        merge.merge(tiny_llama, adapter, "exports/zero", workspace=workspace)
    assert list((workspace / "exports").iterdir()) == []  # temp folder removed too


def test_verification_catches_a_corrupt_export(tiny_llama, tmp_path, workspace):
    adapter = make_adapter(tiny_llama, tmp_path / "a", r=4, target_modules=["q_proj"])
    out = Path(merge.merge(tiny_llama, adapter, "exports/good", workspace=workspace).out_dir)
    _, plan = merge.preflight(tiny_llama, adapter, "exports/other", workspace=workspace)
    assert merge.verify_export(plan, out, "quick").passed
    sd = load_file(str(out / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"].flip(0)
    os.chmod(out / "model.safetensors", 0o644)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    v = merge.verify_export(plan, out, "full")
    assert not v.passed and "corrupt" in " ".join(v.messages)


def test_try_adapter_side_by_side(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = make_adapter(tiny_llama, tmp_path / "a", noise=0.5, r=8, target_modules="all-linear")
    res = merge.try_adapter(tiny_llama, adapter, "Hello", max_new_tokens=8, chat=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    ids = tok("Hello", return_tensors="pt")
    plain = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert res.base_text == tok.decode(plain[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert res.adapter_text != res.base_text
    with pytest.raises(merge.MergeError, match="prompt is empty"):
        merge.try_adapter(tiny_llama, adapter, "  ")


# ---- CLI and a merge killed midway -------------------------------------------------------------------------


def run_cli(*args, env_extra=None, **kw):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "core.merge", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        **kw,
    )


@pytest.mark.slow
def test_killed_merge_leaves_no_target_and_rerun_succeeds(tmp_path, workspace):
    base = build_tiny_model(tmp_path / "base", "llama", hidden_size=128)
    adapter = make_adapter(base, tmp_path / "adapter", r=4, target_modules="all-linear")
    args = [
        "--base",
        str(base),
        "--adapter",
        str(adapter),
        "--out",
        str(workspace / "exports" / "killed"),  # the CLI resolves relative paths from its current folder
        "--shard-size",
        "100KB",
    ]
    env = dict(os.environ, **{merge.PAUSE_ENV: "120"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.merge", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not list((workspace / "exports").glob(".killed.merging-*/.paused")) and time.time() < deadline:
        assert proc.poll() is None, "the merge ended before pausing"
        time.sleep(0.2)
    temps = list((workspace / "exports").glob(".killed.merging-*"))
    assert len(temps) == 1 and list(
        temps[0].glob("model-00001-of-*.safetensors")
    )  # midway: one shard written
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (workspace / "exports" / "killed").exists()

    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert (workspace / "exports" / "killed" / "config.json").is_file()
    assert not temps[0].exists()  # stale temp of the killed merge cleaned up
    assert "PASSED" in done.stdout and "preflight" in done.stdout


@pytest.mark.slow
def test_cli_bad_inputs_exit_nonzero_without_traceback(tiny_llama, tmp_path, workspace):
    adapter = make_adapter(tiny_llama, tmp_path / "a", r=4, target_modules=["q_proj"])
    out = str(workspace / "exports" / "a")  # the CLI resolves relative paths from its current folder
    (tmp_path / "a-file").write_text("not a folder")
    bad = [
        (
            ["--base", str(tmp_path / "nope"), "--adapter", str(adapter), "--out", out],
            "does not exist",
        ),
        (
            ["--base", str(tiny_llama), "--adapter", str(tiny_llama), "--out", out],
            "adapter_config.json",
        ),
        (
            [
                "--base",
                str(tiny_llama),
                "--adapter",
                str(adapter),
                "--out",
                out,
                "--shard-size",
                "big",
            ],
            "not a size",
        ),
        (
            ["--base", str(tiny_llama), "--adapter", str(adapter), "--out", str(tmp_path / "a-file" / "x")],
            "not a folder",
        ),
    ]
    from core.merge.__main__ import main
    from tests.cli import in_process  # main(argv) here: an exception (a traceback) fails the test

    for args, message in bad:
        r = in_process(main, *args)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = in_process(
        main, "--base", str(tiny_llama), "--adapter", str(adapter), "--out", out, "--dtype", "int3"
    )
    assert r.returncode != 0 and "invalid choice" in r.stderr
