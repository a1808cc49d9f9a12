"""One process's run (or one rank's), in the roles of torchtune's recipes: setup_run (the folder owned: config,
plan, status "starting"), then _setup_data, _setup_model and _setup_trainer, train, finish. They pass the Run
(what the run is) and the RunOutcome (what training produced: core.train.state) along."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from core import checkpoints, diskfull, rundir
from core.estimate.from_config import plan_json
from core.estimate.plan import PlanError
from core.estimate.specs import SpecError
from core.fmt import error_line
from core.gpu import GpuSampler
from core.recipe import methods, mix, trackers, vision
from core.recipe.config import ConfigError
from core.recipe.rewards import RewardError
from core.rundir import read_status, truncate_metrics, write_status
from core.train import ranks, sources
from core.train.eval_callbacks import (
    early_stop,
    early_stop_sentence,
    early_stopping_callbacks,
    samples_callbacks,
)
from core.train.folder_guard import guard_checkpoints
from core.train.model import choose_precision, load_model, make_trainer, refuse_several_cards, save_final
from core.train.preflight import prepare_run
from core.train.resume import keep_new_hyperparameters, record_config
from core.train.run_callbacks import close_callbacks, run_callbacks
from core.train.smoke import finish_smoke, measure_peak
from core.train.state import Run, RunOutcome, TrainError

# ---- setup --------------------------------------------------------------------------------------------------


def setup_run(run: Run, start) -> None:
    """The run dir owned: unusable newer checkpoints moved aside, config.yaml saying what trains from here (a
    changed config of a resume keeps the old one in config.history/), plan.json, status "starting". Fills in the
    run's folder identity, precision, the checkpoint it resumes from (start: core.train.resume.check_resume's) and
    whether the resume changed training keys."""
    cfg, run_dir = run.cfg, run.run_dir
    run.identity = rundir.folder_identity(run_dir)  # a run folder deleted or replaced later is told by it
    checkpoint, unusable, trained = start
    for path, why in unusable:  # named, and kept out of the way of the saves to come
        aside = path.with_name(f"unusable-{path.name}")
        if aside.exists():
            aside = path.with_name(f"unusable-{path.name}-{time.time_ns()}")
        os.replace(path, aside)
        print(
            f"resume: {path.name} cannot be resumed from ({why}); moved to {rundir.CHECKPOINTS}/{aside.name}",
            flush=True,
        )
    changed = record_config(run_dir, cfg, trained, checkpoint)
    if checkpoint is not None:
        note = (
            f" with changed {', '.join(changed)} (previous config: {checkpoints.CONFIG_HISTORY}/)"
            if changed
            else ""
        )
        print(f"resume: from {checkpoint.name}{note}", flush=True)
    elif run.resume:
        print("resume: no checkpoint in checkpoints/ yet: starting from step 0", flush=True)
    if not run.smoke:
        truncate_metrics(run_dir, checkpoints.checkpoint_step(checkpoint) if checkpoint else 0)
    prec = choose_precision(cfg)
    _write_plan(cfg, run_dir, prec.device.kind, run.smoke)
    status = {"state": "starting", "reason": None, "step": 0, "max_steps": None, "ended": None}
    before = read_status(run_dir)
    launched = (before or {}).get("state") == "starting" and isinstance(
        (before or {}).get("started"), (int, float)
    )
    if before is None or not (
        run.resume or launched
    ):  # a launcher's start time stays: Elapsed never goes back
        status.update(started=time.time(), **rundir.FIRST_ATTEMPT)
    elif run.resume and not launched:  # resumed from a shell: the time it sat stopped is not the run's
        status.update(rundir.resume_times(before))
    status.update(phase="loading the model", phase_started=time.time())
    diskfull.reserve_space(run_dir)  # so that a full disk can still be reported as such
    write_status(run_dir, device=prec.device.label, precision=prec.dtype, smoke=run.smoke, **status)
    print(
        f"device: {prec.device.label}  weights: {prec.dtype}  bf16: {prec.bf16}  fp16: {prec.fp16}",
        flush=True,
    )
    for note in prec.notes:
        print(f"note: {note}", flush=True)
    run.prec, run.checkpoint = prec, checkpoint
    run.new_hyperparameters = any(k.startswith("training.") for k in changed)


def _write_plan(cfg: dict, run_dir: Path, device: str, smoke: bool) -> None:
    """plan.json: what this process trains, planned for the device it really trains on (its one producer). The
    Monitor draws it on the memory chart; a smoke test compares its measured peak with it. A run on several GPUs
    is planned per GPU; its smoke test is one process, and planned as one."""
    if smoke:
        cfg = {**cfg, "distributed": {**cfg["distributed"], "gpus": 1, "num_machines": 1, "machine_rank": 0}}
    try:
        rundir.write_plan(run_dir, plan_json(cfg, device=device, smoke=smoke))
    except (PlanError, SpecError) as exc:
        print(f"plan.json: not written: {exc}", flush=True)


def _setup_data(run: Run) -> None:
    """run.data: prepared before the run folder was made, or here (a rank); the seed set for what is made next,
    and eval_split.json for a run that holds rows out."""
    import transformers

    run.data = run.data or prepare_run(run.cfg, run.prec.device, run.smoke, in_trainer=True)
    transformers.set_seed(run.cfg["training"]["seed"])  # the model and its LoRA weights start from the seed
    if run.eval_ds is not None and not run.smoke and ranks.is_main():
        _record_split(run)
    if run.drawn is not None and not run.smoke and ranks.is_main():
        _record_mix(run)


def _record_split(run: Run) -> None:
    """eval_split.json: how the held-out rows were drawn (data.eval_split of the rows, with training.seed), so an
    evaluation or a rerun can tell the held-out rows from the trained ones."""
    import json

    from core.files import atomic_write_text

    record = {
        "share": run.cfg["data"]["eval_split"],
        "seed": run.cfg["training"]["seed"],
        "train_rows": len(run.train_ds),
        "eval_rows": len(run.eval_ds),
    }
    atomic_write_text(run.run_dir / "eval_split.json", json.dumps(record))


def _record_mix(run: Run) -> None:
    """mix.json: what the mix of data.sources drew (rows per source, seed, rule, each source's commit or file
    fingerprint), written once: a resume draws again, but the record stays that of the run's first draw."""
    import json

    from core.files import atomic_write_text

    path = run.run_dir / rundir.MIX
    if not path.exists():
        atomic_write_text(path, json.dumps(run.drawn, indent=1))


