"""Multi-GPU planning must leave every one-GPU plan as it was: the estimates (every component, phase and total),
the fit search, the per-lever savings and the terminal table of a spread of one-GPU plans are compared with a
snapshot taken from the planner before multi-GPU planning existed (tests/data/single_gpu_golden.json).

Regenerate only on purpose (a deliberate change of the one-GPU model): GOLDEN_WRITE=1 pytest this file.
"""

import json
import os
from pathlib import Path

import pytest

from core.estimate.bill import estimate
from core.estimate.cli import format_table
from core.estimate.fit import fit_search
from core.estimate.levers import lever_savings
from core.estimate.plan import Plan, upgraded

GOLDEN = Path(__file__).parent / "data" / "single_gpu_golden.json"

PLANS = {
    "llama2-7b lora": dict(model="meta-llama/Llama-2-7b-hf", tuning="lora", batch_size=4, seq_len=2048),
    "llama2-7b qlora": dict(model="meta-llama/Llama-2-7b-hf", tuning="qlora", batch_size=8, seq_len=2048),
    "llama3.1-8b qlora 16GB": dict(
        model="meta-llama/Llama-3.1-8B", tuning="qlora", seq_len=4096, gpu_gb=16.0
    ),
    "qwen0.5b full cpu": dict(
        model="Qwen/Qwen2.5-0.5B",
        tuning="full",
        device="cpu",
        load_dtype="fp32",
        compute_dtype="fp32",
        autocast=False,
        gpu_gb=64.0,
    ),
    "mistral dpo paged": dict(
        model="mistralai/Mistral-7B-v0.1",
        tuning="qlora",
        method="dpo",
        optim="paged_adamw_8bit",
        seq_len=1024,
        batch_size=2,
    ),
    "tinyllama lora levers": dict(
        model="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        tuning="lora",
        padding_free=True,
        attn="flash",
        expandable_segments=True,
        batch_size=8,
        batch_tokens=5000,
    ),
}


def _snapshot(fields: dict) -> dict:
    plan = Plan(**fields)
    est = estimate(plan)
    fit = fit_search(plan)
    return {
        "estimate": est.to_dict(),
        "fit_search": fit,
        "levers": lever_savings(plan),
        "table": format_table(est, fit),
    }


@pytest.mark.parametrize("name", list(PLANS))
def test_one_gpu_plans_are_unchanged_by_multi_gpu_planning(name):
    got = json.loads(json.dumps(_snapshot(PLANS[name])))
    if os.environ.get("GOLDEN_WRITE"):
        data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        data[name] = got
        GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())[name]
    want["estimate"]["plan"] = upgraded(want["estimate"]["plan"])  # recorded in the plan's names before #48
    assert got == want
