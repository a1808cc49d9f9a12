"""The GRPO demo: the demo's "Uppercase: hello" -> "HELLO" task learnt from a verifiable reward instead of from
answers. GRPO needs a model that is sometimes right (a group whose completions all score 0 has nothing to learn
from), so it starts from a warm start: the demo's SFT run stopped at the first step whose held-out exact match lies in
WARM_BAND and merged into the base. The band is measured, not a step count: the SFT curve is steep (at the demo's
learning rate 0% at step 3, ~95% at step 8; the warm-up runs at half of it), and where a fixed step lands depends on
the machine, its threads and CPU; GRPO needs room to gain. The reward is the exact-match preset against each prompt's `answer`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from core.demo.task import task_rows
from core.eval.rewards import heldout_scores  # noqa: F401 - the demo's before/after (core.demo.__main__)
from core.recipe.config import validate_config

TRAIN_FILE = "grpo_train.jsonl"
HELDOUT_FILE = "grpo_heldout.jsonl"
TRAIN_PROMPTS = 512
WARM_STEPS = 12  # the SFT warm-up's most steps, each saved and scored; the first inside WARM_BAND is taken
WARM_BAND = (0.15, 0.45)  # held-out exact match of the warm start: right sometimes, with room to gain
WARM_FOLDER = "grpo-base"
WARM_RECORD = "warm_start.json"  # in the warm start's folder: the step taken and its held-out exact match
REWARDS = [{"type": "match", "column": "answer"}]


def _prompt_row(question: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "answer": answer}


def write_grpo_data(out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """grpo_train.jsonl (prompts of the demo's training words) and grpo_heldout.jsonl (its held-out words)."""
    out = Path(out_dir)
    train, heldout = task_rows()
    paths = out / TRAIN_FILE, out / HELDOUT_FILE
    rows = (
        [
            _prompt_row(r["messages"][0]["content"], r["messages"][1]["content"])
            for r in train[:TRAIN_PROMPTS]
        ],
        [_prompt_row(r["question"], r["answer"]) for r in heldout],
    )
    for path, part in zip(paths, rows, strict=True):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
        os.replace(tmp, path)
    return paths


def ensure_grpo_data(out: str | os.PathLike) -> tuple[Path, Path]:
    out = Path(out)
    train, heldout = out / TRAIN_FILE, out / HELDOUT_FILE
    return (train, heldout) if train.is_file() and heldout.is_file() else write_grpo_data(out)


def warm_base(out: str | os.PathLike) -> Path:
    """The GRPO demo's start (DEMO/grpo-base): the demo base plus the SFT demo run's adapter at the first step whose
    held-out exact match is inside WARM_BAND (else the nearest to its middle, the latest on a tie), merged; where it
    landed is written beside it (WARM_RECORD). Made once; nothing is written under the final name until the merge is
    complete."""
    from core.demo.build import demo_config, heldout_accuracy, train_demo_run
    from core.merge.export import merge_at

    out = Path(out).resolve()
    folder = out / WARM_FOLDER
    if (folder / "config.json").is_file():
        return folder
    cfg = demo_config(out=out)
    cfg["data"]["eval_split"] = 0.0
    # half the demo's learning rate: the curve climbs over more steps, so that one of them lands in the band
    # (at the demo's own rate it went from 12% at step 3 to past the band at step 4 on one machine)
    cfg["training"].update(
        max_steps=WARM_STEPS,
        save_steps=1,
        save_total_limit=None,
        learning_rate=cfg["training"]["learning_rate"] / 2,
    )
    run_dir = train_demo_run(out, "grpo-warmup", validate_config(cfg))
    low, high = WARM_BAND
    scored = []
    for step in range(1, WARM_STEPS + 1):
        adapter = run_dir / "checkpoints" / f"checkpoint-{step}"
        scored.append((step, heldout_accuracy(out, adapter)))
        if low <= scored[-1][1] <= high:
            break
    # on a tie the most trained step: a weak base scores 0 at every step, and step 1 (lr 0 in warm-up) is the base
    step, exact = min(scored, key=lambda s: (not low <= s[1] <= high, abs(s[1] - (low + high) / 2), -s[0]))
    merge_at(out / "base", run_dir / "checkpoints" / f"checkpoint-{step}", folder, dtype="fp32")
    record = {"sft_step": step, "heldout_exact_match": exact, "band": list(WARM_BAND), "scored": scored}
    (folder / WARM_RECORD).write_text(json.dumps(record) + "\n", encoding="utf-8")
    return folder


def warm_start_line(folder: Path) -> str:
    """Where the warm start landed, for the demo's output ("" for one made before it was recorded)."""
    try:
        record = json.loads((folder / WARM_RECORD).read_text(encoding="utf-8"))
        step, exact, (low, high) = record["sft_step"], record["heldout_exact_match"], record["band"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f"grpo demo: warm start at SFT step {step}, held-out exact match {exact:.0%} (band {low:.0%}-{high:.0%})"


def grpo_demo_config(out: str | os.PathLike, model: str | os.PathLike) -> dict:
    """The demo's GRPO run on `model` (the warm start): 8 completions per prompt, scored by exact match."""
    out = Path(out).resolve()
    train, _ = ensure_grpo_data(out)
    return validate_config(
        {
            "method": "grpo",
            "model": {"path": str(Path(model).resolve()), "dtype": "auto"},
            "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
            "data": {"path": str(train), "format": "conversational", "eval_split": 0.0},
            "rewards": REWARDS,
            "training": {
                "per_device_train_batch_size": 16,  # two prompts' groups of 8 per step
                "gradient_accumulation_steps": 1,
                "num_generations": 8,
                "max_prompt_length": 32,
                "max_completion_length": 8,  # five letters and the end of the turn
                "temperature": 1.0,
                "gradient_checkpointing": False,
                "max_steps": 40,
                "learning_rate": 2e-3,  # a tiny LoRA model: TRL's 1e-6 would not move it
                "lr_scheduler_type": "constant",
                "logging_steps": 5,
                "save_steps": 20,
                "save_total_limit": 2,
                "seed": 42,
            },
        }
    )
