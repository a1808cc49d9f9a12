"""The run folder's guard: the folder this trainer owns, as it found it (core.rundir.folder_identity). Once it is
deleted or replaced the run writes nothing more there: its callbacks ask the guard before each write, and the
Trainer's checkpoint writes go through guard_checkpoints, which refuses a checkpoint into a folder that is not the
run's and takes back one that re-created the folder while `rm -rf` deleted it (the run then reads as deleted,
not replaced, and leaves nothing behind)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from core import rundir
from core.train.state import RunOutcome

# what a TRL trainer's checkpoint save writes beside the checkpoint, before it (create_model_card, into output_dir)
MODEL_CARD = "README.md"


def _stop_unsaved(control) -> None:
    control.should_training_stop = True
    control.should_save = control.should_evaluate = control.should_log = False


class FolderGuard:
    """The run folder this trainer owns, as it found it (core.rundir.folder_identity): once it is deleted or
    replaced, outcome.gone says so and training stops without saving, evaluating or logging into it. The other
    callbacks ask it (check) before they write."""

    def __init__(self, run_dir: Path, outcome: RunOutcome, identity=None):
        self.run_dir, self.outcome = run_dir, outcome
        self.identity = identity or rundir.folder_identity(run_dir)

    def check(self, control=None) -> bool:
        """True (and training told to stop, saving nothing, when control is given) once the folder is gone or
        another one."""
        if self.outcome.gone is None:
            now = rundir.folder_identity(self.run_dir)
            if now != self.identity:
                what = "was deleted" if now is None else "was replaced by another folder"
                self.outcome.gone = self._sentence(what)
        if self.outcome.gone is not None and control is not None:
            _stop_unsaved(control)
        return self.outcome.gone is not None

    def _sentence(self, what: str) -> str:
        return (
            f"the run folder {self.run_dir} {what} while the run trained; stopped without saving "
            "or re-creating anything."
        )

    def settle(self, seconds: float = 2.0) -> bool:
        """After a write into the folder failed: True once the folder reads as gone, looking for a moment, since
        `rm -rf` still under way leaves it half deleted with its identity for a while. The folder's fate is then
        the reason, not the writer's error (a FileNotFoundError, or torch.save's "Parent directory ... does not
        exist")."""
        deadline = time.monotonic() + seconds
        while not self.check() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.outcome.gone is not None

    def on_train_begin(self, args, state, control, **kw):
        self.check(control)

    def take_back(self, made: str) -> None:
        """After a checkpoint write (made: its folder's name): when the folder at run_dir is not the run's and holds
        nothing but what a save writes (checkpoints/<made>, and TRL's model card checkpoints/README.md, written
        first), that write made it (its makedirs re-created the run folder an instant after `rm -rf` removed it).
        What it wrote is removed, then checkpoints/ and the folder each only when empty (anything else found there
        stays), and the run reads as deleted."""
        now = rundir.folder_identity(self.run_dir)
        if now is None or now == self.identity or not self._holds_only(made):
            return
        saved = self.run_dir / rundir.CHECKPOINTS
        shutil.rmtree(saved / made, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(saved / MODEL_CARD)
        with contextlib.suppress(OSError):
            os.rmdir(saved)
            os.rmdir(self.run_dir)
        if rundir.folder_identity(self.run_dir) is None:
            self.outcome.gone = self.outcome.gone or self._sentence("was deleted")

    def _holds_only(self, made: str) -> bool:
        try:
            return os.listdir(self.run_dir) == [rundir.CHECKPOINTS] and set(
                os.listdir(self.run_dir / rundir.CHECKPOINTS)
            ) <= {made, MODEL_CARD}
        except OSError:
            return False


def guard_checkpoints(trainer, guard: FolderGuard) -> None:
    """The Trainer's checkpoint writes (its _save_checkpoint) refused once the run folder is deleted or replaced,
    and taken back when they re-created it (FolderGuard.take_back)."""
    save = trainer._save_checkpoint

    def guarded(model, trial):
        if guard.check():  # gone before the save: nothing is written (the callbacks stop training)
            return None
        made = f"checkpoint-{trainer.state.global_step}"
        try:
            saved = save(model, trial)
        except Exception:
            guard.take_back(made)
            if guard.settle():  # deleted under the write: one sentence, not torch.save's error
                raise rundir.RunGone(guard.outcome.gone) from None
            raise
        guard.take_back(made)
        return saved

    trainer._save_checkpoint = guarded
