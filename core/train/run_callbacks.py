"""What the trainer reports while it trains, one TrainerCallback per concern, each writing what it finds into the
run's RunOutcome (core.train.state): the folder guard (the run folder deleted or replaced under it), the metrics
(metrics.jsonl, step times, tokens), the heartbeat (status.json), the NaN stop, the cross-rank stop (a signal on
any rank stops every rank at one step), the disk guard (a checkpoint that cannot fit is not started) and the
config copy (each checkpoint keeps the config that trained it).

Each concern is a plain class here; its TrainerCallback subclass is made on first use (_callback_class), so that
importing this module imports no transformers. run_callbacks() makes the set in the order they must run."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import statistics
import time
from pathlib import Path

from core import checkpoints, rundir
from core.files import atomic_write_text
from core.recipe.config import config_to_yaml
from core.rundir import RANK_MEMORY, write_status
from core.train import ranks
from core.train.folder_guard import FolderGuard
from core.train.state import Run, RunOutcome, StopFlag

METRIC_KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm")


class Metrics:
    """metrics.jsonl (rank 0, not in a smoke test: its one step is no training curve): one flushed line per log
    with every number the trainer logs, tokens/s and samples/s over training time alone, and every rank's memory.
    Records each step's time (outcome.step_seconds) and the tokens trained on (outcome.tokens)."""

    def __init__(self, guard: FolderGuard, outcome: RunOutcome, smoke: bool, samples_per_step: int):
        import psutil

        self.guard, self.outcome, self.samples_per_step = guard, outcome, samples_per_step
        self.main = ranks.is_main()
        path = guard.run_dir / rundir.METRICS
        self._fh = open(path, "a", encoding="utf-8") if self.main and not smoke else None  # noqa: SIM115
        self._proc = psutil.Process()
        self._last_t, self._last_step, self._step_t0 = time.time(), 0, 0.0

    def close(self):
        if self._fh is not None:
            self._fh.close()

    def on_train_begin(self, args, state, control, **kw):
        self._last_t, self._last_step = time.time(), state.global_step

    def on_step_begin(self, args, state, control, **kw):
        self._step_t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.outcome.step_seconds.append(time.perf_counter() - self._step_t0)

    def on_save(self, args, state, control, **kw):
        self._last_t = time.time()  # checkpoint writing is not training time: keep it out of tokens/s

    def on_evaluate(self, args, state, control, **kw):
        self._last_t = time.time()  # likewise evaluation

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        if not any(k in logs for k in METRIC_KEYS):
            return  # the end-of-training summary (train_runtime, ...) is not a metric line
        # every rank's memory, gathered on every rank (a collective: before anything one rank alone decides)
        memory = {**cuda_memory(), "rss_bytes": self._proc.memory_info().rss}
        per_rank = ranks.gather(args.device, [float(memory.get(k, math.nan)) for k in RANK_MEMORY])
        if self.guard.check(control) or not self.main:
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
            tokens = float(logs.get("num_tokens", self.outcome.tokens))
            rec["tokens_per_s"] = max(0.0, tokens - self.outcome.tokens) / dt
            rec["samples_per_s"] = (state.global_step - self._last_step) * self.samples_per_step / dt
            self._last_t, self.outcome.tokens, self._last_step = now, tokens, state.global_step
        rec.update(memory)  # rss_bytes, the CPU memory: the curve a run without a GPU has
        for k, values in enumerate((per_rank or [])[1:], start=1):  # rank 0's are the plain names
            pairs = zip(RANK_MEMORY, values, strict=True)
            rec.update({f"rank{k}_{n}": v for n, v in pairs if math.isfinite(v)})
        # json.dumps writes NaN for a NaN loss: the file stays readable by Python's json and the UI sees it.
        if self._fh is not None:
            self._fh.write(json.dumps(rec) + "\n")
            self._fh.flush()


class Heartbeat:
    """status.json while training (rank 0, never into a folder that is gone): "running" at the start, the step and
    the usual step time at most once a second (a reader tells a stalled run by it: core.rundir.stall), a beat while
    evaluating (evaluating is not stalling), the step at each log."""

    def __init__(self, guard: FolderGuard, outcome: RunOutcome):
        self.guard, self.outcome = guard, outcome
        self.main = ranks.is_main()
        self._status_t = 0.0

    def write(self, **fields):
        if self.main and not self.guard.check():  # a stat per write (at most a few a second)
            try:
                write_status(self.guard.run_dir, **fields)
            except FileNotFoundError:  # deleted between the check and the write
                self.guard.check()

    def on_train_begin(self, args, state, control, **kw):
        self.write(
            state="running",
            step=state.global_step,
            max_steps=state.max_steps,
            phase="first step",  # until the first point is logged
            phase_started=time.time(),
        )

    def on_step_end(self, args, state, control, **kw):
        now = time.time()
        if now - self._status_t > 1.0:  # at most one status write a second keeps the overhead invisible
            self._status_t = now
            step_s = statistics.median(self.outcome.step_seconds[-20:])  # the usual step time
            self.write(step=state.global_step, step_s=round(step_s, 4))

    def on_prediction_step(self, args, state, control, **kw):
        now = time.time()
        if now - self._status_t > 1.0:  # evaluating is not stalling: keep status.json's heartbeat
            self._status_t = now
            self.write()

    def on_log(self, args, state, control, logs=None, **kw):
        if any(k in (logs or {}) for k in METRIC_KEYS):
            self.write(step=state.global_step, phase=None, phase_started=None)


