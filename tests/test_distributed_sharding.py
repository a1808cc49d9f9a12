"""The planner's ÷N terms against what raw torch FSDP really holds per rank: two processes on gloo (CPU), a tiny
Llama with a PEFT LoRA adapter, wrapped by FSDP2 (per decoder layer), FSDP1 (PEFT's wrap policy,
use_orig_params=False) and DDP (tests/fsdp_shard_worker.py under torchrun). Each rank's bytes of frozen weights,
LoRA parameters, gradients and AdamW states after one step equal the planner's per-GPU figures for the same model
folder, exactly (the tiny model's dimensions divide evenly)."""

import json
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


def planned(model_dir: Path, gpus: int, strategy: str) -> dict:
    plan = Plan(
        model=str(model_dir),
        method="lora",
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
    return estimate(plan).phase_components["optimizer"]


@pytest.mark.slow
@pytest.mark.parametrize("mode, strategy", [("fsdp2", "fsdp"), ("fsdp1", "fsdp"), ("ddp", "ddp")])
def test_each_rank_holds_what_the_planner_plans_per_gpu(model_dir, tmp_path, mode, strategy):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(WORKER), str(model_dir), mode, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"{mode}-{r}.json").read_text()) for r in (0, 1)]
    per_gpu, one_gpu = planned(model_dir, 2, strategy), planned(model_dir, 1, "auto")
    for measured_key, term in TERMS.items():
        for rank in ranks:
            assert rank[measured_key] == per_gpu[term], (mode, term)
        # sharded: the two ranks together hold one copy; DDP: each holds one
        together = sum(rank[measured_key] for rank in ranks)
        assert together == one_gpu[term] * (2 if strategy == "ddp" else 1), (mode, term)


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
