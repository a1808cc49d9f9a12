"""The trainer's evaluation callbacks: transformers' early stopping (and what it tells about a run's end) and the
samples callback (greedy answers to held-out prompts at each evaluation). The run's own (metrics, status, the
stops and guards) are core.train.run_callbacks'."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from core import checkpoints, rundir
from core.recipe import distributed
from core.recipe.config_keys import SAMPLES_EXTRA_TOKENS, SAMPLES_MAX_TOKENS
from core.train import ranks


def early_stopping_callbacks(cfg: dict, eval_ds, smoke: bool) -> list:
    """[transformers' EarlyStoppingCallback] when training.early_stopping_patience asks for it, else []."""
    patience = cfg["training"].get("early_stopping_patience")
    if smoke or not patience or eval_ds is None:
        return []
    from transformers import EarlyStoppingCallback

    return [EarlyStoppingCallback(patience, cfg["training"].get("early_stopping_threshold", 0.0))]


def early_stop(trainer) -> dict | None:
    """{"step", "best_step", "metric", "best", "patience"} when early stopping ended the run, else None."""
    from transformers import EarlyStoppingCallback

    es = next((c for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)), None)
    state = trainer.state
    if es is None or es.early_stopping_patience_counter < es.early_stopping_patience:
        return None
    if state.max_steps and state.global_step >= state.max_steps:
        return None  # it ran to the end anyway
    best = state.best_model_checkpoint
    return {
        "step": state.global_step,
        "best_step": checkpoints.checkpoint_step(Path(best)) if best else None,
        "metric": trainer.args.metric_for_best_model,
        "best": state.best_metric,
        "patience": es.early_stopping_patience,
    }


def early_stop_sentence(early: dict) -> str:
    best = f" ({early['metric']} {early['best']:.4g})" if isinstance(early.get("best"), (int, float)) else ""
    kept = (
        f"the adapter is the best checkpoint, step {early['best_step']}{best}"
        if early.get("best_step")
        else ""
    )
    return (
        f"stopped early at step {early['step']}: {early['metric']} did not improve for {early['patience']} "
        f"evaluations" + (f"; {kept}" if kept else "")
    )


def samples_callbacks(cfg: dict, run_dir: Path, tokenizer, eval_ds, smoke: bool) -> list:
    """[the samples callback] when training.eval_samples asks for it and the run holds rows out, else []: at each
    evaluation, greedy answers to the first eval_samples held-out prompts go to <run>/samples.jsonl, one line
    each {"step", "time", "i", "prompt", "reference", "answer"}. A smoke test's asks the longest a run can: as
    many prompts at once as a run's, each as long as a prompt can be, answered with SAMPLES_MAX_TOKENS tokens
    (what the plan's evaluation phase holds), and writes nothing."""
    n = int(cfg["training"].get("eval_samples") or 0)
    handed = ranks.spec() or {}
    if n <= 0 or eval_ds is None or handed.get("strategy") in distributed.SHARDED:
        return []  # sharded weights: rank 0 alone cannot generate (every rank takes part in each forward)
    from core.generate import GREEDY_BATCH, pad_id
    from core.recipe import methods

    method = methods.get(cfg)
    rows = method.sample_rows(eval_ds, tokenizer, n)
    if not rows:
        return []
    if smoke:
        prompt = method.prompt_length(cfg)
        ids = rows[0]["prompt_ids"][-prompt:]
        filled = {**rows[0], "prompt_ids": [pad_id(tokenizer)] * (prompt - len(ids)) + list(ids)}
        callback = _samples_class()(None, [filled] * min(n, GREEDY_BATCH), tokenizer, SAMPLES_MAX_TOKENS)
        callback.min_new_tokens = SAMPLES_MAX_TOKENS
        return [callback]
    longest = max(len(tokenizer(r["reference"], add_special_tokens=False)["input_ids"]) for r in rows)
    new_tokens = min(SAMPLES_MAX_TOKENS, longest + SAMPLES_EXTRA_TOKENS)
    return [_samples_class()(run_dir / rundir.SAMPLES, rows, tokenizer, new_tokens)]


def _samples_class():
    from transformers import TrainerCallback

    class SamplesCallback(TrainerCallback):
        """Greedy answers to fixed held-out prompts at each evaluation (core.generate, batched)."""

        def __init__(self, path: Path | None, rows: list[dict], tokenizer, max_new_tokens: int):
            self.path, self.rows, self.tokenizer, self.max_new_tokens = path, rows, tokenizer, max_new_tokens
            self.min_new_tokens = 0

        def on_evaluate(self, args, state, control, model=None, **kw):
            if model is None or not state.is_world_process_zero:
                return
            from core.generate import greedy

            prompts = [r["prompt_ids"] for r in self.rows]
            said = greedy(
                model, self.tokenizer, prompts, self.max_new_tokens, min_new_tokens=self.min_new_tokens
            )
            if self.path is None:  # a smoke test's: measured, not kept
                return
            now = time.time()
            lines = [
                json.dumps(
                    {
                        "step": state.global_step,
                        "time": now,
                        "i": i,
                        "prompt": r["prompt"],
                        "reference": r["reference"],
                        "answer": a,
                    }
                )
                for i, (r, a) in enumerate(zip(self.rows, said, strict=True))
            ]
            with contextlib.suppress(OSError), open(self.path, "a", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")

    return SamplesCallback
