"""The run's callbacks one concern at a time (core.train.run_callbacks), driven the way the Trainer drives them:
transformers' own CallbackHandler, TrainerState, TrainerControl and TrainingArguments, over a real run folder.
Each writes what it finds into the RunOutcome the trainer reads; nothing of ours is mocked."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from core import checkpoints, rundir
from core.train.run_callbacks import run_callbacks
from core.train.state import Run, RunOutcome, StopFlag


class Harness:
    """The run's callbacks in a CallbackHandler, as the Trainer makes them, over tmp_path/run."""

    def __init__(self, tmp_path, *, smoke=False, model=None, config=None):
        self.run_dir = tmp_path / "run"
        (self.run_dir / rundir.CHECKPOINTS).mkdir(parents=True)
        self.run = Run(cfg={}, run_dir=self.run_dir, stop=StopFlag(), smoke=smoke)
        self.run.identity = rundir.folder_identity(self.run_dir)
        self.outcome = RunOutcome()
        self.guard, self.callbacks = run_callbacks(self.run, self.outcome, samples_per_step=4, config=config)
        self.handler = CallbackHandler(self.callbacks, model, None, None, None)
        self.args = TrainingArguments(output_dir=str(self.run_dir / rundir.CHECKPOINTS), report_to=[])
        self.state = TrainerState(max_steps=10)
        self.control = TrainerControl()

    def begin(self):
        self.control = self.handler.on_train_begin(self.args, self.state, self.control)

    def step(self, save=False):
        """One training step as the Trainer's loop runs it: begin, the step, end (save asked by the schedule)."""
        self.control = self.handler.on_step_begin(self.args, self.state, self.control)
        self.state.global_step += 1
        self.control.should_save = save
        self.control = self.handler.on_step_end(self.args, self.state, self.control)

    def log(self, **logs):
        self.control = self.handler.on_log(self.args, self.state, self.control, logs)

    def metrics(self) -> list[dict]:
        path = self.run_dir / rundir.METRICS
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def close(self):
        for callback in self.callbacks:
            if hasattr(callback, "close"):
                callback.close()


def test_each_concern_is_a_trainer_callback_and_importing_them_loads_no_transformers(tmp_path):
    h = Harness(tmp_path)
    names = [type(c).__name__ for c in h.callbacks]
    assert names == [
        "FolderGuard",
        "Metrics",
        "Heartbeat",
        "NanStop",
        "CrossRankStop",
        "DiskGuard",
        "ConfigCopy",
    ]
    assert all(isinstance(c, TrainerCallback) for c in h.callbacks)
    assert all(type(c).__module__ == "core.train.run_callbacks" for c in h.callbacks)
    h.close()
    # the CLI and the supervisor import the stop flag and the callbacks' module without paying for transformers
    code = "import sys, core.train.run_callbacks, core.train.state; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_nan_loss_stops_training_unsaved_and_is_recorded_after_its_metrics_line(tmp_path):
    h = Harness(tmp_path)
    h.begin()
    h.step()
    h.log(loss=1.5, learning_rate=1e-4, num_tokens=64.0)
    assert h.outcome.nan_step is None and not h.control.should_training_stop
    h.step()
    h.step()
    h.log(loss=float("nan"), learning_rate=1e-4, num_tokens=128.0)
    assert h.outcome.nan_step == 3
    assert h.outcome.failure == "loss became NaN at step 3"
    assert h.control.should_training_stop and not h.control.should_save
    lines = h.metrics()
    assert [r["step"] for r in lines] == [1, 3]
    assert math.isnan(lines[-1]["loss"])  # the line that shows it is written before the run stops
    assert h.outcome.tokens == 128.0 and lines[-1]["tokens_per_s"] > 0
    assert rundir.read_status(h.run_dir)["step"] == 3
    # a later NaN does not move the step it first happened at
    h.step()
    h.log(loss=float("inf"))
    assert h.outcome.nan_step == 3
    h.close()


