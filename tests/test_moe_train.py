"""A tiny mixture-of-experts model trained, merged and evaluated on the CPU as a user does it (issue #36): the engine
(`python -m core.train`) with LoRA on the attention and on the experts (lora.target_parameters), the router's
load-balancing loss on the Monitor, the merge folding the expert adapters into the checkpoint's per-expert tensors,
`python -m core.eval` on the held-out rows; and the smoke test's measured peak within 5% of the plan. One trained
run is shared by the module."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import REPO, train

slow = pytest.mark.slow
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TOLERANCE = 0.05


def _rows(n: int, start: int = 0) -> str:
    return "".join(
        json.dumps({"instruction": f"Add one to {i}", "output": f"{i + 1}"}) + "\n"
        for i in range(start, start + n)
    )


def _config(model: Path, data: Path, **training) -> dict:
    from core.recipe.config import validate_config

    return validate_config(
        {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "lora": {
                "r": 8,
                "lora_alpha": 16,
                "lora_dropout": 0.0,  # peft's ParamWrapper (LoRA on the experts) takes none
                "target_modules": ATTENTION,
                "target_parameters": EXPERTS,
            },
            "data": {"path": str(data), "max_length": 64},
            "training": {"per_device_train_batch_size": 2, "learning_rate": 1e-3, **training},
        }
    )


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """(base folder, data folder, a finished 4-step run of a tiny Qwen3-MoE with LoRA on attention + experts)."""
    from core.demo.toy import build_tiny_model

    root = tmp_path_factory.mktemp("moe_train")
    base = build_tiny_model(root / "base", "qwen3_moe")
    (root / "train.jsonl").write_text(_rows(32))
    (root / "heldout.jsonl").write_text(_rows(6, start=100))
    run_dir = root / "runs" / "moe"
    done = train(_config(base, root / "train.jsonl", max_steps=4, logging_steps=1), run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return base, root, run_dir


@slow
def test_the_engine_trains_lora_on_the_experts_and_the_monitor_charts_the_router_loss(moe_run):
    from core.monitor.watch import RunWatcher

    _, _, run_dir = moe_run
    adapter = run_dir / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == sorted(EXPERTS)
    keys = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(
        "mlp.experts" in k and "lora_A" in k for k in keys
    )  # the experts' pairs were trained and saved
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    aux = [m["aux_loss"] for m in logged if "aux_loss" in m]
    assert len(aux) == 4 and all(a > 0 for a in aux)  # SFTTrainer's load-balancing loss, one per logged step
    chart = RunWatcher(str(run_dir)).refresh().charts["sft_aux_loss"]
    assert not chart.empty and set(chart["series"]) >= {"train"}


@slow
def test_the_merge_folds_the_expert_adapters_into_the_per_expert_tensors(moe_run, tmp_path):
    from core import merge

    base, _, run_dir = moe_run
    out = tmp_path / "merged"
    result = merge.merge_at(str(base), str(run_dir / "adapter"), str(out), dtype="fp32")
    assert result.verification.passed, result.verification.lines()  # logits equal peft's base + adapter
    before, after = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after)  # the checkpoint's own layout: one tensor per expert and projection
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert not torch.equal(before[name].float(), after[name])


@slow
def test_the_tuned_moe_is_evaluated_against_its_base(moe_run):
    _, root, run_dir = moe_run
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "core.eval",
            "--run",
            str(run_dir),
            "--data",
            str(root / "heldout.jsonl"),
            "--max-new-tokens",
            "4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval: exact match" in out.stdout and "eval: answer loss" in out.stdout


@slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_smoke_peak_is_within_five_percent_of_the_plan(tmp_path, workspace, arch):
    """The Train page's smoke test (one real step, the tracker's steady peak) against the plan the trainer wrote,
    on a model sized so that the expert terms (merged copies, their gradients, the routed tokens) make most of the
    step beyond the weights (benchmarks/moe_accuracy.py runs all three families, checkpointing on and off)."""
    from core.demo.toy import build_tiny_model
    from core.runs.admin import start_smoke_test
    from core.runs.launcher import wait_for_smoke

    widths = {
        "qwen3_moe": dict(moe_intermediate_size=512, num_experts=8),
        "gpt_oss": dict(intermediate_size=512, num_local_experts=8),
    }
    model = build_tiny_model(
        tmp_path / arch,
        arch,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        **widths[arch],
    )
    (tmp_path / "train.jsonl").write_text(_rows(20))
    run_dir = start_smoke_test(
        workspace, f"moe-{arch}", _config(model, tmp_path / "train.jsonl", max_steps=5)
    )
    result = wait_for_smoke(run_dir, timeout=600)
    assert result is not None and result["state"] == "finished", result
    peak, est = result["peak_bytes"], result["estimate_bytes"]
    assert result["measured_by"] == "tracker" and est > 0
    assert abs(peak / est - 1) <= TOLERANCE, f"measured {peak} vs planned {est}: {peak / est - 1:+.1%}"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (
        plan["moe"]["lora_on"] == ["down_proj", "gate_up_proj"]
        and plan["moe"]["merged_expert_copy_bytes"] > 0
    )
