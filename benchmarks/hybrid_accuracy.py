"""Hybrid decoders (recurrent layers beside attention) against real training steps: the planner's tensor peak next
to the peak the smoke test measures, for a tiny random-weight Qwen3.5 language model (three Gated DeltaNet layers to
one of full attention) built from its config, and a Llama of the same shape beside it.

The planner plans each layer as itself (core.estimate.layer_kinds; the Gated DeltaNet terms in
core.estimate.gdn_terms, from transformers' torch path, which is what runs on a CPU). Before that it counted the
Gated DeltaNet layers as attention layers and this script measured 1.64x the plan without gradient checkpointing.
benchmarks/families_accuracy.py covers the other families and their real-width twins.

Measured: the Train page's smoke test (core.runs.admin.start_smoke_test: one real SFTTrainer step at batch size 1
and max_length, the live-tensor tracker's steady peak, smoke.json). Planned: plan.json's estimate for the same run
config. LoRA r 4 on all-linear (r above in_proj_a/b's width would add the narrow-layer warning only), bf16, 256
tokens.

Goal: every row within 5%, with gradient checkpointing and without.
Last line `hybrid_worst_error: X% (goal <= 5%)`; exit 1 on a miss.

    python benchmarks/hybrid_accuracy.py [--quick]

`--quick` (the suite's check that the script runs): the Qwen3.5 row with checkpointing only; headline printed, exit
0 even on a goal miss, non-zero on an error.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from moe_accuracy import smoke, smoke_workspace  # noqa: E402  (the same smoke-test harness and rows)

GOAL = 0.05
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=4,
)
MODELS = {
    "llama": {},
    "qwen3_5_text": dict(
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64
    ),
}


def run_config(model: Path, data: Path, checkpointing: bool) -> dict:
    from core.recipe.config import validate_config

    return validate_config(
        {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"},
            "data": {"path": str(data), "max_length": 256},
            "training": {
                "per_device_train_batch_size": 1,
                "max_steps": 5,
                "gradient_checkpointing": checkpointing,
            },
        }
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Qwen3.5 with checkpointing only (goal not judged)")
    args = ap.parse_args(argv)
    from core.demo.toy import build_tiny_model

    models = {"qwen3_5_text": MODELS["qwen3_5_text"]} if args.quick else MODELS
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        workspace, data = smoke_workspace(root)
        print(
            f"{'model':<14} {'checkpointing':<14} {'planned bytes':>14} {'measured bytes':>14} {'ratio':>7}"
        )
        for arch, extra in models.items():
            model = build_tiny_model(root / arch, arch, **SHAPE, **extra)
            for checkpointing in (True,) if args.quick else (True, False):
                r = smoke(workspace, f"{arch}-{int(checkpointing)}", run_config(model, data, checkpointing))
                planned, measured = r["estimate_bytes"], r["peak_bytes"]
                ratio = measured / planned
                ratios.append(ratio)
                print(
                    f"{arch:<14} {'on' if checkpointing else 'off':<14} {planned:>14,} {measured:>14,} {ratio:>7.3f}",
                    flush=True,
                )
    worst = max(abs(r - 1) for r in ratios)
    print(
        f"hybrid_worst_error: {worst:.2%} (goal <= {GOAL:.0%}{'; --quick: not judged' if args.quick else ''})"
    )
    return 0 if worst <= GOAL or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