class NanStop:
    """A logged loss that is NaN or infinite ends training at once, saving nothing (a NaN checkpoint is
    worthless): outcome.nan_step. Rank 0 decides, as it writes the metrics line that shows it."""

    def __init__(self, outcome: RunOutcome):
        self.outcome, self.main = outcome, ranks.is_main()

    def on_log(self, args, state, control, logs=None, **kw):
        loss = (logs or {}).get("loss")
        if not self.main or self.outcome.gone is not None or self.outcome.nan_step is not None:
            return
        if loss is not None and not math.isfinite(loss):
            self.outcome.nan_step = state.global_step
            control.should_training_stop = True
            control.should_save = False


class CrossRankStop:
    """The run stops as one: a stop signal (StopFlag) or the folder's loss seen by any rank stops every rank at the
    same step (core.train.ranks.agree, one collective a step). A signal saves a checkpoint where it stops
    (outcome.stopped_at); one that came while loading stops before the first step."""

    def __init__(self, stop: StopFlag, guard: FolderGuard, smoke: bool):
        self.stop, self.guard, self.smoke = stop, guard, smoke

    def on_train_begin(self, args, state, control, **kw):
        if self.guard.outcome.gone is not None:
            return
        (stop,) = ranks.agree(args.device, bool(self.stop.signal))
        if stop:  # signalled while loading: stop before the first step (every rank)
            self.stop.signal = self.stop.signal or "SIGTERM"
            control.should_training_stop = True

    def on_step_end(self, args, state, control, **kw):
        outcome = self.guard.outcome
        gone, stop = ranks.agree(args.device, self.guard.check(), bool(self.stop.signal))
        if gone:  # before the Trainer logs or saves into it (seen by this rank or another)
            outcome.gone = (
                outcome.gone
                or f"the run folder {self.guard.run_dir} was deleted or replaced while the run trained"
            )
            self.guard.check(control)
            return
        if stop and outcome.stopped_at is None:
            outcome.stopped_at = state.global_step
            self.stop.signal = self.stop.signal or "SIGTERM"  # another rank's: the run stops as one
            control.should_training_stop = True
            control.should_save = not self.smoke


class DiskGuard:
    """A checkpoint that cannot fit is not started (a half-written one is worth nothing and fills the disk others
    use too): training stops and outcome.disk_full says why, with the figures. Rank 0 decides (the ranks share the
    run directory); every rank agrees."""

    def __init__(self, run_dir: Path, outcome: RunOutcome, smoke: bool):
        self.run_dir, self.outcome, self.smoke = run_dir, outcome, smoke
        self.main = ranks.is_main()

    def on_step_end(self, args, state, control, **kw):
        if not control.should_save or self.smoke:  # the same on every rank: the step and the agreed stop
            return
        problem = self.space_problem(state.global_step, kw.get("model"), kw.get("optimizer"))
        (full,) = ranks.agree(args.device, problem is not None)
        if full:
            control.should_save = False
            control.should_training_stop = True
            self.outcome.disk_full = problem or "disk full: rank 0 found no room for the next checkpoint"

    def space_problem(self, step: int, model, optimizer) -> str | None:
        """Why checkpoint-<step> cannot fit on the run folder's disk, or None (it can, or this is not rank 0)."""
        if not self.main:
            return None
        need = checkpoint_bytes(model, optimizer, checkpoints.latest_checkpoint(self.run_dir))
        free = _free_bytes(self.run_dir)
        if need is None or free is None or free >= need:
            return None
        last = checkpoints.latest_checkpoint(self.run_dir)
        return (
            f"disk full: checkpoint-{step} needs about {_mib(need)} and the disk that holds {self.run_dir} has "
            f"{_mib(free)} free, so training stopped before writing it (newest checkpoint: "
            f"{last.name if last else 'none yet'}). Free space there (or move the run to a larger disk), then "
            "resume the run."
        )


class ConfigCopy:
    """Each checkpoint keeps the config that trained it beside its weights (checkpoints.CHECKPOINT_CONFIG): what a
    resume compares with (core.train.resume). Rank 0, never into a folder that is gone."""

    def __init__(self, guard: FolderGuard, config: dict | None):
        self.guard, self.main = guard, ranks.is_main()
        self._text = config_to_yaml(config) if config is not None else None

    def on_save(self, args, state, control, **kw):
        saved = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.main and self._text and saved.is_dir() and not self.guard.check(control):
            atomic_write_text(saved / checkpoints.CHECKPOINT_CONFIG, self._text, parents=False)


@functools.cache
def _callback_class(concern: type) -> type:
    """concern as a transformers TrainerCallback (its events; the others TrainerCallback's no-ops)."""
    from transformers import TrainerCallback

    return type(
        concern.__name__, (concern, TrainerCallback), {"__module__": __name__, "__doc__": concern.__doc__}
    )


def make(concern: type, *args, **kwargs):
    """An instance of concern's TrainerCallback (transformers is imported on the first one)."""
    return _callback_class(concern)(*args, **kwargs)


def run_callbacks(run: Run, outcome: RunOutcome, samples_per_step: int, config: dict | None = None):
    """(the folder guard, the run's callbacks in the order they run) writing into outcome. Metrics first (a
    step's time ends where its callbacks begin), the heartbeat before the stops (status says "running" before a
    stop signalled while loading is agreed), the NaN stop after the metrics line that shows it, the disk guard
    after the cross-rank stop (whose stop saves a checkpoint). config: what each checkpoint keeps."""
    guard = make(FolderGuard, run.run_dir, outcome, run.identity)
    return guard, [
        guard,
        make(Metrics, guard, outcome, run.smoke, samples_per_step),
        make(Heartbeat, guard, outcome),
        make(NanStop, outcome),
        make(CrossRankStop, run.stop, guard, run.smoke),
        make(DiskGuard, run.run_dir, outcome, run.smoke),
        make(ConfigCopy, guard, config),
    ]


def close_callbacks(callbacks) -> None:
    for callback in callbacks:
        if hasattr(callback, "close"):
            callback.close()


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
