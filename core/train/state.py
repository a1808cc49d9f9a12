"""What a run is while it trains (Run), what its training produced (RunOutcome), the stop flag a signal sets and
the error that ends a run. The trainer's roles (setup, train, finish, supervise: core.train.steps and
core.train.supervise) pass these two along instead of threading a dozen values by hand; the run's callbacks
(core.train.run_callbacks) write what they find into the RunOutcome. Light: no transformers, no torch."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.precision import Precision


class TrainError(RuntimeError):
    """The run cannot go on; the message is the user-facing reason written to status.json."""


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


@dataclass
class Run:
    """One run while it trains: what was asked (config, folder, smoke test, resume), what setup made of it
    (precision, the checkpoint it continues from, the folder's identity) and, once made, its data and trainer."""

    cfg: dict
    run_dir: Path
    stop: StopFlag
    smoke: bool = False
    resume: bool = False
    prec: Precision | None = None  # the device and precision it trains with (setup: core.precision)
    checkpoint: Path | None = None  # the checkpoint it resumes from
    new_hyperparameters: bool = (
        False  # a resume whose config changed training keys (they win over the saved ones)
    )
    identity: Any = (
        None  # the run folder's core.rundir.folder_identity when it started: deleted or replaced, told
    )
    # (tokenizer, train rows, held-out rows or None): prepared before the run folder was made, or by setup
    data: tuple | None = None
    trainer: Any = None  # the method's TRL trainer, once made

    @property
    def tokenizer(self):
        return self.data[0] if self.data else None

    @property
    def train_ds(self):
        return self.data[1] if self.data else None

    @property
    def eval_ds(self):
        return self.data[2] if self.data else None

    @property
    def drawn(self) -> dict | None:
        """What a mix of data.sources drew (core.recipe.mix.draw's record), None for one data.path."""
        return self.data[3] if self.data and len(self.data) > 3 else None


@dataclass
class RunOutcome:
    """What the training produced, written by the run's callbacks while it trains and by the trainer after it:
    how it ended (stopped by a signal, a NaN loss, a full disk, the folder gone), what it measured (tokens, step
    times, the smoke test's peak, seconds) and, once finished, an early stop."""

    gone: str | None = (
        None  # why the run folder is not this run's any more (deleted or replaced): write nothing
    )
    stopped_at: int | None = (
        None  # the step a stop signal (any rank's) ended training at, its checkpoint saved
    )
    nan_step: int | None = None  # the step whose logged loss was NaN or infinite
    disk_full: str | None = None  # why training stopped before a checkpoint that could not fit
    tokens: float = 0.0  # tokens trained on so far (the trainer's num_tokens at the last log)
    step_seconds: list[float] = field(default_factory=list)  # each step's wall time
    peak: dict = field(default_factory=dict)  # a smoke test's measured peak (core.train.smoke.measure_peak)
    seconds: float = 0.0  # wall seconds of trainer.train()
    cpu_seconds: float = 0.0  # CPU seconds of this process (all its threads) meanwhile
    early: dict | None = None  # early stopping ended the run (core.train.eval_callbacks.early_stop)

    @property
    def failure(self) -> str | None:
        """The reason the run failed for what training found (NaN, full disk), or None."""
        if self.nan_step is not None:
            return f"loss became NaN at step {self.nan_step}"
        return self.disk_full
