"""What the trainer reports while it trains: the stop flag a signal sets, and the TrainerCallback that writes
metrics.jsonl and status.json and turns a stop signal or a NaN loss into a clean end."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import statistics
import time
from pathlib import Path

from core import rundir
from core.files import atomic_write_text
from core.recipe import distributed
from core.recipe.config import config_to_yaml
from core.recipe.config_keys import SAMPLES_EXTRA_TOKENS, SAMPLES_MAX_TOKENS
from core.rundir import RANK_MEMORY, write_status
from core.train import ranks

METRIC_KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm")


class StopFlag:
    """Set by SIGTERM/SIGINT; checked at the end of each step (a signal handler must not save by itself)."""

    def __init__(self):
        self.signal: str | None = None

    def install(self):
        def handler(signum, _frame):
            self.signal = signal.Signals(signum).name

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        return self


def _callback_class():
    from transformers import TrainerCallback

    class RunCallback(TrainerCallback):
        """Writes metrics.jsonl and status.json; turns a stop signal or a NaN loss into a clean end."""

        def __init__(
            self,
            run_dir: Path,
            stop: StopFlag,
            smoke: bool,
            device: str,
            samples_per_step: int,
            identity=None,
            config: dict | None = None,
        ):
            self.run_dir, self.stop, self.smoke, self.device = run_dir, stop, smoke, device
            self.samples_per_step = samples_per_step
            # the run folder this trainer owns: deleted or replaced under it, the run stops writing (`gone`)
            self.identity = identity or rundir.folder_identity(run_dir)
            self.gone: str | None = None
            self._config_text = config_to_yaml(config) if config is not None else None
            self.nan_step: int | None = None
            self.stopped_at: int | None = None
            self.disk_full: str | None = None  # why training stopped before a checkpoint that could not fit
            self.step_seconds: list[float] = []
            # several processes: rank 0 alone writes the run's files; every rank agrees on when to stop
            self.main, self.world = ranks.is_main(), ranks.world()
            # A smoke test writes no metrics: its one step is not a training curve.
            writes = self.main and not smoke
            self._fh = open(run_dir / rundir.METRICS, "a", encoding="utf-8") if writes else None  # noqa: SIM115
            import psutil

            self._proc = psutil.Process()
            self._last_t = time.time()
            self._last_tokens = 0.0
            self._last_step = 0
            self._step_t0 = 0.0
            self._status_t = 0.0

        def close(self):
            if self._fh is not None:
                self._fh.close()

        def _status(self, **fields):
            if self.main and not self._check_folder(None):  # a stat per write (at most a few a second)
                try:
                    write_status(self.run_dir, **fields)
                except FileNotFoundError:  # deleted between the check and the write
                    self._check_folder(None)

        def _check_folder(self, control) -> bool:
            """True (and training told to stop, saving nothing) once the run folder is gone or another one."""
            if self.gone is None:
                now = rundir.folder_identity(self.run_dir)
                if now != self.identity:
                    what = "was deleted" if now is None else "was replaced by another folder"
                    self.gone = (
                        f"the run folder {self.run_dir} {what} while the run trained; stopped without saving "
                        "or re-creating anything."
                    )
            if self.gone is not None and control is not None:
                control.should_training_stop = True
                control.should_save = control.should_evaluate = control.should_log = False
            return self.gone is not None

        def on_train_begin(self, args, state, control, **kw):
            self._last_t, self._last_step = time.time(), state.global_step
            if self._check_folder(control):
                return
            self._status(
                state="running",
                step=state.global_step,
                max_steps=state.max_steps,
                phase="first step",  # until the first point is logged
                phase_started=time.time(),
            )
            (stop,) = ranks.agree(args.device, bool(self.stop.signal))
            if stop:  # signalled while loading: stop before the first step (every rank)
                self.stop.signal = self.stop.signal or "SIGTERM"
                control.should_training_stop = True

        def on_step_begin(self, args, state, control, **kw):
            self._step_t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_seconds.append(time.perf_counter() - self._step_t0)
            gone, stop = ranks.agree(args.device, self._check_folder(None), bool(self.stop.signal))
            if gone:  # before the Trainer logs or saves into it (seen by this rank or another)
                self.gone = (
                    self.gone
                    or f"the run folder {self.run_dir} was deleted or replaced while the run trained"
                )
                self._check_folder(control)
                return
            if stop and self.stopped_at is None:
                self.stopped_at = state.global_step
                self.stop.signal = self.stop.signal or "SIGTERM"  # another rank's: the run stops as one
                control.should_training_stop = True
                control.should_save = not self.smoke
            if control.should_save and not self.smoke:  # the same on every rank: the step and the agreed stop
                problem = self._space_problem(state.global_step, kw.get("model"), kw.get("optimizer"))
                (full,) = ranks.agree(args.device, problem is not None)
                if full:
                    control.should_save = False
                    control.should_training_stop = True
                    self.disk_full = problem or "disk full: rank 0 found no room for the next checkpoint"
            now = time.time()
            if now - self._status_t > 1.0:  # at most one status write a second keeps the overhead invisible
                self._status_t = now
                # the usual step time: a reader tells a stalled run by it (core.rundir.stall)
                step_s = statistics.median(self.step_seconds[-20:])
                self._status(step=state.global_step, step_s=round(step_s, 4))

        def _space_problem(self, step: int, model, optimizer) -> str | None:
            """A checkpoint that cannot fit is not started (a half-written one is worth nothing and fills the disk
            others use too): training stops, and the run fails with "disk full" and the figures. Rank 0 decides
            (the ranks share the run directory)."""
            if not self.main:
                return None
            need = checkpoint_bytes(model, optimizer, rundir.latest_checkpoint(self.run_dir))
            free = _free_bytes(self.run_dir)
            if need is None or free is None or free >= need:
                return None
            last = rundir.latest_checkpoint(self.run_dir)
            return (
                f"disk full: checkpoint-{step} needs about {_mib(need)} and the disk that holds {self.run_dir} has "
                f"{_mib(free)} free, so training stopped before writing it (newest checkpoint: "
                f"{last.name if last else 'none yet'}). Free space there (or move the run to a larger disk), then "
                "resume the run."
            )

        def on_prediction_step(self, args, state, control, **kw):
            now = time.time()
            if now - self._status_t > 1.0:  # evaluating is not stalling: keep status.json's heartbeat
                self._status_t = now
                self._status()

        def on_save(self, args, state, control, **kw):
            self._last_t = time.time()  # checkpoint writing is not training time: keep it out of tokens/s
            saved = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if self.main and self._config_text and saved.is_dir() and not self._check_folder(control):
                # the config that trained it, beside its weights: what a resume compares with (core.train.resume)
                atomic_write_text(saved / rundir.CHECKPOINT_CONFIG, self._config_text, parents=False)

        def on_evaluate(self, args, state, control, **kw):
            self._last_t = time.time()  # likewise evaluation

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if not any(k in logs for k in METRIC_KEYS):
                return  # the end-of-training summary (train_runtime, ...) is not a metric line
            # every rank's memory, gathered on every rank (a collective: before anything one rank alone decides)
            memory = {**cuda_memory(), "rss_bytes": self._proc.memory_info().rss}
            per_rank = ranks.gather(args.device, [float(memory.get(k, math.nan)) for k in RANK_MEMORY])
            if self._check_folder(control) or not self.main:
                return
            now = time.time()
            rec = {"time": now, "step": state.global_step, "epoch": float(state.epoch or 0.0)}
            # every number the trainer logs: loss, learning rate, grad norm and TRL's own (mean_token_accuracy,
            # entropy, num_tokens, their eval_ twins); the end-of-run summary was filtered out above
            for key, value in logs.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in rec:
                    rec[key] = float(value)
            if "loss" in logs:
                dt = max(now - self._last_t, 1e-9)
                tokens = float(logs.get("num_tokens", self._last_tokens))
                rec["tokens_per_s"] = max(0.0, tokens - self._last_tokens) / dt
                rec["samples_per_s"] = (state.global_step - self._last_step) * self.samples_per_step / dt
                self._last_t, self._last_tokens, self._last_step = now, tokens, state.global_step
            rec.update(memory)  # rss_bytes, the CPU memory: the curve a run without a GPU has
            for k, values in enumerate((per_rank or [])[1:], start=1):  # rank 0's are the plain names
                pairs = zip(RANK_MEMORY, values, strict=True)
                rec.update({f"rank{k}_{n}": v for n, v in pairs if math.isfinite(v)})
            # json.dumps writes NaN for a NaN loss: the file stays readable by Python's json and the UI sees it.
            if self._fh is not None:
                self._fh.write(json.dumps(rec) + "\n")
                self._fh.flush()
            loss = logs.get("loss")
            if loss is not None and not math.isfinite(loss) and self.nan_step is None:
                self.nan_step = state.global_step
                control.should_training_stop = True
                control.should_save = False  # a NaN checkpoint is worthless
            self._status(step=state.global_step, phase=None, phase_started=None)

    return RunCallback


CHECKPOINT_MARGIN = 1.1  # a checkpoint holds small files too (trainer state, RNG, scheduler, tokenizer)


def checkpoint_bytes(model, optimizer, previous=None) -> int | None:
    """What the next checkpoint will take on disk, at least: the trainable weights (the adapter, or the model for a
    full fine-tune) and the optimizer's state, or the previous checkpoint's size when that is larger; None when
    neither can be told."""
    need = 0
    try:
        if model is not None:
            need += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        state = getattr(optimizer, "state", None) or {}
        for per_param in state.values():
            for t in per_param.values() if isinstance(per_param, dict) else ():
                if hasattr(t, "numel") and hasattr(t, "element_size"):
                    need += t.numel() * t.element_size()
    except Exception:  # an unusual model or optimizer: no estimate, no check
        need = 0
    if previous is not None:
        with contextlib.suppress(OSError):
            need = max(need, sum(f.stat().st_size for f in Path(previous).rglob("*") if f.is_file()))
    return int(need * CHECKPOINT_MARGIN) + (1 << 20) if need else None


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _mib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def cuda_memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {
        "cuda_allocated": torch.cuda.memory_allocated(),
        "cuda_reserved": torch.cuda.memory_reserved(),
        "cuda_peak": torch.cuda.max_memory_allocated(),
    }


def make_run_callback(
    run_dir: Path,
    stop: StopFlag,
    smoke: bool,
    device: str,
    samples_per_step: int,
    identity=None,
    config: dict | None = None,
):
    """The run's TrainerCallback (its class is made on first use: transformers is imported only then). identity:
    the run folder's (core.rundir.folder_identity) as the trainer found it; config: the run's config, kept in
    each checkpoint it saves."""
    return _callback_class()(run_dir, stop, smoke, device, samples_per_step, identity, config)


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
        "best_step": rundir.checkpoint_step(Path(best)) if best else None,
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
