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
from core.recipe.config import dump_config, validate_config

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
    assert plan.to_dict() == estimate_for_config(cfg, 24.0, "cuda").plan  # the Train page and the launcher
    assert plan_json(cfg, 24.0, "cuda")["plan"] == plan.to_dict()  # --dry-run and a CLI run's plan.json
    assert estimate(plan).tensor_peak_bytes == plan_json(cfg, 24.0, "cuda")["tensor_peak_bytes"]
    assert plan.method == "sft" and plan.fused_lm_head and not plan.prepare_kbit  # what SFTTrainer does


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

    from core.estimate.plan import Plan

    est = estimate(Plan(model=str(tmp_path), tuning="lora", lora_r=4, seq_len=64, device="cpu"))
    model = get_peft_model(
        AutoModelForCausalLM.from_config(GPT2Config.from_pretrained(tmp_path)),
        LoraConfig(r=4, target_modules="all-linear"),
    )
    assert est.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_tracker_measures_the_plan_of_the_one_mapping(tiny_llama, dataset, variant):
    """A measured step of a run config runs the very Plan the planner estimates (no measurement vocabulary)."""
    from core.measure.step_plan import plan_of_config

    cfg = _config(tiny_llama, dataset, VARIANTS[variant])
    for device in ("cpu", "cuda"):
        assert plan_of_config(cfg, device) == plan_for_config(cfg, device=device)


@pytest.mark.parametrize("variant", VARIANTS)
def test_plan_to_config_is_the_inverse_of_the_mapping(tiny_llama, dataset, variant):
    from core.estimate.from_config import plan_to_config

    cfg = _config(tiny_llama, dataset, VARIANTS[variant])
    plan = plan_for_config(cfg, device="cuda")
    assert plan_for_config(plan_to_config(asdict(plan), cfg), device="cuda") == plan


# ---- one plan per run, wherever it is asked (issue #20 item 2) --------------------------------------------------

TOTALS = ("tensor_peak_bytes", "reserved_peak_bytes", "device_total_bytes")
RUN_VARIANTS = {
    "sft-demo-shape": {"training": {"max_steps": 1, "per_device_train_batch_size": 2}},
    "qlora": {
        "quantization": {"load_in_4bit": True},
        "training": {"max_steps": 1, "optim": "paged_adamw_8bit", "per_device_train_batch_size": 2},
    },
    "dpo": {"method": "dpo", "training": {"max_steps": 1, "per_device_train_batch_size": 2}},
    "kto": {"method": "kto", "training": {"max_steps": 1, "per_device_train_batch_size": 2}},
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = [{"prompt": f"Say {i}", "chosen": f" {i}!", "rejected": f" {i + 1}"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def feedback(tmp_path_factory):
    """KTO's unpaired rows: an answer each, rated good (true) or bad (false)."""
    path = tmp_path_factory.mktemp("feedback") / "feedback.jsonl"
    rows = [{"prompt": f"Say {i}", "completion": f" {i}!", "label": i % 2 == 0} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _run_config(tiny_llama, dataset, pairs, feedback, variant):
    extra = dict(RUN_VARIANTS[variant])
    data = {"dpo": pairs, "kto": feedback}.get(variant, dataset)
    raw = {"model": {"path": str(tiny_llama)}, "data": {"path": str(data)}, "training": {"max_length": 64}}
    for section, values in extra.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return validate_config(raw)


@pytest.mark.slow
@pytest.mark.parametrize("variant", RUN_VARIANTS)
def test_one_plan_per_run_wherever_it_is_asked(tiny_llama, dataset, pairs, feedback, variant, tmp_path):
    """The trainer's plan.json (written for the device it really trains on), `core.train --dry-run`,
    `core.estimate --config` and the Train page's verdict: the same three totals for the same config."""
    from streamlit.testing.v1 import AppTest

    cfg = _run_config(tiny_llama, dataset, pairs, feedback, variant)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = dump_config(cfg, run_dir / "config.yaml")
    trained = _cli("-m", "core.train", str(path), "--run-dir", str(run_dir))
    assert trained.returncode == 0, trained.stderr[-2000:]
    written = json.loads((run_dir / "plan.json").read_text())
    assert written["plan"]["device"] == "cpu"  # no CUDA GPU here: the trainer planned the CPU run it did

    dry = _cli("-m", "core.train", str(path), "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    cli = _cli("-m", "core.estimate", "--config", str(path), "--json")
    assert cli.returncode == 0, cli.stderr[-2000:]
    for other in (json.loads(dry.stdout), json.loads(cli.stdout)):
        assert {k: other[k] for k in TOTALS} == {k: written[k] for k in TOTALS}
        assert other["plan"] == written["plan"]

    page = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=180)
    page.session_state["workspace"] = str(tmp_path / "ws")
    page.session_state["train_config"] = cfg
    page.run()
    assert not page.exception, page.exception
    # on a CPU the verdict is the process's RAM: the same plan's tensor peak, plus the runtime
    verdict = next(m.value for m in [*page.success, *page.warning, *page.error] if "at the peak" in m.value)
    from core.fmt import mem

    assert f"tensors {mem(written['tensor_peak_bytes'])} at the peak" in verdict, (verdict, written)
    assert "no CUDA GPU: it trains on the CPU" in verdict  # it names where it plans: this machine's CPU


@pytest.mark.parametrize("variant", RUN_VARIANTS)
def test_a_cuda_plan_is_the_same_from_dry_run_and_estimate(
    tiny_llama, dataset, pairs, feedback, variant, tmp_path
):
    cfg = _run_config(tiny_llama, dataset, pairs, feedback, variant)
    path = dump_config(cfg, tmp_path / "run.yaml")
    card = ("--device", "cuda", "--gpu-gb", "24")
    dry = json.loads(_cli("-m", "core.train", str(path), "--dry-run", *card).stdout)
    cli = json.loads(_cli("-m", "core.estimate", "--config", str(path), "--json", *card).stdout)
    mine = plan_json(cfg, 24.0, "cuda")
    assert dry["plan"]["device"] == "cuda" and dry["plan"]["compute_dtype"] == "bf16"
    for other in (dry, cli):
        assert {k: other[k] for k in TOTALS} == {k: mine[k] for k in TOTALS}


def test_train_page_plans_the_gpu_it_trains_on_with_the_gpu_driver_mocked(tiny_llama, dataset, monkeypatch):
    """No GPU here: the card the page plans is mocked (local_card), the planning is real."""
    from streamlit.testing.v1 import AppTest

    import core.estimate.from_config as fc

    monkeypatch.setattr(fc, "local_card", lambda: fc.Card("cuda", 24.0, "the NVIDIA RTX 4090"))
    cfg = _config(tiny_llama, dataset, {})
    page = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=180)
    page.session_state["train_config"] = cfg
    page.run()
    verdict = next(m.value for m in [*page.success, *page.warning, *page.error] if "tensor peak" in m.value)
    mine = plan_json(cfg, 24.0, "cuda")
    assert "RTX 4090" in verdict and f"tensor peak {mine['tensor_peak_bytes'] / 2**20:.1f} MiB" in verdict
