"""The evaluation phase of the memory bill against real evaluations: the planner's eval phase next to the smoke
test's own measurement of one Trainer.evaluate on the CPU, for SFT, DPO, KTO and GRPO and shapes that move each
eval term (issue #37 item 4).

Measured: `python -m core.train CFG --run-dir DIR --smoke` (what the Train page's smoke test runs) on a tiny Llama
wide enough for its activations to count (hidden 128, MLP 256, 2 layers, the demo's character tokenizer): one
training step, then one evaluation of one eval batch of held-out rows (the method's smallest: SFT and DPO 1
example, KTO 2, GRPO one prompt's group), filled to max_length like the step's. The tracker counts live tensor
bytes in the eval phase (Trainer.evaluate, marked by the smoke test), with the samples callback's greedy answers
(eval:callbacks: as many prompts as a run answers at once, each as long as a prompt can be, 128 new tokens) and
GRPO's generation of its eval batch (eval:generation) as sub-phases. Planned: the plan.json the trainer wrote for
the same step (its `phases.eval` and `evaluation.moments`). Goal: every figure within 5%.

    python benchmarks/eval_accuracy.py               # every shape (~5 min on 2 idle cores)
    python benchmarks/eval_accuracy.py --only 0,3    # some shapes (goal still judged on those)
    python benchmarks/eval_accuracy.py --quick       # shape 0 (what the suite runs)

`--quick`: the first shape only (SFT with sample answers), to show the script still runs: headline printed, exit 0
even on a goal miss, non-zero on an error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GOAL = 0.05
GENERATION_MOMENTS = ("prefill", "generate", "logprob forward", "vllm")

# name -> (method, lora, dtype, training keys)
SHAPES = {
    "SFT LoRA fp32, 8 sample answers": ("sft", True, "float32", {"max_length": 96, "eval_samples": 8}),
    # 32 prompts answered at once (core.generate's batch): their KV cache and prefill outgrow the step
    "SFT LoRA fp32, 32 sample answers (the peak)": (
        "sft",
        True,
        "float32",
        {"max_length": 128, "eval_samples": 32},
    ),
    "SFT LoRA bf16, max_length 192": ("sft", True, "bfloat16", {"max_length": 192}),
    "SFT full fp32": ("sft", False, "float32", {"max_length": 96}),
    "DPO LoRA fp32 (reference: adapter off)": ("dpo", True, "float32", {"max_length": 96}),
    "DPO full fp32 (reference: frozen copy)": ("dpo", False, "float32", {"max_length": 96}),
    # KTOTrainer estimates its KL term from a batch's other rows: two at least
    "KTO LoRA fp32 (KL twins)": (
        "kto",
        True,
        "float32",
        {"max_length": 96, "per_device_train_batch_size": 2},
    ),
    "GRPO LoRA fp32, completion 128, 8 sample answers": (
        "grpo",
        True,
        "float32",
        {"num_generations": 4, "max_prompt_length": 16, "max_completion_length": 128, "eval_samples": 8},
    ),
}


def rows(method: str) -> list[dict]:
    if method == "sft":
        return [{"instruction": f"Add one to {i}", "output": f"{i + 1}"} for i in range(40)]
    if method == "dpo":
        return [
            {"prompt": f"Add one to {i}", "chosen": f"{i + 1}", "rejected": f"{i + 2}"} for i in range(40)
        ]
    if method == "kto":
        return [
            {"prompt": f"Add one to {i}", "completion": f"{i + 1}", "label": i % 2 == 0} for i in range(40)
        ]
    letters = "abcdefghij" * 3  # GRPO: prompts of exactly 16 tokens (one per character)
    return [{"prompt": letters[i % 7 : i % 7 + 16], "answer": "x"} for i in range(40)]


def config(model: Path, data: Path, shape) -> dict:
    method, lora, dtype, training = shape
    cfg = {
        "method": method,
        "model": {"path": str(model), "dtype": dtype},
        "lora": {
            "enabled": lora,
            "r": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "target_modules": "all-linear",
        },
        "data": {"path": str(data), "eval_split": 0.25},
        "training": {"per_device_train_batch_size": 1, "max_steps": 1, **training},
    }
    if method == "grpo":
        cfg["data"]["format"] = "standard"
        cfg["rewards"] = [{"type": "match", "column": "answer"}]
        cfg["training"]["per_device_train_batch_size"] = training["num_generations"]
    return cfg


def smoke(cfg: dict, folder: Path) -> tuple[dict, dict]:
    """(smoke.json, plan.json) of one smoke test run as the Train page runs it."""
    import yaml

    folder.mkdir(parents=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = folder / "run"
    cmd = [sys.executable, "-m", "core.train", str(path), "--run-dir", str(run), "--smoke"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"smoke test failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return json.loads((run / "smoke.json").read_text()), json.loads((run / "plan.json").read_text())


def compared(smoke_json: dict, plan: dict) -> list[tuple[str, int, int]]:
    """(figure, measured, planned): the eval phase, and each sub-phase the shape has."""
    out = [("eval phase", smoke_json["eval_peak_bytes"], plan["phases"]["eval"])]
    moments = plan["evaluation"]["moments"]
    for sub, measured in sorted((smoke_json.get("eval_moments") or {}).items()):
        # eval:callbacks is the samples callback's answers; without any, the callbacks' few bytes are not planned
        names = (
            GENERATION_MOMENTS
            if sub == "eval:generation"
            else [k for k in moments if k.startswith("samples")]
        )
        planned = [moments[k] for k in names if k in moments]
        if planned:
            out.append((sub, measured, max(planned)))
    return out


def measured(out: Path, only: list[int] | None) -> list[dict]:
    from core.demo.toy import build_tiny_model

    model = build_tiny_model(out / "model", "llama", hidden_size=128, intermediate_size=256)
    results = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        if only is not None and i not in only:
            continue
        data = out / f"data{i}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows(shape[0])))
        t0 = time.perf_counter()
        result, plan = smoke(config(model, data, shape), out / f"shape{i}")
        # the run's peak: the evaluation when it holds more than the training step (smoke.json keeps them apart)
        peak = "eval" if result["eval_peak_bytes"] > result["peak_bytes"] else result["peak_phase"]
        for figure, got, want in compared(result, plan):
            row = {
                "shape": name,
                "figure": figure,
                "measured": got,
                "planned": want,
                "ratio": want / got,
                "peak_phase": (peak, plan["peak_phase"]),
                "eval_moment": plan["evaluation"]["moment"],
                "eval_batch": plan["evaluation"]["rows"],
                "seconds": round(time.perf_counter() - t0, 1),
            }
            results.append(row)
            print(
                f"{name:<48} {figure:<16} measured {got:>11,}  planned {want:>11,}  ratio {row['ratio']:.4f} "
                f"({row['ratio'] - 1:+.2%})  [peak {peak}/{plan['peak_phase']}; eval batch {row['eval_batch']}, "
                f"its {row['eval_moment']}]",
                flush=True,
            )
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated shape numbers (0-based)")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--quick", action="store_true", help="the first shape only (goal not judged)")
    args = ap.parse_args(argv)
    only = [0] if args.quick else [int(x) for x in args.only.split(",")] if args.only else None
    with tempfile.TemporaryDirectory(prefix="eval-acc-") as tmp:
        results = measured(Path(tmp), only)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    worst = max(abs(r["ratio"] - 1) for r in results)
    shapes = len({r["shape"] for r in results})
    named = all(r["peak_phase"][0] == r["peak_phase"][1] for r in results)
    print(
        f"eval_accuracy: worst {worst:.2%} over {shapes} shapes, {len(results)} figures (the eval phase, the "
        f"samples' answers, GRPO's eval generation), peak phase {'named alike' if named else 'MISNAMED'} "
        f"(goal <= {GOAL:.0%}, named alike{'; --quick: not judged' if args.quick else ''})"
    )
    return 0 if (worst <= GOAL and named) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
