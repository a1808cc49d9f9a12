"""The planner's ÷N terms against what raw torch FSDP really holds per rank: two processes on gloo (CPU), a tiny
Llama with a PEFT LoRA adapter, wrapped by FSDP2 (per decoder layer), FSDP1 (PEFT's wrap policy,
use_orig_params=False) and DDP (tests/fsdp_shard_worker.py under torchrun). Each rank's bytes of frozen weights,
LoRA parameters, gradients and AdamW states after one step equal the planner's per-GPU figures for the same model
folder, exactly (the tiny model's dimensions divide evenly). The 4-bit model of a QLoRA run, loaded by transformers
as the product loads it and wrapped by FSDP1: the frozen weights halve, the quantization constants do not, and
every rank first holds the whole 4-bit model -- the planner's per-GPU terms and load moment."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.demo.toy import tiny_config
from core.estimate.bill import estimate
from core.estimate.plan import Plan

WORKER = Path(__file__).parent / "fsdp_shard_worker.py"
TERMS = {
    "frozen": "weights",
    "trainable": "lora_params",
    "gradients": "gradients",
    "optimizer_states": "optimizer_states",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_config("llama", num_hidden_layers=2, tie_word_embeddings=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """The tiny Llama with weights (transformers quantizes a checkpoint as it loads it)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-weights")
    torch.manual_seed(0)
    config = tiny_config("llama", num_hidden_layers=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def planned(model_dir: Path, gpus: int, strategy: str, method: str = "lora") -> dict:
    return estimate(plan_of(model_dir, gpus, strategy, method)).phase_components["optimizer"]


def plan_of(model_dir: Path, gpus: int, strategy: str, method: str = "lora") -> Plan:
    return Plan(
        model=str(model_dir),
        tuning=method,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules="all-linear",
        load_dtype="fp32",
        compute_dtype="fp32",
        autocast=False,
        device="cpu",
        batch_size=2,
        seq_len=16,
        gpu_gb=8.0,
        gpus=gpus,
        strategy=strategy,
    )


def run_ranks(model_dir: Path, mode: str, out: Path, env=None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(WORKER), str(model_dir), mode, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("mode, strategy", [("fsdp2", "fsdp"), ("fsdp1", "fsdp"), ("ddp", "ddp")])
def test_each_rank_holds_what_the_planner_plans_per_gpu(model_dir, tmp_path, mode, strategy):
    ranks = run_ranks(model_dir, mode, tmp_path)
    per_gpu, one_gpu = planned(model_dir, 2, strategy), planned(model_dir, 1, "auto")
    for measured_key, term in TERMS.items():
        for rank in ranks:
            assert rank[measured_key] == per_gpu[term], (mode, term)
        # sharded: the two ranks together hold one copy; DDP: each holds one
        together = sum(rank[measured_key] for rank in ranks)
        assert together == one_gpu[term] * (2 if strategy == "ddp" else 1), (mode, term)


@pytest.mark.slow
def test_qlora_ranks_hold_the_quantization_constants_whole_and_load_the_4bit_model_whole(
    weights_dir, tmp_path
):
    # accelerate's FSDP launch sets these; transformers 5 still loads a quantized model whole on every rank
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    ranks = run_ranks(weights_dir, "qlora-fsdp1", tmp_path, env)
    est = estimate(plan_of(weights_dir, 2, "fsdp", "qlora"))
    one = estimate(plan_of(weights_dir, 1, "auto", "qlora")).phase_components["optimizer"]
    per_gpu = est.phase_components["optimizer"]
    assert one["quant_constants"] > 0
    for rank in ranks:
        assert rank["frozen"] == per_gpu["weights"] == -(-one["weights"] // 2)  # packed 4-bit + the rest, / 2
        # in each weight's QuantState, not a parameter: FSDP leaves them whole on every rank
        assert rank["quant_constants"] == per_gpu["quant_constants"] == one["quant_constants"]
        # before FSDP shards it: the whole 4-bit model on this rank (its GPU, in a real run)
        assert rank["loaded"] == est.distributed["load_peak_bytes"] == one["weights"] + one["quant_constants"]


@pytest.mark.slow
def test_multi_gpu_truth_takes_its_code_path_on_two_cpu_processes(tmp_path):
    """benchmarks/multi_gpu_truth.py (run on a machine with >= 2 GPUs) stays runnable: --dry-run wraps and trains
    the same way on 2 gloo ranks and plans each strategy."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "multi_gpu_truth.py"
    done = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("multi_gpu_truth (dry run, cpu): 2 strategies ran")
    rows = json.loads((tmp_path / "multi_gpu_truth.json").read_text())
    assert [r["mode"] for r in rows] == ["fsdp", "ddp"] and all(len(r["ranks"]) == 2 for r in rows)