def test_the_disk_guard_records_a_checkpoint_that_cannot_fit_and_stops_before_writing_it(tmp_path):
    # 2**40 float32 weights to train: 4 TiB that no test disk has free (on the meta device: no memory taken)
    model = torch.nn.Linear(2**20, 2**20, bias=False, device="meta")
    h = Harness(tmp_path, model=model)
    h.begin()
    h.step(save=False)  # no checkpoint due: nothing asked of the disk
    assert h.outcome.disk_full is None and not h.control.should_training_stop
    h.step(save=True)
    assert h.outcome.disk_full.startswith(
        "disk full: checkpoint-2 needs about 4505.6 GiB and the disk that holds"
    )
    assert "newest checkpoint: none yet" in h.outcome.disk_full and "resume the run" in h.outcome.disk_full
    assert h.outcome.failure == h.outcome.disk_full
    assert not h.control.should_save and h.control.should_training_stop
    h.close()


def test_the_disk_guard_lets_a_checkpoint_that_fits_be_saved(tmp_path):
    h = Harness(tmp_path, model=torch.nn.Linear(4, 4))
    h.begin()
    h.step(save=True)
    assert h.outcome.disk_full is None and h.control.should_save and not h.control.should_training_stop
    h.close()


def test_a_smoke_test_asks_nothing_of_the_disk(tmp_path):
    h = Harness(tmp_path, smoke=True, model=torch.nn.Linear(2**20, 2**20, bias=False, device="meta"))
    h.begin()
    h.step(save=True)
    assert h.outcome.disk_full is None
    assert h.metrics() == []  # nor writes metrics: its one step is no training curve
    h.close()


def test_the_folder_guard_stops_a_run_whose_folder_was_deleted_and_writes_nothing_there(tmp_path):
    h = Harness(tmp_path)
    h.begin()
    h.step()
    assert rundir.read_status(h.run_dir)["state"] == "running"
    shutil.rmtree(h.run_dir)
    h.step(save=True)
    assert "was deleted while the run trained" in h.outcome.gone
    assert h.control.should_training_stop
    assert not (h.control.should_save or h.control.should_log or h.control.should_evaluate)
    h.log(loss=1.0)
    h.control = h.handler.on_save(h.args, h.state, h.control)
    assert not h.run_dir.exists()  # no status, metrics line or checkpoint config re-created it
    assert h.outcome.nan_step is None and h.outcome.stopped_at is None
    h.close()


def test_the_folder_guard_tells_a_folder_replaced_under_the_same_name(tmp_path):
    h = Harness(tmp_path)
    h.begin()
    os.rename(h.run_dir, tmp_path / "aside")  # still there: the new folder cannot reuse its inode
    h.run_dir.mkdir()
    h.step()
    assert "was replaced by another folder" in h.outcome.gone
    assert h.control.should_training_stop and not h.control.should_save
    h.log(loss=1.0)
    assert list(h.run_dir.iterdir()) == []  # the other folder is left as it is
    h.close()


def test_a_folder_gone_before_training_begins_stops_it_before_the_first_step(tmp_path):
    h = Harness(tmp_path)
    shutil.rmtree(h.run_dir)
    h.run.stop.signal = "SIGTERM"
    h.begin()
    assert h.outcome.gone and h.control.should_training_stop
    assert not h.run_dir.exists()


def test_a_stop_signal_ends_training_at_the_step_with_a_checkpoint(tmp_path):
    h = Harness(tmp_path, model=torch.nn.Linear(4, 4))
    h.begin()
    h.step()
    h.run.stop.signal = "SIGINT"
    h.step()
    assert h.outcome.stopped_at == 2
    assert h.control.should_training_stop and h.control.should_save  # saved where it stops
    h.step()
    assert h.outcome.stopped_at == 2
    h.close()


def test_a_stop_signalled_while_loading_stops_before_the_first_step(tmp_path):
    h = Harness(tmp_path)
    h.run.stop.signal = "SIGTERM"
    h.begin()
    assert h.control.should_training_stop and h.outcome.stopped_at is None
    assert rundir.read_status(h.run_dir)["state"] == "running"
    h.close()


