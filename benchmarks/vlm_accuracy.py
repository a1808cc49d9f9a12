"""Vision-language plans against real training steps (issue 36 item 3): the planner's tensor peak next to the peak
the live-tensor tracker measures in one real step, for tiny random-weight Qwen2.5-VL, SmolVLM and LLaVA models
built from their configs (and Qwen3-VL, whose deepstack mergers feed intermediate vision features to the
language model).

Measured: core.measure.vlm_step.measure_vlm -- the model built as the engine trains a VLM (transformers'
image-text-to-text class, bf16 weights, sdpa; peft LoRA r 4 on the language model's Linears with the vision tower
and projector frozen, or on every Linear with them trained; gradient checkpointing with SFTTrainer's input
gradients; TRL's fused LM head; Trainer's AdamW), fed what the family's real image processor makes of random
images (448 px for Qwen2.5-VL: 1,024 patches, 256 tokens; 512 px for Qwen3-VL: 1,024 patches of 16 px; 512 px for
SmolVLM: 17 tiles; 224 px for LLaVA), one image per row, 320-token rows, one step under core.tracker (the
steady peak: the optimizer state alive).
Planned: core.estimate for the same plan, on the CPU. The vision towers are 256 wide and 4 blocks deep on a 64-wide
language model, so that the image terms (pixels, the vision tower's activations) are a large share of the step.

The families of issue #47 (Mistral 3, InternVL, LLaVA-NeXT, GLM-4.1V, LLaVA-OneVision, PaliGemma, Gemma 4,
Idefics2, Llama 4) are their tiny twins of core.measure.vlm_families: the same wide tower, 1,536-token rows, each
family's image at its encoder's size (Llama 4: 672 x 336, two chunks and the global one), measured with the tower
frozen (checkpointing on and off) and trained (checkpointing on). A row core.measure.vlm_families.KNOWN_GAPS names
is printed with its reason and not judged.

Goal: every row within 5% (|measured / planned - 1| <= 0.05): the vision tower frozen (the default) or trained
(LoRA on its Linears and the projector's too), with and without gradient checkpointing. Last line
`vlm_worst_error: X% (goal <= 5%)`; exit 1 on a miss.

    python benchmarks/vlm_accuracy.py [--only qwen2_5_vl] [--quick]

`--quick` (the suite's check that the script runs): LLaVA (the smallest images), checkpointing on, the tower
frozen; like --only, a goal miss does not fail it, an error does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GOAL = 0.05
VISION = {
    "qwen2_5_vl": dict(
        hidden_size=256, intermediate_size=512, depth=4, num_heads=4, fullatt_block_indexes=[3]
    ),
    "qwen3_vl": dict(
        hidden_size=256, intermediate_size=512, depth=4, num_heads=4, deepstack_visual_indexes=[1, 2]
    ),
    "smolvlm": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4),
    "llava": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, image_size=224
    ),
}
IMAGE = {"qwen2_5_vl": 448, "qwen3_vl": 512, "smolvlm": 512, "llava": 224}
CASES = [(True, True), (False, True), (True, False), (False, False)]  # (checkpointing, vision frozen)


def main(argv=None) -> int:
    import warnings

    warnings.simplefilter("ignore")
    from core.demo.toy_vlm import tiny_vlm_config
    from core.estimate.bill import estimate
    from core.estimate.plan import Plan
    from core.measure.vlm_step import measure_vlm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated families (goal not judged)")
    p.add_argument("--quick", action="store_true", help="one LLaVA row (goal not judged)")
    args = p.parse_args(argv)
    from core.measure.vlm_families import MEASURED

    wanted = ["llava"] if args.quick else args.only.split(",") if args.only else [*VISION, *MEASURED]
    families = [f for f in wanted if f in VISION]
    twins = [f for f in wanted if f in MEASURED]
    cases = CASES[:1] if args.quick else CASES
    judged = []
    print(
        f"{'family':<11} {'ckpt':<5} {'vision':<8} {'image tokens':>12} {'planned bytes':>14} "
        f"{'measured bytes':>14} {'ratio':>7}  phase (planned/measured)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            cfg = tiny_vlm_config(family, vision=VISION[family])
            folder = Path(tmp) / family
            cfg.save_pretrained(folder)
            for checkpointing, frozen in cases:
                plan = Plan(
                    model=str(folder),
                    load_dtype="bf16",
                    compute_dtype="bf16",
                    autocast=False,
                    device="cpu",
                    lora_r=4,
                    lora_alpha=8,
                    lora_dropout=0.0,
                    seq_len=320,
                    image_width=IMAGE[family],
                    image_height=IMAGE[family],
                    gradient_checkpointing=checkpointing,
                    vision_frozen=frozen,
                )
                measured = measure_vlm(cfg, plan)
                est = estimate(plan)
                ratio = measured.steady_peak_bytes / est.tensor_peak_bytes
                judged.append(abs(ratio - 1))
                print(
                    f"{family:<11} {'on' if checkpointing else 'off':<5} {'frozen' if frozen else 'trained':<8} "
                    f"{est.vlm['image_tokens_per_image']:>12} {est.tensor_peak_bytes:>14,} "
                    f"{measured.steady_peak_bytes:>14,} {ratio:>7.4f}  {est.peak_phase}/"
                    f"{measured.steady_peak_phase}",
                    flush=True,
                )
        gaps = twin_rows(Path(tmp), twins, judged)
    worst = max(judged, default=0.0)
    judged = not (args.only or args.quick)
    print(
        f"vlm_worst_error: {worst:.2%} (goal <= {GOAL:.0%}{'' if judged else '; subset, not judged'})"
        + (f"; {len(gaps)} known-gap row(s) not judged, worst {max(gaps):.2%}" if gaps else "")
    )
    return 0 if not judged or worst <= GOAL else 1


def twin_rows(tmp: Path, families: list[str], judged: list[float]) -> list[float]:
    """The issue #47 families' rows (core.measure.vlm_families' wide twins); the errors of known-gap rows."""
    from core.estimate.bill import estimate
    from core.measure.vlm_families import KNOWN_GAPS, measure_family, measured_plan, wide_twin

    gaps = []
    for family in families:
        cfg = wide_twin(family)
        folder = tmp / f"twin-{family}"
        cfg.save_pretrained(folder)
        for checkpointing, frozen in [(True, True), (False, True), (True, False)]:
            plan = measured_plan(folder, family, checkpointing, frozen)
            measured, est = measure_family(cfg, plan), estimate(plan)
            ratio = measured / est.tensor_peak_bytes
            gap = KNOWN_GAPS.get((family, checkpointing)) if abs(ratio - 1) > GOAL else None
            (gaps if gap else judged).append(abs(ratio - 1))
            print(
                f"{family:<11} {'on' if checkpointing else 'off':<5} {'frozen' if frozen else 'trained':<8} "
                f"{est.vlm['image_tokens_per_image']:>12} {est.tensor_peak_bytes:>14,} {measured:>14,} "
                f"{ratio:>7.4f}  {est.peak_phase}" + (f"  (known gap: {gap})" if gap else ""),
                flush=True,
            )
    return gaps


if __name__ == "__main__":
    sys.exit(main())