def _setup_model(run: Run):
    cfg = run.cfg
    try:
        return load_model(cfg, run.prec)
    except (OSError, ValueError) as exc:  # a folder that passed the checks but still does not load
        raise ConfigError(f"model.path: {cfg['model']['path']} does not load ({error_line(exc)}).") from None


def _setup_trainer(run: Run, model, ours: list) -> None:
    """run.trainer: the method's trainer around the model, with the samples and early-stopping callbacks and
    ours (core.train.run_callbacks)."""
    cfg, method, smoke = run.cfg, methods.get(run.cfg), run.smoke
    collator = vision.collator(run.tokenizer, cfg, smoke) or (
        method.smoke_collator(run.tokenizer.pad_token_id, cfg["training"].get("max_length"))
        if smoke
        else None
    )
    if ranks.is_main():
        rundir.write_phase(run.run_dir, "building the trainer")
    run.trainer = make_trainer(
        cfg,
        run.prec,
        model,
        run.tokenizer,
        run.train_ds,
        _eval_rows(run),
        run_dir=run.run_dir,
        smoke=smoke,
        collator=collator,
        # the samples first: their generation is evaluation time, which the metrics keep out of tokens/s
        callbacks=[
            *samples_callbacks(cfg, run.run_dir, run.tokenizer, run.eval_ds, smoke),
            *early_stopping_callbacks(cfg, run.eval_ds, smoke),
            *ours,
        ],
        report_to=trackers.route(cfg, run.run_dir, smoke),
    )
    if run.checkpoint and run.new_hyperparameters:
        keep_new_hyperparameters(run.trainer)
    if hasattr(run.trainer.model, "print_trainable_parameters"):
        run.trainer.model.print_trainable_parameters()


def _eval_rows(run: Run):
    """What the trainer evaluates: the held-out rows, or for a mix of data.sources {source: its held-out rows}
    (eval_<source>_loss beside eval_loss; not in a smoke test, nor for a method whose evaluation generates)."""
    if run.smoke or methods.get(run.cfg).traits.generates:
        return run.eval_ds
    return mix.eval_parts(run.eval_ds, run.drawn) or run.eval_ds


def _samples_per_step(run: Run) -> int:
    t = run.cfg["training"]
    if run.smoke:
        return methods.get(run.cfg).smoke_batch(run.cfg)
    return t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] * ranks.world()


