"""The models of 2026 trained, merged and evaluated as a user does it (#46 item 6): a tiny twin of Qwen3.5 (Gated
DeltaNet), Granite 4.0-H (Mamba-2 + MoE: TRL's fused head needed the engine's expert-count name), Nemotron-H
(Mamba-2 blocks, whose out_proj all-linear leaves out), Gemma 4's MoE (all-linear includes its router.proj, and LoRA
on the experts through target_parameters) and Gemma 3n through `python -m core.train` with LoRA on all-linear, the
verified merge, and `python -m core.eval` on held-out rows."""

import json
import subprocess
import sys

import pytest

from tests.cli import REPO, in_process, train

sys.path.insert(0, str(REPO / "benchmarks"))
from families_accuracy import FAMILIES, MODEL_TYPES  # noqa: E402  (the benchmark's own twins)


def _rows(n: int, start: int = 0) -> str:
    return "".join(
        json.dumps({"instruction": f"Add one to {i}", "output": f"{i + 1}"}) + "\n"
        for i in range(start, start + n)
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["qwen3_5_text", "granitemoehybrid", "nemotron_h", "gemma4_text_moe", "gemma3n_text"]
)
def test_a_hybrid_twin_trains_merges_and_evaluates(tmp_path, arch):
    from core import merge
    from core.demo.toy import build_tiny_model
    from core.eval.cli import main as eval_main
    from core.recipe.config import validate_config

    base = build_tiny_model(tmp_path / "base", MODEL_TYPES.get(arch, arch), **FAMILIES[arch][0])
    (tmp_path / "train.jsonl").write_text(_rows(16))
    (tmp_path / "heldout.jsonl").write_text(_rows(4, start=100))
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
    if arch == "gemma4_text_moe":
        lora["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
    run_dir = tmp_path / "run"
    cfg = validate_config(
        {
            "model": {"path": str(base), "dtype": "bfloat16"},
            "lora": lora,
            "data": {"path": str(tmp_path / "train.jsonl"), "max_length": 64},
            "training": {"per_device_train_batch_size": 2, "max_steps": 2, "logging_steps": 1},
        }
    )
    done = train(cfg, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    targets = adapter["target_modules"]
    if arch == "nemotron_h":  # peft refuses LoRA on the Mamba mixer's out_proj: all-linear left it out
        assert not any(t.endswith("mixer.out_proj") for t in targets) and any("in_proj" in t for t in targets)
    if arch == "gemma4_text_moe":
        assert any(t.endswith("router.proj") or t == "proj" for t in targets), targets
    result = merge.merge_at(str(base), str(run_dir / "adapter"), str(tmp_path / "merged"), dtype="fp32")
    assert result.verification.passed, result.verification.lines()  # the merged logits equal base + adapter
    # in this process (core.eval's own subprocess tests cover its interpreter): ~9 s of imports saved per family
    out = in_process(
        eval_main, "--run", run_dir, "--data", tmp_path / "heldout.jsonl", "--max-new-tokens", "4"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval: exact match" in out.stdout


@pytest.mark.parametrize("arch", ["qwen3_5_text", "gemma4_text"])
def test_gguf_export_of_a_2026_family_says_in_one_sentence_where_to_convert_it(tmp_path, arch):
    """The exporter writes dense Llama / Mistral / Qwen2; for the rest it names llama.cpp's converter, which knows
    these families (gguf-py has their architectures), rather than leaving the user at 'not supported'."""
    from core.demo.toy import build_tiny_model

    base = build_tiny_model(tmp_path / arch, arch, **FAMILIES[arch][0])
    out = subprocess.run(
        [sys.executable, "-m", "core.gguf", "--model", str(base), "--out", str(tmp_path / "x.gguf")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert (
        "convert_hf_to_gguf.py converts the merged folder" in out.stderr
        and not (tmp_path / "x.gguf").exists()
    )
