"""How right is the per-GPU planner? Its estimate against the published per-GPU memory of multi-GPU LoRA/QLoRA
runs (docs/design/multi-gpu.md, "The published figures"), each planned with the settings its source states.

Nothing runs on a GPU here: the figures are the sources' own. Each point says which figure it reports and the
planner's matching total is compared:
- Answer.AI fsdp_qlora (`benchmarks_03_2024.md`): "Peak Memory" = torch's peak *reserved* memory per GPU (their
  note: "the reported peak reserved memory"), GiB; their train.py: pure bf16 (no autocast), plain HF loss over
  the full logits, LoRA r64 alpha 16 dropout 0.1 on q,k,v,gate,up,down, reentrant checkpointing, dummy rows of
  exactly the context length; "DDP" there is FSDP's NO_SHARD (replicated weights).
- huggingface/peft `docs/source/accelerate/fsdp.md`, `deepspeed.md`: "memory per GPU" (nvidia-smi: the planner's
  device total), GB taken as GiB (nvidia-smi counts MiB); their example: r8 alpha 16 dropout 0.1 all-linear,
  bf16 autocast, flash attention, packed rows of 2048 tokens, nested quantization, plain TRL loss (2024).
- philschmid `training/fsdp-qlora-distributed-llama3.ipynb`: nvidia-smi per GPU (device total), r16 all-linear,
  packed 3072-token rows, sdpa, bf16 autocast, plain loss, CPU offload; Llama-3.1-70B stands in for Llama-3-70B
  (same shapes, same 128k vocabulary).
No constant is tuned per point; a point that misses says why below its row.

Loading: the planner plans today's path, where every rank first holds the whole 4-bit model on its GPU
(transformers 5 quantizes where device_map points and has no rank-0-only loading). The 2024 sources quantized each
weight on the GPU and moved it to the CPU (rank 0) or the meta device (the others) at once -- Answer.AI's
`load_and_quantize`, transformers 4.39-4.4x under FSDP -- so their FSDP QLoRA rows had no such moment: those rows
(PER_WEIGHT_LOADERS) compare the planned step without it. Both kept the quantization constants on every GPU, as
the planner does.

    python benchmarks/multi_gpu_published.py            # every point (goal judged)
    python benchmarks/multi_gpu_published.py --json out.json
    python benchmarks/multi_gpu_published.py --quick      # the first 3 points, goal not judged (the suite's run)

`--quick` shows the script still runs: headline printed, exit 0 even on a goal miss, non-zero on an error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core.estimate.bill import estimate  # noqa: E402
from core.estimate.plan import GiB, Plan  # noqa: E402

GOAL_MEDIAN, GOAL_WORST = 0.10, 0.20

AAI = Plan(
    model="meta-llama/Llama-2-7b-hf",
    tuning="qlora",
    lora_r=64,
    lora_alpha=16,
    lora_dropout=0.1,
    target_modules="q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj",
    batch_size=1,
    seq_len=512,
    compute_dtype="bf16",
    autocast=False,
    fused_lm_head=False,
    gpu_gb=24.0,
    gpus=2,
    strategy="fsdp",
)
PEFT = Plan(
    model="meta-llama/Llama-2-70b-hf",
    tuning="qlora",
    lora_r=8,
    lora_alpha=16,
    lora_dropout=0.1,
    batch_size=2,
    seq_len=2048,
    attn="flash",
    fused_lm_head=False,
    packing=True,
    gpu_gb=24.0,
    gpus=2,
    strategy="fsdp",
)
AAI_SRC = "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md"
PEFT_FSDP = "huggingface/peft docs/source/accelerate/fsdp.md"
PEFT_DS = "huggingface/peft docs/source/accelerate/deepspeed.md"
PHIL_SRC = "philschmid/deep-learning-pytorch-huggingface training/fsdp-qlora-distributed-llama3.ipynb"
# Sources whose FSDP loaders put each quantized weight on CPU / meta as it was made (no whole-model moment)
PER_WEIGHT_LOADERS = (AAI_SRC, PEFT_FSDP, PHIL_SRC)


ALLOCATOR = (
    "reserved - allocated: the source publishes 1.96 / 1.06 GiB for its LoRA rows, the planner has 0.34 / 0.51 "
    "(its fragmentation share, 20% of the transient bytes, comes from one-process runs); FSDP's all-gather and "
    "reduce-scatter streams keep cached blocks of their own -- not modelled"
)
OFFLOAD = (
    "CPU offload: planned as the gathered units, activations, loss and the quantization constants (not a parameter: "
    "they stay on the GPU) only, 2.5-6.4 GiB under the published figures; FSDP1's offload stages each shard through a GPU buffer and its gradient back through pinned memory, "
    "and the allocator caches blocks per stream: suspected, not modelled"
)
PEFT70 = (
    "the PEFT 70B rows miss by 5.7 (no offload) and 6.4 GiB (offload) alike: offload saves 16.0 GB published and "
    "16.7 GiB planned, so the gap is not in the sharded terms; unexplained, needs a GPU measurement"
)


@dataclass(frozen=True)
class Point:
    name: str
    plan: Plan
    published_gib: float
    # "allocated" (torch max_memory_allocated: the tensor peak) | "reserved" (max_memory_reserved) | "device"
    # (nvidia-smi: the device total)
    figure: str
    source: str


POINTS = (
    Point("aai 7B QLoRA FSDP ctx512 bs1", AAI, 4.98, "reserved", AAI_SRC),
    Point("aai 7B QLoRA FSDP ctx2048 bs1", replace(AAI, seq_len=2048), 5.21, "reserved", AAI_SRC),
    # the one pair the source gives both ways: "the peak allocated memory is 8.28 GiB vs 9.16 GiB"
    Point("aai 7B LoRA FSDP ctx512 bs1 (allocated)", replace(AAI, tuning="lora"), 8.28, "allocated", AAI_SRC),
    Point(
        "aai 7B LoRA FSDP ctx2048 bs1 (allocated)",
        replace(AAI, tuning="lora", seq_len=2048),
        9.16,
        "allocated",
        AAI_SRC,
    ),
    Point("aai 7B LoRA FSDP ctx512 bs1", replace(AAI, tuning="lora"), 10.24, "reserved", AAI_SRC),
    Point(
        "aai 7B LoRA FSDP ctx2048 bs1", replace(AAI, tuning="lora", seq_len=2048), 10.22, "reserved", AAI_SRC
    ),
    Point(
        "aai 7B QLoRA FSDP ctx2048 bs4", replace(AAI, seq_len=2048, batch_size=4), 11.22, "reserved", AAI_SRC
    ),
    Point(
        "aai 7B QLoRA FSDP ctx2048 bs10",
        replace(AAI, seq_len=2048, batch_size=10),
        20.97,
        "reserved",
        AAI_SRC,
    ),
    Point(
        "aai 7B LoRA FSDP ctx2048 bs4",
        replace(AAI, tuning="lora", seq_len=2048, batch_size=4),
        16.14,
        "reserved",
        AAI_SRC,
    ),
    Point(
        "aai 7B LoRA FSDP ctx2048 bs6",
        replace(AAI, tuning="lora", seq_len=2048, batch_size=6),
        21.35,
        "reserved",
        AAI_SRC,
    ),
    Point(
        "aai 7B QLoRA DDP ctx2048 bs8",
        replace(AAI, seq_len=2048, batch_size=8, strategy="ddp"),
        20.94,
        "reserved",
        AAI_SRC,
    ),
    Point(
        "aai 7B LoRA DDP ctx2048 bs4",
        replace(AAI, tuning="lora", seq_len=2048, batch_size=4, strategy="ddp"),
        22.04,
        "reserved",
        AAI_SRC,
    ),
    Point(
        "aai 70B QLoRA FSDP offload ctx2048 bs2",
        replace(AAI, model="meta-llama/Llama-2-70b-hf", seq_len=2048, batch_size=2, cpu_offload=True),
        14.92,
        "reserved",
        AAI_SRC,
    ),
    Point(
        "aai Mistral-7B QLoRA FSDP offload ctx2048 bs12",
        replace(AAI, model="mistralai/Mistral-7B-v0.1", seq_len=2048, batch_size=12, cpu_offload=True),
        22.54,
        "reserved",
        AAI_SRC,
    ),
    Point(
        "aai Mistral-7B QLoRA FSDP offload ctx24576 bs1",
        replace(AAI, model="mistralai/Mistral-7B-v0.1", seq_len=24576, batch_size=1, cpu_offload=True),
        22.54,
        "reserved",
        AAI_SRC,
    ),
    Point("peft 70B QLoRA FSDP offload 2 GPUs", replace(PEFT, cpu_offload=True), 19.6, "device", PEFT_FSDP),
    Point("peft 70B QLoRA FSDP 2 GPUs", PEFT, 35.6, "device", PEFT_FSDP),
    Point(
        "peft 70B QLoRA ZeRO-3 2x40GB",
        replace(PEFT, strategy="deepspeed_zero3", gpu_gb=40.0),
        36.6,
        "device",
        PEFT_DS,
    ),
    Point(
        "peft 70B LoRA ZeRO-3 8xH100 bs8",
        replace(PEFT, tuning="lora", strategy="deepspeed_zero3", gpus=8, batch_size=8, gpu_gb=80.0),
        64.0,
        "device",
        PEFT_DS,
    ),
    Point(
        "peft 70B LoRA FSDP 8xH100 bs8 (72-80)",
        replace(PEFT, tuning="lora", gpus=8, batch_size=8, gpu_gb=80.0),
        76.0,
        "device",
        PEFT_FSDP,
    ),
    Point(
        "philschmid Llama-3-70B QLoRA FSDP offload 4xA10G",
        replace(
            PEFT,
            model="meta-llama/Llama-3.1-70B",
            lora_r=16,
            lora_alpha=8,
            lora_dropout=0.05,
            attn="sdpa",
            seq_len=3072,
            batch_size=1,
            gpus=4,
            cpu_offload=True,
        ),
        22.0,
        "device",
        PHIL_SRC,
    ),
)


# What the planner does not model, for the points it misses by more than the median goal (known or suspected)
LOADER = (
    'the source\'s own loader quantizes every weight on every GPU before moving it off ("reserved_after_model_wrap" '
    "3.72 GiB, about the whole 4-bit model, against 1.9 GiB of shards and constants planned) and the cache keeps "
    "those blocks: reserved never shrinks. Compared here without the planner's load moment (the whole 4-bit model "
    "per GPU, today's transformers path), which would give 3.60 GiB (-27.7%)"
)
WHY = {
    "aai 7B QLoRA FSDP ctx512 bs1": LOADER,
    "aai 7B QLoRA FSDP ctx2048 bs1": LOADER,
    "aai 7B LoRA FSDP ctx512 bs1": ALLOCATOR,
    "aai 7B QLoRA FSDP ctx2048 bs4": ALLOCATOR,
    "aai 7B QLoRA FSDP ctx2048 bs10": ALLOCATOR,
    "aai 7B LoRA FSDP ctx2048 bs6": ALLOCATOR,
    "aai 7B QLoRA DDP ctx2048 bs8": "FSDP NO_SHARD in the source, not DistributedDataParallel; " + ALLOCATOR,
    "aai 70B QLoRA FSDP offload ctx2048 bs2": OFFLOAD,
    "aai Mistral-7B QLoRA FSDP offload ctx2048 bs12": OFFLOAD,
    "aai Mistral-7B QLoRA FSDP offload ctx24576 bs1": OFFLOAD,
    "peft 70B QLoRA FSDP offload 2 GPUs": PEFT70,
    "peft 70B QLoRA FSDP 2 GPUs": PEFT70,
    "peft 70B LoRA FSDP 8xH100 bs8 (72-80)": "the source gives a range (72-80 GB over the run): -17.8% against 72",
    "philschmid Llama-3-70B QLoRA FSDP offload 4xA10G": OFFLOAD,
}


def planned_bytes(point: Point, est) -> int:
    if point.source in PER_WEIGHT_LOADERS and est.distributed:
        d = est.distributed
        return {
            "allocated": d["step_tensor_peak_bytes"],
            "reserved": d["step_reserved_peak_bytes"],
            "device": d["step_device_total_bytes"],
        }[point.figure]
    return {
        "allocated": est.tensor_peak_bytes,
        "reserved": est.reserved_peak_bytes,
        "device": est.device_total_bytes,
    }[point.figure]


def phase_of(point: Point, est) -> str:
    if point.source in PER_WEIGHT_LOADERS and est.distributed and est.peak_phase == "load":
        return max((p for p in est.phases if p != "load"), key=est.phases.get) + " (load left out)"
    return est.peak_phase


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--verbose", action="store_true", help="the components of each estimate")
    ap.add_argument("--quick", action="store_true", help="the first 3 points (goal not judged)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    print(f"{'point':<50} {'figure':<9} {'published':>10} {'planned':>9} {'err':>7}  strategy  phase")
    for p in POINTS[:3] if args.quick else POINTS:
        est = estimate(p.plan)
        planned = planned_bytes(p, est) / GiB
        err = planned / p.published_gib - 1
        rows.append(
            {
                "point": p.name,
                "figure": p.figure,
                "published_gib": p.published_gib,
                "planned_gib": round(planned, 3),
                "error": err,
                "strategy": est.distributed["strategy"],
                "peak_phase": phase_of(p, est),
                "source": p.source,
                "why": WHY.get(p.name, ""),
            }
        )
        print(
            f"{p.name:<50} {p.figure:<9} {p.published_gib:>9.2f}G {planned:>8.2f}G {err:>+7.1%}  "
            f"{est.distributed['strategy']:<9} {phase_of(p, est)}",
            flush=True,
        )
        if abs(err) > GOAL_MEDIAN and p.name in WHY:
            print(f"     why: {WHY[p.name]}")
        if args.verbose:
            parts = {k: f"{v / GiB:.2f}" for k, v in est.components.items() if v}
            print(f"     {parts}")
    errs = [abs(r["error"]) for r in rows]
    med, worst = statistics.median(errs), max(errs)
    under = sum(1 for r in rows if r["error"] < 0)
    print(
        f"\n{len(rows)} published points in {time.perf_counter() - t0:.0f} s; {under} planned below the published "
        "figure (an OOM the plan would not have warned of, if the card were that full)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    ok = med <= GOAL_MEDIAN and worst <= GOAL_WORST
    print(
        f"multi_gpu_published: median {med:.1%} worst {worst:.1%} "
        f"(goal median <={GOAL_MEDIAN:.0%}, worst <={GOAL_WORST:.0%}{'; --quick: not judged' if args.quick else ''})"
    )
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