def gpu_sampler(run_dir: Path) -> GpuSampler:
    """gpu.jsonl: NVML's view of every GPU once a second, with what this process and its children hold."""
    return GpuSampler(
        run_dir / rundir.GPU,
        interval=1.0,
        watch_pid=os.getpid(),
        on_unavailable=lambda why: print(f"gpu.jsonl: not written: {why}", flush=True),
    ).start()


# ---- train --------------------------------------------------------------------------------------------------


def train_and_finish(run: Run) -> dict:
    """The data, the model and its trainer, training, and the run's end (one process, or one rank)."""
    _setup_data(run)
    return finish(run, train(run))


def train(run: Run) -> RunOutcome:
    """The model and its trainer built and trained, with the GPU sampler running beside it: what came of it."""
    outcome = RunOutcome()
    # one process samples its GPU; the ranks of a run on several are sampled by their supervisor
    sampler = gpu_sampler(run.run_dir) if ranks.spec() is None else None
    # checkpoints record the config with its Hub ids, not their cache folders
    guard, ours = run_callbacks(run, outcome, _samples_per_step(run), config=sources.recorded(run.cfg))
    refuse_several_cards(run.prec)
    try:
        _setup_trainer(run, _setup_model(run), ours)
        guard_checkpoints(run.trainer, guard)  # no checkpoint into (or re-creating) a folder that is gone
        measured = measure_peak(run.trainer, methods.get(run.cfg).measure_phases) if run.smoke else None
        with measured or contextlib.nullcontext({}) as peak:
            t0, cpu0 = time.perf_counter(), time.process_time()
            try:
                run.trainer.train(resume_from_checkpoint=str(run.checkpoint) if run.checkpoint else None)
            except RewardError as exc:  # a GRPO reward function failed: its name, the row and the error
                raise TrainError(str(exc)) from None
            except OSError:
                # a writer into the folder (TensorBoard's, on its own thread) met it deleted, or half deleted (rmtree
                # still running: the folder keeps its identity), before the guard's next look: the folder's fate
                # is the reason, not the writer's FileNotFoundError. A moment lets a deletion under way finish.
                if guard.settle():
                    raise rundir.RunGone(outcome.gone) from None
                raise
            outcome.seconds, outcome.cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        outcome.peak = peak
    finally:
        if sampler is not None:
            sampler.stop()
        close_callbacks(ours)
    return outcome


# ---- finish -------------------------------------------------------------------------------------------------


def finish(run: Run, outcome: RunOutcome) -> dict:
    """The run's end state from how training ended (status.json: rank 0's alone), and the adapter saved."""
    if outcome.gone:  # nothing more is written: the folder is not this run's any more
        raise rundir.RunGone(outcome.gone)
    trainer, stop = run.trainer, run.stop
    step = trainer.state.global_step
    summary = {
        "step": step,
        "max_steps": trainer.state.max_steps,
        "train_seconds": outcome.seconds,
        "train_cpu_seconds": outcome.cpu_seconds,  # all threads of this process (the GPU sampler's too)
        "tokens": int(outcome.tokens),
        "device": run.prec.device.label,
    }
    if outcome.failure:  # a NaN loss; a checkpoint that could not fit was not started
        raise TrainError(outcome.failure)
    if run.smoke:
        return {**summary, "state": "finished", "smoke": finish_smoke(run, outcome, step)}
    if outcome.stopped_at is not None:
        reason = f"stopped by {stop.signal} at step {step}; saved checkpoints/checkpoint-{step}; continue with --resume"
        _write_end(run, state="stopped", reason=reason, step=step)
        return {**summary, "state": "stopped"}
    if stop.signal and step == 0:  # signalled before the first step ended: nothing to save
        _write_end(run, state="stopped", reason=f"stopped by {stop.signal} before the first step", step=0)
        return {**summary, "state": "stopped"}
    # A signal after the last step (while saving) does not undo a finished run: the adapter is still saved.
    # The best checkpoint's weights when early stopping kept them.
    save_final(trainer, run.tokenizer, run.run_dir, run.cfg)
    outcome.early = early = early_stop(trainer)
    if early:
        print(early_stop_sentence(early), flush=True)
    _write_end(
        run,
        state="finished",
        reason=early_stop_sentence(early) if early else None,
        step=step,
        **({"early_stop": early} if early else {}),
    )
    return {**summary, "state": "finished", **({"early_stop": early} if early else {})}


def _write_end(run: Run, **status) -> None:
    """status.json's end of the run: rank 0's alone."""
    if ranks.is_main():
        write_status(run.run_dir, **status)