def test_the_heartbeat_writes_running_then_the_step_and_its_usual_time(tmp_path):
    h = Harness(tmp_path)
    h.begin()
    status = rundir.read_status(h.run_dir)
    assert status["state"] == "running" and status["phase"] == "first step" and status["max_steps"] == 10
    h.step()
    status = rundir.read_status(h.run_dir)
    assert status["step"] == 1 and status["step_s"] >= 0
    assert h.outcome.step_seconds and len(h.outcome.step_seconds) == 1
    h.log(loss=1.0)
    status = rundir.read_status(h.run_dir)
    assert status["phase"] is None and status["step"] == 1
    h.close()


def test_each_checkpoint_keeps_the_config_that_trained_it(tmp_path):
    h = Harness(tmp_path, config={"model": {"path": "some/model"}, "training": {"max_steps": 10}})
    h.begin()
    h.step(save=True)
    saved = h.run_dir / rundir.CHECKPOINTS / "checkpoint-1"
    saved.mkdir()
    h.control = h.handler.on_save(h.args, h.state, h.control)
    text = (saved / checkpoints.CHECKPOINT_CONFIG).read_text()
    assert "some/model" in text and "max_steps: 10" in text
    h.close()


@pytest.mark.parametrize("smoke", [False, True])
def test_the_metrics_file_is_opened_only_for_a_run_that_writes_one(tmp_path, smoke):
    h = Harness(tmp_path, smoke=smoke)
    h.begin()
    h.step()
    h.log(loss=2.0, grad_norm=0.5)
    h.log(train_runtime=3.0)  # the end-of-training summary is no metric line
    assert len(h.metrics()) == (0 if smoke else 1)
    h.close()


# ---- the Trainer's checkpoint writes: refused into a folder that is gone, taken back when they re-created it ----


class Saver:
    """A real transformers Trainer over a tiny torch model, its checkpoint writes guarded as a run guards them."""

    def __init__(self, tmp_path):
        from transformers import Trainer

        from core.train.folder_guard import guard_checkpoints

        self.h = Harness(tmp_path)
        args = TrainingArguments(
            output_dir=str(self.h.run_dir / rundir.CHECKPOINTS),
            save_only_model=True,
            report_to=[],
            use_cpu=True,
        )
        self.trainer = Trainer(model=torch.nn.Linear(4, 4), args=args)
        self.trainer.state.global_step = 7
        guard_checkpoints(self.trainer, self.h.guard)

    def before_the_write(self, act):
        """act() runs inside the save, after the guard's look and before the Trainer makes the checkpoint's folder."""
        save_model = self.trainer.save_model

        def acting(*args, **kwargs):
            act()
            return save_model(*args, **kwargs)

        self.trainer.save_model = acting

    def after_the_model(self, act):
        """act() runs inside the save, once the model is written and before the Trainer writes the rest."""
        save_model = self.trainer.save_model

        def acting(*args, **kwargs):
            saved = save_model(*args, **kwargs)
            act()
            return saved

        self.trainer.save_model = acting

    def save(self):
        self.trainer._save_checkpoint(self.trainer.model, None)


def test_a_checkpoint_write_in_a_folder_that_is_still_the_runs_is_made(tmp_path):
    s = Saver(tmp_path)
    s.save()
    assert (s.h.run_dir / rundir.CHECKPOINTS / "checkpoint-7" / "trainer_state.json").is_file()
    assert s.h.outcome.gone is None


def test_a_checkpoint_write_into_a_deleted_folder_is_refused(tmp_path):
    s = Saver(tmp_path)
    shutil.rmtree(s.h.run_dir)
    s.save()
    assert not s.h.run_dir.exists()
    assert "was deleted while the run trained" in s.h.outcome.gone


def test_a_checkpoint_write_that_re_created_the_deleted_folder_is_taken_back_and_the_run_reads_deleted(
    tmp_path,
):
    s = Saver(tmp_path)
    s.before_the_write(lambda: shutil.rmtree(s.h.run_dir))  # rm -rf finishing as the checkpoint starts
    s.save()
    assert not s.h.run_dir.exists()  # the Trainer's makedirs made it again; nothing of it is left
    assert "was deleted while the run trained" in s.h.outcome.gone
    assert s.h.guard.check() and "was deleted" in s.h.outcome.gone  # ...and stays deleted: not "replaced"


