"""The GRPO demo: the demo's "Uppercase: hello" -> "HELLO" task learnt from a verifiable reward instead of from
answers. GRPO needs a model that is sometimes right (a group whose completions all score 0 has nothing to learn
from), so it starts from a warm start: the demo's SFT run stopped after a few steps and merged into the base,
right on about half of the held-out words. The reward is the exact-match preset against each prompt's `answer`.
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
WARM_STEPS = 5  # the SFT demo run's first steps: a quarter of the held-out words right (0% at 3, ~95% at 8)
WARM_FOLDER = "grpo-base"
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
    """The GRPO demo's start (DEMO/grpo-base): the demo base after WARM_STEPS steps of the SFT demo run, merged.
    Made once; None of it is written under the final name until the merge is complete."""
    from core.demo.build import demo_config, train_demo_run
    from core.merge.export import merge_at

    out = Path(out).resolve()
    folder = out / WARM_FOLDER
    if (folder / "config.json").is_file():
        return folder
    cfg = demo_config(out=out)
    cfg["data"]["eval_split"] = 0.0
    cfg["training"].update(max_steps=WARM_STEPS, save_steps=1000)
    run_dir = train_demo_run(out, "grpo-warmup", validate_config(cfg))
    merge_at(out / "base", run_dir / "adapter", folder, dtype="fp32")
    return folder


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
