"""DPO (issue #13): the run config as trl.DPOConfig, the one config -> plan mapping, the planner against a measured
DPOTrainer step, and real DPO runs on a CPU (python -m core.train as a process, the smoke test)."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from core import rundir
from core.demo.prefs import write_pref_data
from core.demo.toy import tiny_config
from core.estimate.bill import estimate
from core.estimate.from_config import plan_for_config, plan_to_config
from core.estimate.plan import Plan
from core.measure.step import measure_plan
from core.measure.step_plan import step_plan
from core.recipe.config import ConfigError, validate_config
from tests.cli import train

REPO = Path(__file__).resolve().parent.parent
GOAL = 0.03


def _cfg(model, data, **training):
    return validate_config(
        {
            "method": "dpo",
            "model": {"path": str(model)},
            "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
            "data": {"path": str(data), "format": "standard"},
            "training": {
                "max_length": 32,
                "per_device_train_batch_size": 8,
                "max_steps": 30,
                "learning_rate": 2e-3,
                "logging_steps": 5,
                "save_steps": 30,
                "gradient_checkpointing": False,
                **training,
            },
        }
    )


# -- the run config ---------------------------------------------------------------------------------------------


def test_dpo_training_section_is_trls_dpoconfig(tmp_path):
    cfg = _cfg("m", "d.jsonl", beta=0.2, loss_type=["sigmoid"], precompute_ref_log_probs=True)
    assert cfg["method"] == "dpo" and cfg["training"]["beta"] == 0.2
    from core.recipe.engine_args import training_args

    args = training_args(cfg)
    assert type(args).__name__ == "DPOConfig" and args.beta == 0.2 and args.precompute_ref_log_probs
    # a DPO run without a learning rate gets a DPO-sized one, not SFT's 2e-4
    bare = validate_config({"method": "dpo", "model": {"path": "m"}, "data": {"path": "d"}})
    assert bare["training"]["learning_rate"] < 1e-4


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"method": "sft", "training": {"beta": 0.1}}, "setting of DPO"),
        ({"method": "dpo", "training": {"packing": True}}, "setting of SFT"),
        ({"method": "dpo", "data": {"path": "d", "format": "chat"}}, "preference pairs"),
        (
            {"method": "sft", "model": {"path": "m", "reference_path": "r"}},
            "reference model of a preference run",
        ),
        ({"method": "ppo"}, "sft, dpo, kto"),
        ({"method": "dpo", "training": {"beta": "high"}}, "training.beta"),
    ],
)
def test_dpo_config_mistakes_are_one_sentence(raw, words):
    full = {"model": {"path": "m"}, "data": {"path": "d"}}
    for key, value in raw.items():
        full[key] = {**full.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError) as err:
        validate_config(full)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_one_mapping_plans_dpo_and_inverts(tmp_path):
    cfg = _cfg("meta-llama/Llama-2-7b-hf", "d.jsonl", precompute_ref_log_probs=True)
    plan = plan_for_config(cfg, 24.0, "cuda")
    assert plan.method == "dpo" and plan.precompute_ref and plan.reference == "auto"
    assert plan_for_config(plan_to_config(plan.to_dict(), cfg), 24.0, "cuda") == plan
    ref = plan_for_config({**cfg, "model": {**cfg["model"], "reference_path": "/some/ref"}}, 24.0, "cuda")
    assert ref.reference == "copy" and estimate(ref).components["reference_model"] > 0
    # DPOConfig.disable_dropout (default) turns LoRA dropout into an identity: planned without it
    dropped = plan_for_config({**cfg, "lora": {**cfg["lora"], "lora_dropout": 0.1}}, 24.0, "cuda")
    assert dropped.lora_dropout == 0.0


def test_dpo_doubles_the_rows_and_adds_the_reference_forward():
    plan = Plan(model="meta-llama/Llama-2-7b-hf", batch_size=2, seq_len=1024, method="dpo")
    sft = estimate(replace(plan, method="sft"))
    dpo = estimate(plan)
    assert dpo.batch_rows == 2 * sft.batch_rows
    assert dpo.components["activations"] > 1.9 * sft.components["activations"]
    pre = estimate(replace(plan, precompute_ref=True))
    assert pre.phases["forward"] <= dpo.phases["forward"]


# -- planner against a measured DPOTrainer step -----------------------------------------------------------------


@pytest.mark.parametrize(
    "plan",
    [
        step_plan("lora", batch_size=2, seq_len=64, method="dpo"),
        step_plan("lora", batch_size=2, seq_len=64, method="dpo", gradient_checkpointing=True),
        step_plan("lora", batch_size=2, seq_len=64, method="dpo", precompute_ref=True),
        step_plan("qlora", batch_size=1, seq_len=128, method="dpo"),
    ],
    ids=["dpo", "dpo-gc", "dpo-precomputed", "dpo-qlora"],
)
def test_planner_agrees_with_a_measured_dpo_step(tmp_path, plan):
    if plan.tuning == "qlora":
        pytest.importorskip("bitsandbytes")
    config = tiny_config(
        "llama", num_hidden_layers=3, vocab_size=2000, intermediate_size=256, hidden_size=128
    )
    folder = tmp_path / "m"
    folder.mkdir()
    config.to_json_file(str(folder / "config.json"))
    measured = measure_plan(config, plan, cache_dir=tmp_path)
    est = estimate(replace(plan, model=str(folder)))
    error = est.tensor_peak_bytes / measured.steady_peak_bytes - 1
    assert abs(error) <= GOAL, (error, est.phases, measured.steady_phase_peaks)


# -- real DPO runs -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    return write_pref_data(tmp_path_factory.mktemp("prefs"))


@pytest.mark.slow
def test_dpo_run_through_core_train_learns_the_preference_on_heldout_pairs(tmp_path, tiny_llama, prefs):
    """python -m core.train on a `method: dpo` config, as a process: DPOTrainer's metrics land in metrics.jsonl,
    the adapter is saved, and on held-out pairs (data.eval_split) the policy's implicit reward ranks the chosen
    answer first. (A random tiny model still finds the shorter answer likelier in absolute terms; the demo's
    absolute preference accuracy is test_demo_run_dpo_prints_its_preference_accuracy.)"""
    run_dir = tmp_path / "run"
    cfg = _cfg(tiny_llama, prefs[0], eval_steps=10)
    cfg["data"]["eval_split"] = 0.1
    proc = train(cfg, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines() if line]
    accuracies = [m["rewards/accuracies"] for m in metrics if "rewards/accuracies" in m]
    margins = [m["rewards/margins"] for m in metrics if "rewards/margins" in m]
    assert len(accuracies) >= 5 and margins[-1] > margins[0]
    heldout = [m["eval_rewards/accuracies"] for m in metrics if "eval_rewards/accuracies" in m]
    assert len(heldout) >= 2 and heldout[-1] >= 0.8, heldout
    assert json.loads((run_dir / rundir.PLAN).read_text())["plan"]["method"] == "dpo"
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    # a DPO adapter merges and verifies exactly as an SFT one
    from core.merge.export import merge_at

    merged = merge_at(tiny_llama, run_dir / "adapter", tmp_path / "merged")
    assert merged.verification.passed and (tmp_path / "merged" / "config.json").is_file()


@pytest.mark.slow
def test_demo_run_dpo_prints_its_preference_accuracy(tmp_path, demo_trained):
    """python -m core.demo --run-dpo: the demo SFT run, merged, then DPO on top; the last line says how often the
    model prefers the chosen answer of a held-out pair (absolute likelihood), before and after. On a copy of the
    session's trained demo (conftest.py), building on its SFT adapter with --adapter, as a user who ran --run."""
    demo = demo_trained.copy(tmp_path / "demo")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "core.demo",
            "--out",
            str(demo),
            "--run-dpo",
            "--adapter",
            str(demo_trained.adapter),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("dpo demo:")][-1]
    before, after = (int(x.rstrip("%")) for x in line.rsplit(" ", 3)[1::2])
    assert after >= 80 and after >= before + 20, line


