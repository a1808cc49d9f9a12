"""Published vision-language fine-tuning memory next to the planner's plan of the same recipe (issue 36 item 3).

ms-swift's Qwen2.5-VL-7B LoRA examples (ViT and aligner frozen: freeze_vit, freeze_aligner; LoRA r 8, alpha 32,
all-linear on the language model, batch 1, gradient checkpointing, bf16) published their memory; the planner plans
the recipe from config.json alone (the bundled preset, the model's public config fields) twice: on this engine's
stack -- transformers 5.24, peft 0.21, TRL 1.16 SFTTrainer (fused LM head), sdpa, AdamW -- and with the plain
cross-entropy over the full logits, as ms-swift computes its loss. The images: as large as MAX_PIXELS lets them be
(2048 x 2048 source images resized into it); where the script does not state MAX_PIXELS, 1024 x 1024 images at the
processor's default. Nothing is measured here: a published figure is what nvidia-smi showed, compared with the
plan's device total; RESULTS.md records the gap.

    python benchmarks/vlm_published.py [--quick]

Nothing is judged (ms-swift's stack is not this engine's); the last line is the headline. `--quick` (what the suite
runs) plans the first recipe only; exit 0, non-zero on an error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GiB = 2**30
GB = 10**9
MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
RECIPE = dict(model=MODEL, tuning="lora", lora_r=8, lora_alpha=32, lora_dropout=0.05, batch_size=1, gpu_gb=80)

# (label, source and its unit, published bytes, plan settings)
ROWS = [
    (
        "LoRA, frozen ViT, max_length 4096, MAX_PIXELS 1,003,520",
        "ms-swift examples/train/multimodal/ocr.sh: 20 GB",
        20 * GB,
        dict(seq_len=4096, max_pixels=1_003_520, image_width=2048, image_height=2048),
    ),
    (
        "LoRA, frozen ViT, max_length 2048, MAX_PIXELS not stated",
        "ms-swift examples/train/multimodal/caption.sh: 22 GiB",
        22 * GiB,
        dict(seq_len=2048),
    ),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first recipe only")
    args = ap.parse_args(argv)
    from core.estimate.bill import estimate
    from core.estimate.plan import Plan

    rows, gaps = ROWS[:1] if args.quick else ROWS, []
    print(f"{'recipe':<58} {'stack':<22} {'published':>10} {'planned':>9} {'gap':>7}  image tokens, peak")
    for label, source, published, settings in rows:
        for stack, fused in (("engine (fused head)", True), ("plain cross-entropy", False)):
            est = estimate(Plan(**RECIPE, **settings, fused_lm_head=fused))
            planned = est.device_total_bytes
            if fused:
                gaps.append(planned / published - 1)
            v = est.vlm
            print(
                f"{label:<58} {stack:<22} {published / GiB:>8.1f}Gi {planned / GiB:>7.1f}Gi "
                f"{planned / published - 1:>+7.0%}  {v['image_tokens_per_image']:,} per image, {est.peak_phase}"
            )
        print(f"{'':<58} source: {source}; images: {v['tokens_source']}")
    print(
        f"vlm_published: the engine's plans {min(gaps):+.0%} to {max(gaps):+.0%} of the published figures over "
        f"{len(gaps)} recipe(s) (goal: none, ms-swift's stack; RESULTS.md records the gaps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
