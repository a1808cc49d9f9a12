"""One mapping from a run config to the planner's plan (issue #10): the Train page's estimate, the launcher's
plan.json, `core.train --dry-run` and a terminal-started run's plan.json all come from plan_for_config."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from core.estimate.bill import estimate
from core.estimate.from_config import estimate_for_config, plan_for_config, plan_json
from core.train.config import dump_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "lora": {},
    "qlora-checkpointing": {
        "quantization": {"load_in_4bit": True},
        "training": {"gradient_checkpointing": True, "optim": "paged_adamw_8bit"},
    },
    "full-bf16": {"lora": {"enabled": False}, "model": {"dtype": "bfloat16"}},
    "lora-targets-fp16": {
        "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
        "training": {"bf16": False, "fp16": True, "max_length": 48},
    },
}


def _config(tiny_llama, dataset, extra):
    raw = {"model": {"path": str(tiny_llama)}, "data": {"path": str(dataset)}, "training": {"max_length": 64}}
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return validate_config(raw)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from core.demo.toy import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("model")
    build_tiny_model(out)
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"instruction": f"Say {i}", "output": f"{i}"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_path_yields_the_same_plan(tiny_llama, dataset, variant):
    cfg = _config(tiny_llama, dataset, VARIANTS[variant])
    plan = plan_for_config(cfg, 24.0, "cuda")
    assert asdict(plan) == estimate_for_config(cfg, 24.0, "cuda").plan  # the Train page and the launcher
    assert plan_json(cfg, 24.0, "cuda")["plan"] == asdict(plan)  # --dry-run and a CLI run's plan.json
    assert estimate(plan).tensor_peak_bytes == plan_json(cfg, 24.0, "cuda")["tensor_peak_bytes"]
    assert not plan.dpo and plan.fused_lm_head and not plan.prepare_kbit  # what SFTTrainer does


def test_dry_run_prints_the_plan_json_object(tiny_llama, dataset, tmp_path):
    cfg = _config(tiny_llama, dataset, VARIANTS["lora"])
    cfg["training"].update(dataloader_num_workers=0, train_sampling_strategy="group_by_length", seed=7)
    path = dump_config(cfg, tmp_path / "run.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(path), "--dry-run", "--gpu-gb", "24"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    device = printed["plan"]["device"]  # this machine's: cpu in CI
    assert printed == json.loads(json.dumps(plan_json(cfg, 24.0, device), default=str))


def test_dry_run_bad_key_is_one_line_and_exit_2(tiny_llama, dataset, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {{path: {tiny_llama}}}\ndata: {{path: {dataset}}}\ntraining: {{learning_rat: 1.0e-4}}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(path), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: training.learning_rat: unknown key. Did you mean training.learning_rate?"]
    assert "Traceback" not in out.stderr


def test_gpt2_conv1d_folder_plans_lora(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=128).save_pretrained(tmp_path)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from core.estimate.bill import Plan

    est = estimate(Plan(model=str(tmp_path), method="lora", lora_r=4, seq_len=64, device="cpu"))
    model = get_peft_model(
        AutoModelForCausalLM.from_config(GPT2Config.from_pretrained(tmp_path)),
        LoraConfig(r=4, target_modules="all-linear"),
    )
    assert est.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_tracker_measures_the_plan_of_the_one_mapping(tiny_llama, dataset, variant):
    from core.measure.step import plan_from, planner_plan

    cfg = _config(tiny_llama, dataset, VARIANTS[variant])
    for device in ("cpu", "cuda"):
        mapped = plan_for_config(cfg, device=device)
        measured = planner_plan(
            cfg["model"]["path"], plan_from(cfg) if device == "cpu" else _cuda(cfg), device
        )
        card = ("gpu_gb", "expandable_segments", "eval_kv_tokens", "dpo_reference")
        assert {k: v for k, v in asdict(measured).items() if k not in card} == {
            k: v for k, v in asdict(mapped).items() if k not in card
        }


def _cuda(cfg):
    from core.measure.step import _plan_from_run_config

    return _plan_from_run_config(cfg, device="cuda")


@pytest.mark.parametrize("variant", VARIANTS)
def test_plan_to_config_is_the_inverse_of_the_mapping(tiny_llama, dataset, variant):
    from core.train.config import plan_to_config

    cfg = _config(tiny_llama, dataset, VARIANTS[variant])
    plan = plan_for_config(cfg, device="cuda")
    assert plan_for_config(plan_to_config(asdict(plan), cfg), device="cuda") == plan