@pytest.mark.slow
def test_dpo_smoke_test_measures_a_max_length_pair_step(workspace, tiny_llama, prefs):
    from core.estimate.from_config import estimate_for_config, plan_record
    from core.runs.admin import start_smoke_test
    from core.runs.launcher import wait_for_smoke

    cfg = _cfg(tiny_llama, prefs[0])
    plan = plan_record(estimate_for_config(cfg, 24.0, "cpu", smoke=True))
    assert plan["plan"]["method"] == "dpo" and plan["batch_rows"] == 2 and plan["batch_length"] == 32
    result = wait_for_smoke(start_smoke_test(workspace, "dpo-smoke", cfg), timeout=300)
    assert result is not None and result["state"] == "finished", result
    assert result["peak_bytes"] > 0 and abs(result["peak_bytes"] / result["estimate_bytes"] - 1) <= 0.10


@pytest.mark.slow
def test_dpo_with_an_explicit_reference_model_trains(tmp_path, tiny_llama, prefs):
    """model.reference_path: DPOTrainer gets that model (loaded like the base) as its frozen reference."""
    cfg = _cfg(tiny_llama, prefs[0], max_steps=2, logging_steps=1, save_steps=2)
    cfg["model"]["reference_path"] = str(tiny_llama)
    run_dir = tmp_path / "run"
    proc = train(cfg, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((run_dir / rundir.PLAN).read_text())
    assert plan["plan"]["reference"] == "copy" and plan["components"]["reference_model"] > 0
    assert any(
        "rewards/margins" in json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines()
    )


def test_a_dpo_plan_pads_even_with_padding_free_ticked():
    """DPOTrainer 1.16 has no packing and turns padding-free off: the plan keeps [chosen; rejected] rows padded."""
    plan = Plan(model="meta-llama/Llama-2-7b-hf", method="dpo", padding_free=True, batch_size=2, seq_len=1024)
    est = estimate(plan)
    assert (est.batch_rows, est.batch_length) == (4, 1024)
    assert est.components == estimate(replace(plan, padding_free=False)).components
    assert any("DPO pads" in w for w in est.warnings)