def test_a_folder_someone_else_put_in_its_place_is_left_as_it_is_and_reads_replaced(tmp_path):
    s = Saver(tmp_path)

    def replace():
        os.rename(s.h.run_dir, tmp_path / "aside")
        s.h.run_dir.mkdir()
        (s.h.run_dir / "notes.txt").write_text("theirs")

    s.before_the_write(replace)
    s.save()
    assert (s.h.run_dir / "notes.txt").read_text() == "theirs"
    assert s.h.guard.check() and "was replaced by another folder" in s.h.outcome.gone


def test_a_folder_deleted_in_the_middle_of_a_checkpoint_write_ends_the_run_as_deleted_not_as_the_writers_error(
    tmp_path,
):
    # rm -rf under a checkpoint half written: the Trainer's next write fails (torch.save's "Parent directory ... does
    # not exist", or a FileNotFoundError); the run's reason is its folder, one sentence, and nothing is left behind
    s = Saver(tmp_path)
    s.after_the_model(lambda: shutil.rmtree(s.h.run_dir))
    with pytest.raises(rundir.RunGone, match="was deleted while the run trained"):
        s.save()
    assert not s.h.run_dir.exists()


def test_a_checkpoint_write_that_fails_in_a_folder_still_the_runs_raises_its_own_error(tmp_path):
    s = Saver(tmp_path)

    def fail():
        raise RuntimeError("the writer's own failure")

    s.after_the_model(fail)
    with pytest.raises(RuntimeError, match="the writer's own failure"):
        s.save()
    assert s.h.outcome.gone is None and s.h.run_dir.is_dir()


def test_a_checkpoint_save_that_re_creates_a_deleted_folder_is_taken_back_model_card_and_all(
    tmp_path, tiny_llama
):
    """The race CI met: the folder deleted after the guard's look and before TRL's save, whose model card
    (checkpoints/README.md, written first) and checkpoint then re-create it. A real SFTTrainer's save, the
    deletion put at that instant: the save's files are taken back, nothing is left, the run reads as deleted."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from core.train.folder_guard import FolderGuard, guard_checkpoints

    run_dir = tmp_path / "run"
    (run_dir / rundir.CHECKPOINTS).mkdir(parents=True)
    args = SFTConfig(output_dir=str(run_dir / rundir.CHECKPOINTS), max_steps=1, report_to=[], use_cpu=True)
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_llama),
        args=args,
        train_dataset=Dataset.from_dict({"text": ["a short row"] * 2}),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.state.global_step = 2
    save = trainer._save_checkpoint

    def deleted_first(model, trial):  # `rm -rf` lands between the guard's look and the save
        shutil.rmtree(run_dir)
        return save(model, trial)

    trainer._save_checkpoint = deleted_first
    outcome = RunOutcome()
    with rundir.folder_held(run_dir):  # as the trainer holds it: the re-made folder is another inode
        guard = FolderGuard(run_dir, outcome)
        guard_checkpoints(trainer, guard)
        trainer._save_checkpoint(trainer.model, None)
    assert not run_dir.exists()
    assert outcome.gone is not None and "was deleted while the run trained" in outcome.gone


def test_a_folder_re_created_with_anything_else_is_left_as_found(tmp_path):
    """take_back removes only what a save writes: a file the user put there keeps the folder and reads as
    replaced."""
    from core.train.folder_guard import FolderGuard

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outcome = RunOutcome()
    guard = FolderGuard(run_dir, outcome)
    run_dir.rmdir()
    (tmp_path / "elsewhere").mkdir()  # takes the freed inode: the new folder is told apart from the old
    (run_dir / rundir.CHECKPOINTS / "checkpoint-2").mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    guard.take_back("checkpoint-2")
    assert (run_dir / "notes.txt").read_text() == "mine" and (
        run_dir / rundir.CHECKPOINTS / "checkpoint-2"
    ).is_dir()
    assert guard.check() and "replaced" in outcome.gone
