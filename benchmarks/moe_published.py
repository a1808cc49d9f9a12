"""Published mixture-of-experts fine-tuning memory next to the planner's plan of the same recipe (issue 36).

Each row: the figure a tool published (its own stack: ms-swift, axolotl and Unsloth use their own kernels and
settings), the recipe as far as the source states it, and the planner's plan of that recipe on this engine's
stack -- transformers 5.24 (grouped_mm experts), peft 0.21 (LoRA on experts through target_parameters, merged
into a copy of each layer's experts every forward), TRL 1.16 SFTTrainer (fused LM head, the load-balancing loss),
bitsandbytes 0.50 (4-bit for nn.Linear only), gradient checkpointing, AdamW, one 80 GiB (or 141 GiB) card. The
plans are from config.json alone (the bundled presets: the models' public config fields); nothing is measured
here. A published figure is what nvidia-smi or the allocator showed: compared with the plan's device total
(reserved for axolotl's "reserved"), and the gap is what the table in RESULTS.md records.

    python benchmarks/moe_published.py [--quick]

Nothing is judged (the published stacks are not this engine's); the last line is the headline. `--quick` (what the
suite runs) plans the first recipe only; exit 0, non-zero on an error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GiB = 2**30
GB = 10**9
EXPERTS = "mlp.experts.gate_up_proj,mlp.experts.down_proj"

# (label, source and its unit, published bytes, which total it is, plan settings)
ROWS = [
    (
        "gpt-oss-20b bf16 LoRA r8 all-linear, 2048, bs 1",
        "ms-swift examples/models/gpt_oss/train.sh: 42 GB",
        42 * GB,
        "device_total_bytes",
        dict(model="openai/gpt-oss-20b", tuning="lora", lora_r=8, lora_alpha=32, seq_len=2048, gpu_gb=80),
    ),
    (
        "gpt-oss-20b LoRA r8, 4096 packed, activation offloading",
        "axolotl gpt-oss docs: ~44 GiB",
        44 * GiB,
        "device_total_bytes",
        dict(
            model="openai/gpt-oss-20b",
            tuning="lora",
            lora_r=8,
            lora_alpha=16,
            seq_len=4096,
            packing=True,
            activation_offloading=True,
            gpu_gb=80,
        ),
    ),
    (
        "GLM-4.7-Flash QLoRA, experts bf16",
        "axolotl docs/expert_quantization.qmd: ~127 GiB reserved",
        127 * GiB,
        "reserved_peak_bytes",
        dict(
            model="zai-org/GLM-4.7-Flash",
            tuning="qlora",
            lora_r=16,
            lora_dropout=0.0,
            seq_len=2048,
            gpu_gb=141,
        ),
    ),
    (
        "GLM-4.7-Flash QLoRA, experts bf16, prepare_model_for_kbit_training",
        "axolotl docs/expert_quantization.qmd: ~127 GiB reserved",
        127 * GiB,
        "reserved_peak_bytes",
        dict(
            model="zai-org/GLM-4.7-Flash",
            tuning="qlora",
            prepare_kbit=True,
            lora_r=16,
            lora_dropout=0.0,
            seq_len=2048,
            gpu_gb=141,
        ),
    ),
    (
        "GLM-4.7-Flash QLoRA, experts quantized on load",
        "axolotl docs/expert_quantization.qmd (quantize_moe_experts): ~23 GiB",
        23 * GiB,
        "reserved_peak_bytes",
        dict(
            model="zai-org/GLM-4.7-Flash",
            tuning="qlora",
            quantize_experts=True,
            lora_r=16,
            lora_dropout=0.0,
            seq_len=2048,
            gpu_gb=141,
        ),
    ),
    (
        "Qwen3-30B-A3B bf16 LoRA r16 attention only, 2048",
        "Unsloth Qwen3 guide (16-bit LoRA): 63 GB",
        63 * GB,
        "device_total_bytes",
        dict(
            model="Qwen/Qwen3-30B-A3B",
            tuning="lora",
            lora_r=16,
            target_modules="q_proj,k_proj,v_proj,o_proj",
            seq_len=2048,
            gpu_gb=80,
        ),
    ),
    (
        "Qwen3-30B-A3B bf16 LoRA r16 all-linear (+ experts), 2048",
        "Unsloth Qwen3 guide (16-bit LoRA): 63 GB",
        63 * GB,
        "device_total_bytes",
        dict(model="Qwen/Qwen3-30B-A3B", tuning="lora", lora_r=16, lora_dropout=0.0, seq_len=2048, gpu_gb=80),
    ),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first recipe only")
    args = ap.parse_args(argv)
    from core.estimate.bill import estimate
    from core.estimate.plan import Plan

    rows, gaps = ROWS[:1] if args.quick else ROWS, []
    print(f"{'recipe':<58} {'published':>10} {'planned':>9} {'gap':>7}  planned stack")
    for label, source, published, total, settings in rows:
        est = estimate(Plan(**settings))
        planned = getattr(est, total)
        gaps.append(planned / published - 1)
        m = est.moe
        stack = (
            f"experts {m['expert_dtype']} {m['expert_weight_bytes'] / GiB:.1f} GiB, LoRA on "
            f"{', '.join(m['lora_on']) or 'attention/dense only'} ({est.trainable_params / 1e6:.0f} M trainable), "
            f"peak {est.peak_phase}, {total.split('_')[0]}"
        )
        print(
            f"{label:<58} {published / GiB:>8.1f}Gi {planned / GiB:>7.1f}Gi {planned / published - 1:>+7.0%}  {stack}"
        )
        print(f"{'':<58} source: {source}")
    print(
        f"moe_published: plans {min(gaps):+.0%} to {max(gaps):+.0%} of the published figures over {len(gaps)} "
        "recipe(s) (goal: none, other stacks; RESULTS.md records the gaps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
