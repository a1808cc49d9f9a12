"""Train one run: `python -m core.train run.yaml --run-dir DIR [--resume] [--smoke]`.

An ordinary program (transformers Trainer + peft, bitsandbytes for QLoRA) whose only channel to the outside is
the run directory: status.json (state + reason), metrics.jsonl (one flushed line per log), gpu.jsonl (NVML at
1 Hz), checkpoints/, adapter/, smoke.json. The dashboard, a terminal or another machine run it the same way.

Signals: SIGTERM (or Ctrl+C) saves a checkpoint at the end of the current step and exits with state `stopped`;
`--resume` continues from the newest checkpoint in DIR/checkpoints with the same step count.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from core import procs, rundir
from core.estimate.from_config import plan_json, resolve_strategy
from core.estimate.plan import PlanError
from core.estimate.specs import SpecError
from core.fmt import error_line
from core.gpu import GpuSampler
from core.precision import Device, Precision, PrecisionError, resolve, torch_dtype
from core.recipe import distributed, methods, trackers, vision
from core.recipe.config import ConfigError, load_config, validate_config
from core.recipe.data import DataError
from core.recipe.engine_args import bnb_config, lora_config, model_kwargs, training_args
from core.recipe.rewards import RewardError
from core.rundir import read_status, truncate_metrics, write_status
from core.train import ranks, sources
from core.train.callbacks import (
    StopFlag,
    early_stop,
    early_stop_sentence,
    early_stopping_callbacks,
    make_run_callback,
    samples_callbacks,
)
from core.train.preflight import check_model, prepare_run
from core.train.resume import check_resume, keep_new_hyperparameters, record_config
from core.train.smoke import finish_smoke, measure_peak

EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED = 2, 1, 0


class TrainError(RuntimeError):
    """The run cannot go on; the message is the user-facing reason written to status.json."""


class ConfigRefused(ConfigError):
    """A config problem found before the run folder was made or locked: nothing was written anywhere."""


# ---- device and precision -----------------------------------------------------------------------------------


def choose_precision(cfg: dict) -> Precision:
    """The run's device and precision on this machine (core.precision, the resolver the planner uses too)."""
    try:
        return resolve(cfg, Device.local())
    except PrecisionError as exc:
        raise TrainError(str(exc)) from None


# ---- model --------------------------------------------------------------------------------------------------


def load_model(cfg: dict, prec: Precision, path: str | None = None):
    """The base model as the run trains it: in the load dtype, 4-bit when asked (quantized where it lands), KV cache
    off. LoRA, the QLoRA preparation and the fused LM head are SFTTrainer's (make_trainer), so that the planner,
    the tracker and a run all see one model-building path."""
    import torch
    from transformers import AutoModelForCausalLM

    m = cfg["model"]
    kwargs = {
        "dtype": torch_dtype(prec.dtype),
        **model_kwargs(cfg, path or m["path"]),
        "trust_remote_code": m["trust_remote_code"],
    }
    quant = bnb_config(cfg, prec.dtype)
    vision.quantization(quant, path or m["path"])
    if quant is not None:
        kwargs["quantization_config"] = quant
        # 4-bit weights are quantized where they land: on the GPU choose_precision named (torch's current one)
        kwargs["device_map"] = {"": "cpu"} if prec.on_cpu else {"": torch.cuda.current_device()}
    auto = vision.model_class() if vision.folder_is_vlm(path or m["path"]) else AutoModelForCausalLM
    model = auto.from_pretrained(path or m["path"], **kwargs)
    model.config.use_cache = False  # the KV cache only costs memory in training
    return model


def make_trainer(
    cfg: dict,
    prec: Precision,
    model,
    tokenizer,
    train_ds,
    eval_ds=None,
    run_dir=None,
    smoke=False,
    collator=None,
    callbacks=(),
    report_to=None,
):
    """The run's trainer, its method's (SFTTrainer, DPOTrainer, KTOTrainer): LoRA (peft_config) or full, TRL's
    QLoRA handling (no fp32 upcast; adapters in bf16), its fused LM head, every training key of the config as the
    method's TRL config. A preference method's reference is the base with the adapter disabled (no second copy), a
    copy of the model for a full fine-tune (TRL's default), or model.reference_path. Used by core.train and
    core.measure."""

    args = training_args(cfg, run_dir, prec, smoke=smoke, has_eval=eval_ds is not None, report_to=report_to)
    kwargs = dict(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        peft_config=lora_config(cfg, vision_model=vision.is_processor(tokenizer)),
        callbacks=list(callbacks),
    )
    if collator is not None:  # GRPOTrainer batches its own generations and takes no collator
        kwargs["data_collator"] = collator
    method = methods.get(cfg)
    kwargs.update(method.trainer_kwargs(cfg, lambda path: load_model(cfg, prec, path=path), train_ds))
    if (
        vision.is_processor(tokenizer)
        and not cfg["lora"]["enabled"]
        and cfg["model"].get("freeze_vision", True)
    ):
        vision.freeze_tower(model)  # a full fine-tune of a VLM trains its language model, as LoRA does
    trainer = method.trainer_class()(**kwargs)
    _fp32_trainable(trainer.model, prec)
    return trainer


def _fp32_trainable(model, prec: Precision):
    """fp16 mixed precision (CUDA only) needs float32 trainable weights: torch's GradScaler refuses float16
    gradients ("Attempting to unscale FP16 gradients"). peft makes the LoRA weights float32 already; trainable
    biases (lora.bias) and full fine-tuning on float16 weights would hit that at the first step."""
    if prec.fp16:
        import torch

        for p in model.parameters():
            if p.requires_grad and p.dtype == torch.float16:
                p.data = p.data.float()
    return model


# ---- the run ------------------------------------------------------------------------------------------------


def _write_plan(cfg: dict, run_dir: Path, prec: Precision, smoke: bool) -> None:
    """plan.json: what this process trains, planned for the device it really trains on (its one producer). The
    Monitor draws it on the memory chart; a smoke test compares its measured peak with it. A run on several GPUs
    is planned per GPU; its smoke test is one process, and planned as one."""
    if smoke:
        cfg = {**cfg, "distributed": {**cfg["distributed"], "gpus": 1, "num_machines": 1, "machine_rank": 0}}
    try:
        rundir.write_plan(run_dir, plan_json(cfg, device=prec.device.kind, smoke=smoke))
    except (PlanError, SpecError) as exc:
        print(f"plan.json: not written: {exc}", flush=True)


def quiet_progress_bars():
    """Progress bars would bury the stderr tail the launcher shows when a run fails."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def run_training(
    config_path: str | os.PathLike,
    run_dir: str | os.PathLike,
    resume: bool = False,
    smoke: bool = False,
    stop: StopFlag | None = None,
    keep_lock: bool = False,
    machine: dict | None = None,
    announce=None,
) -> dict:
    """Train and return a summary; raises ConfigError/DataError/TrainError for the user's problems (ConfigRefused:
    found before anything was written), RunRefused and RunBusy (core.rundir; touching nothing) for a run
    directory that cannot be trained into (or a resume its checkpoint cannot take), RunGone
    when the run directory was deleted or replaced under the trainer (it stops without writing anything).

    Everything that can be checked without the run directory is checked before it is created or locked: the
    config, its model folder, (--resume) the checkpoint and whether the config can continue from it, and the
    data (preflight and tokenized: core.train.preflight.prepare_run). A bad config or bad data leaves no folder
    behind and loads no model. announce(run_dir): called once the folder is this run's and training starts.

    The process holds the run's lock from here to the end: that, not a pid, is what makes the run "running".
    keep_lock (the CLI): hold it until the process exits, so the run reads as ended only once it is gone.
    machine: {"machine_rank", "main_process_ip"} given on the command line (a SLURM script's node id) over the
    config's distributed section; a machine other than the main one supervises its ranks from its own folder
    (_run_machine)."""
    rundir.check_run_dir_path(run_dir)  # before resolve(): a dangling link must not name where to create it
    run_dir = Path(run_dir).resolve()
    handed = ranks.spec()
    if handed is not None:  # one rank of a run on several processes: its supervisor owns the folder
        if announce:
            announce(run_dir)
        return _run_rank(config_path, run_dir, handed, stop)
    if not smoke and machine_rank(config_path, machine) > 0:
        cfg = checked_config(config_path, machine)
        distributed.pin_gpus(cfg, one_process=False)
        return _run_machine(cfg, config_path, run_dir, resume, stop, keep_lock, announce)
    rundir.check_run_dir(run_dir, resume, Path(config_path))
    adopted = (
        procs.adopt_claim()
    )  # a launcher took the lock and handed it down: the folder is already the run's
    try:
        cfg = checked_config(config_path, machine)
        pinned = distributed.pin_gpus(cfg, one_process=smoke or distributed.world_size(cfg) == 1)
        if pinned and Device.local().kind == "cuda":  # asked only now: CUDA starts on the card just pinned
            print(f"training on {pinned}", flush=True)
        start = check_resume(run_dir, cfg, config_path) if resume and not smoke else (None, [], None)
        if resume and not smoke:  # a Hub id resolving to another commit than it trained on
            sources.refuse_other_commits(run_dir, cfg)
        if adopted is not None:  # the launcher's folder: say what it is doing (a terminal's run has none yet)
            rundir.write_phase(run_dir, "checking and preparing the data")
        # the data checked and tokenized here, before the folder (a supervisor's ranks tokenize their own)
        data = prepare_run(
            cfg, Device.local(), smoke, datasets=smoke or distributed.world_size(cfg) == 1, in_trainer=True
        )
    except (ConfigError, DataError, rundir.RunRefused) as exc:
        if adopted is None:  # nothing was created or locked: say so and leave the folder as it was
            raise exc if isinstance(exc, rundir.RunRefused) else ConfigRefused(str(exc)) from None
        if not keep_lock:
            os.close(adopted)
        raise ConfigError(str(exc)) from None  # the launcher's run folder: its status says why
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise rundir.RunRefused(f"--run-dir {run_dir} cannot be created ({exc.strerror}).") from None
    lock_fd = adopted or rundir.claim(run_dir)
    try:
        procs.write_pid_info(run_dir)  # pid, start time, and whether it leads its own session (for a stop)
        if announce:
            announce(run_dir)
        return _run_training(cfg, run_dir, resume, smoke, stop, start, data)
    finally:
        if not keep_lock:
            procs.disown(run_dir, lock_fd)  # in-process callers: the run is seen ended from here on


def machine_rank(config_path, machine: dict | None = None) -> int:
    """This machine's rank in a run on several machines (0: the main one, which owns the run directory)."""
    if machine and machine.get("machine_rank") is not None:
        return int(machine["machine_rank"])
    try:
        return int(load_config(config_path)["distributed"]["machine_rank"])
    except ConfigError:
        return 0  # the main path says what is wrong with it


def machine_folder(run_dir: Path, rank: int) -> Path:
    """What a machine other than the main one owns in the run directory (its lock, pid, status and output)."""
    return Path(run_dir) / ranks.MACHINES / f"machine-{rank}"


def checked_config(config_path, machine: dict | None = None) -> dict:
    """The validated config (with the command line's machine settings over its own) whose model folder exists
    and looks like a model, or ConfigError."""
    cfg = load_config(config_path)
    given = {k: v for k, v in (machine or {}).items() if v is not None}
    if given:
        cfg = validate_config({**cfg, "distributed": {**cfg["distributed"], **given}})
    problem = check_model(cfg["model"]["path"])
    if problem:
        raise ConfigError(problem)
    return cfg


def _run_training(
    cfg: dict, run_dir: Path, resume: bool, smoke: bool, stop: StopFlag | None, start, data
) -> dict:
    """The run as torchtune's recipes do it: set up the run, its data, its model and trainer, train, finish."""
    quiet_progress_bars()
    if stop is None:
        stop = StopFlag().install() if threading.current_thread() is threading.main_thread() else StopFlag()
    identity = rundir.folder_identity(run_dir)  # a run folder deleted or replaced later is told by it
    prec, checkpoint, new_hyperparameters = _setup_run(cfg, run_dir, resume, smoke, start)
    if sources.hub_refs(cfg).get("data") is not None:
        data = None  # prepared from a streamed sample before the download: the run trains on the whole split
    # Hub ids: fetched (progress in the run folder), then local folders
    cfg = sources.for_training(cfg, run_dir)
    if distributed.world_size(cfg) > 1 and not smoke:  # a smoke test measures one process's step
        return _supervise(cfg, run_dir, prec, checkpoint, new_hyperparameters, stop)
    return _train_and_finish(cfg, prec, run_dir, checkpoint, smoke, stop, identity, new_hyperparameters, data)


def _train_and_finish(
    cfg, prec, run_dir: Path, checkpoint, smoke, stop, identity, new_hyperparameters, data=None
) -> dict:
    """The data (prepared before the run folder was made, or here: a rank), the model and its trainer, training,
    and the run's end (one process, or one rank)."""
    import transformers

    tokenizer, train_ds, eval_ds = data or prepare_run(cfg, prec.device, smoke, in_trainer=True)
    transformers.set_seed(cfg["training"]["seed"])  # the model and its LoRA weights start from the seed
    if eval_ds is not None and not smoke and ranks.is_main():
        _record_split(cfg, run_dir, train_ds, eval_ds)
    trainer, callback, peak, seconds = _train(
        cfg,
        prec,
        run_dir,
        tokenizer,
        train_ds,
        eval_ds,
        checkpoint,
        smoke,
        stop,
        identity,
        new_hyperparameters,
    )
    return _finish(cfg, prec, run_dir, tokenizer, trainer, callback, peak, seconds, smoke, stop)


def _finish(cfg, prec, run_dir: Path, tokenizer, trainer, callback, peak, seconds, smoke, stop) -> dict:
    """The run's end state from how training ended (status.json: rank 0's alone), and the adapter saved."""
    main = ranks.is_main()
    write = write_status if main else (lambda *a, **k: None)
    if callback.gone:  # nothing more is written: the folder is not this run's any more
        raise rundir.RunGone(callback.gone)
    step = trainer.state.global_step
    summary = {
        "step": step,
        "max_steps": trainer.state.max_steps,
        "train_seconds": seconds[0],
        "train_cpu_seconds": seconds[1],  # all threads of this process (the GPU sampler's too)
        "tokens": int(callback._last_tokens),
        "device": prec.device.label,
    }
    if callback.nan_step is not None:
        raise TrainError(f"loss became NaN at step {callback.nan_step}")
    if callback.disk_full:  # a checkpoint that could not fit was not started
        raise TrainError(callback.disk_full)
    if smoke:
        result = finish_smoke(cfg, prec, run_dir, peak, callback, step)
        return {**summary, "state": "finished", "smoke": result}
    if callback.stopped_at is not None:
        reason = f"stopped by {stop.signal} at step {step}; saved checkpoints/checkpoint-{step}; continue with --resume"
        write(run_dir, state="stopped", reason=reason, step=step)
        return {**summary, "state": "stopped"}
    if stop.signal and step == 0:  # signalled before the first step ended: nothing to save
        write(run_dir, state="stopped", reason=f"stopped by {stop.signal} before the first step", step=0)
        return {**summary, "state": "stopped"}
    # A signal after the last step (while saving) does not undo a finished run: the adapter is still saved.
    save_final(
        trainer, tokenizer, run_dir, cfg
    )  # the best checkpoint's weights when early stopping kept them
    early = early_stop(trainer)
    if early:
        print(early_stop_sentence(early), flush=True)
    write(
        run_dir,
        state="finished",
        reason=early_stop_sentence(early) if early else None,
        step=step,
        **({"early_stop": early} if early else {}),
    )
    return {**summary, "state": "finished", **({"early_stop": early} if early else {})}


def _record_split(cfg: dict, run_dir: Path, train_ds, eval_ds) -> None:
    """eval_split.json: how the held-out rows were drawn (data.eval_split of the rows, with training.seed), so an
    evaluation or a rerun can tell the held-out rows from the trained ones."""
    import json

    from core.files import atomic_write_text

    record = {
        "share": cfg["data"]["eval_split"],
        "seed": cfg["training"]["seed"],
        "train_rows": len(train_ds),
        "eval_rows": len(eval_ds),
    }
    atomic_write_text(run_dir / "eval_split.json", json.dumps(record))


def _gpu_sampler(run_dir: Path) -> GpuSampler:
    """gpu.jsonl: NVML's view of every GPU once a second, with what this process and its children hold."""
    return GpuSampler(
        run_dir / rundir.GPU,
        interval=1.0,
        watch_pid=os.getpid(),
        on_unavailable=lambda why: print(f"gpu.jsonl: not written: {why}", flush=True),
    ).start()


def _supervise(
    cfg: dict,
    run_dir: Path,
    prec: Precision,
    checkpoint,
    new_hyperparameters: bool,
    stop,
    home=None,
    config=None,
) -> dict:
    """A run on several processes: this process keeps the run (lock, pid, status) and starts, watches and stops
    its ranks (core.train.ranks); on GPUs through accelerate with <home>/accelerate.yaml. home: the folder this
    process owns (the run directory; its own folder on a machine other than the main one); config: the config
    file the ranks read (the run's config.yaml)."""
    home = home or run_dir
    identity = rundir.folder_identity(run_dir)  # the ranks stop without saving once it is deleted or replaced
    strategy = "ddp"  # without CUDA: torchrun, DDP over gloo
    if not prec.on_cpu:
        try:
            strategy = resolve_strategy(cfg)
        except (PlanError, SpecError) as exc:
            raise ConfigError(str(exc)) from None
        distributed.write_accelerate_config(cfg, home, strategy, prec)
    handed = {
        "checkpoint": str(checkpoint) if checkpoint else None,
        "new_hyperparameters": new_hyperparameters,
        "strategy": strategy,
    }
    world = distributed.world_size(cfg)
    print(f"distributed: {world} processes, {strategy}", flush=True)
    sampler = _gpu_sampler(home)  # every GPU, and the memory of this process's tree: every rank
    try:
        config = Path(config or run_dir / rundir.CONFIG)
        failed = ranks.supervise(cfg, config, run_dir, home, not prec.on_cpu, handed, stop)
    finally:
        sampler.stop()
    if rundir.folder_identity(run_dir) != identity:
        raise rundir.RunGone(f"the run folder {run_dir} was deleted or replaced while the run trained.")
    if failed:
        raise TrainError(failed)
    status = read_status(run_dir) or {}
    step = status.get("step") if isinstance(status.get("step"), int) else 0
    return {"state": status.get("state"), "step": step, "processes": world, "device": prec.device.label}


def _run_machine(
    cfg: dict, config_path, run_dir: Path, resume: bool, stop, keep_lock: bool, announce
) -> dict:
    """Machine K > 0 of a run on several machines: start and watch this machine's ranks. The main machine owns the
    run directory (its status, metrics and checkpoints, written by global rank 0); this one owns
    <run>/machines/machine-K/ (lock, pid, status, its accelerate.yaml), so that on shared storage the machines
    never write each other's files, and on a disk of its own it has a folder to report into."""
    k = cfg["distributed"]["machine_rank"]
    home = machine_folder(run_dir, k)
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise rundir.RunRefused(f"--run-dir {run_dir} cannot be created ({exc.strerror}).") from None
    try:
        lock_fd = procs.adopt_claim() or procs.claim(home, label=f"machine {k} of run {run_dir.name}")
    except procs.Busy as exc:
        raise rundir.RunBusy(str(exc)) from None
    try:
        procs.write_pid_info(home)
        if announce:
            announce(run_dir)
        write_status(home, state="running", reason=None, machine=k, started=time.time(), ended=None)
        prec = choose_precision(cfg)
        checkpoint = rundir.latest_checkpoint(run_dir) if resume else None  # the main machine's choice, read
        print(f"machine {k} of {cfg['distributed']['num_machines']}: ranks of {run_dir}", flush=True)
        summary = _supervise(cfg, run_dir, prec, checkpoint, False, stop or StopFlag(), home, config_path)
        write_status(home, state="finished", reason=None)
        return {**summary, "state": "finished"}
    finally:
        if not keep_lock:
            procs.disown(home, lock_fd)


def _run_rank(config_path, run_dir: Path, handed: dict, stop: StopFlag | None) -> dict:
    """One rank of a run its supervisor set up (the config file it reads says what trains from here, the
    checkpoint is handed down): data, model and trainer, train, finish. Writes nothing but rank 0's run files."""
    import torch

    quiet_progress_bars()
    stop = stop or StopFlag().install()
    cfg = sources.pinned(load_config(config_path), run_dir)  # its supervisor fetched the Hub ids
    identity = rundir.folder_identity(run_dir)
    prec = choose_precision(cfg)
    if not prec.on_cpu:  # each rank its own GPU, before the model lands on one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    checkpoint = Path(handed["checkpoint"]) if handed.get("checkpoint") else None
    new_hyperparameters = bool(handed.get("new_hyperparameters"))
    return _train_and_finish(cfg, prec, run_dir, checkpoint, False, stop, identity, new_hyperparameters)


def _setup_run(cfg: dict, run_dir: Path, resume: bool, smoke: bool, start):
    """(precision, checkpoint to resume from, whether the resume changed training keys), with the run dir owned:
    unusable newer checkpoints moved aside, config.yaml saying what trains from here (a changed config of a resume
    keeps the old one in config.history/), plan.json, status "starting"."""
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
            f" with changed {', '.join(changed)} (previous config: {rundir.CONFIG_HISTORY}/)"
            if changed
            else ""
        )
        print(f"resume: from {checkpoint.name}{note}", flush=True)
    elif resume:
        print("resume: no checkpoint in checkpoints/ yet: starting from step 0", flush=True)
    if not smoke:
        truncate_metrics(run_dir, rundir.checkpoint_step(checkpoint) if checkpoint else 0)
    prec = choose_precision(cfg)
    _write_plan(cfg, run_dir, prec, smoke)
    status = {"state": "starting", "reason": None, "step": 0, "max_steps": None, "ended": None}
    before = read_status(run_dir)
    launched = (before or {}).get("state") == "starting" and isinstance(
        (before or {}).get("started"), (int, float)
    )
    if before is None or not (resume or launched):  # a launcher's start time stays: Elapsed never goes back
        status["started"] = time.time()
    status.update(phase="loading the model", phase_started=time.time())
    rundir.reserve_space(run_dir)  # so that a full disk can still be reported as such
    write_status(run_dir, device=prec.device.label, precision=prec.dtype, smoke=smoke, **status)
    print(
        f"device: {prec.device.label}  weights: {prec.dtype}  bf16: {prec.bf16}  fp16: {prec.fp16}",
        flush=True,
    )
    for note in prec.notes:
        print(f"note: {note}", flush=True)
    return prec, checkpoint, any(k.startswith("training.") for k in changed)


def _train(
    cfg,
    prec,
    run_dir: Path,
    tokenizer,
    train_ds,
    eval_ds,
    checkpoint,
    smoke: bool,
    stop: StopFlag,
    identity=None,
    new_hyperparameters: bool = False,
):
    """(trainer, callback, smoke peak, (seconds, CPU seconds)): the model and its trainer built, trained, with the
    GPU sampler running beside it."""
    method, t = methods.get(cfg), cfg["training"]
    # one process samples its GPU; the ranks of a run on several are sampled by their supervisor
    sampler = _gpu_sampler(run_dir) if ranks.spec() is None else None
    collator = vision.collator(tokenizer, cfg, smoke) or (
        method.smoke_collator(tokenizer.pad_token_id, t.get("max_length")) if smoke else None
    )
    samples_per_step = (
        method.smoke_batch(cfg)
        if smoke
        else t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] * ranks.world()
    )
    callback = make_run_callback(  # checkpoints record the config with its Hub ids, not their cache folders
        run_dir,
        stop,
        smoke,
        prec.device.label,
        samples_per_step,
        identity=identity,
        config=sources.recorded(cfg),
    )
    _one_card(prec)
    try:
        try:
            model = load_model(cfg, prec)
        except (OSError, ValueError) as exc:  # a folder that passed the checks but still does not load
            raise ConfigError(
                f"model.path: {cfg['model']['path']} does not load ({error_line(exc)})."
            ) from None
        if ranks.is_main():
            rundir.write_phase(run_dir, "building the trainer")
        trainer = make_trainer(
            cfg,
            prec,
            model,
            tokenizer,
            train_ds,
            eval_ds,
            run_dir=run_dir,
            smoke=smoke,
            collator=collator,
            # the samples first: their generation is evaluation time, which the run callback keeps out of tokens/s
            callbacks=[
                *samples_callbacks(cfg, run_dir, tokenizer, eval_ds, smoke),
                *early_stopping_callbacks(cfg, eval_ds, smoke),
                callback,
            ],
            report_to=trackers.route(cfg, run_dir, smoke),
        )
        if checkpoint and new_hyperparameters:
            keep_new_hyperparameters(trainer)
        if hasattr(trainer.model, "print_trainable_parameters"):
            trainer.model.print_trainable_parameters()
        with measure_peak(trainer, method.measure_phases) if smoke else contextlib.nullcontext({}) as peak:
            t0, cpu0 = time.perf_counter(), time.process_time()
            try:
                trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
            except RewardError as exc:  # a GRPO reward function failed: its name, the row and the error
                raise TrainError(str(exc)) from None
            except OSError:
                # a writer into the folder (TensorBoard's, on its own thread) met it deleted, or half deleted (rmtree
                # still running: the folder keeps its identity), before the callback's next look: the folder's fate
                # is the reason, not the writer's FileNotFoundError. A moment lets a deletion under way finish.
                deadline = time.monotonic() + 2
                while not callback._check_folder(None) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if callback.gone:
                    raise rundir.RunGone(callback.gone) from None
                raise
            seconds = (time.perf_counter() - t0, time.process_time() - cpu0)
    finally:
        if sampler is not None:
            sampler.stop()
        callback.close()
    return trainer, callback, peak, seconds


def _one_card(prec: Precision) -> None:
    """A run on one process trains on one card. One that sees several (CUDA started in this process before
    run_training could pin its card: distributed.pin_gpus) is refused: the Trainer would wrap it in nn.DataParallel
    over all of them, with another batch and memory the plan does not describe."""
    if ranks.spec() is not None or prec.device.kind != "cuda":
        return
    import torch

    if torch.cuda.device_count() > 1:
        raise TrainError(
            f"this process sees {torch.cuda.device_count()} CUDA GPUs and would spread one process over all of "
            "them (nn.DataParallel): CUDA started before the run could pick its card; start it with "
            "CUDA_VISIBLE_DEVICES set to one GPU, or set distributed.gpus to train on several."
        )


def save_final(trainer, tokenizer, run_dir: Path, cfg: dict) -> Path:
    """The adapter (peft format) + tokenizer into DIR/adapter, written to a temp folder then renamed."""
    import shutil

    name = rundir.ADAPTER if cfg["lora"]["enabled"] else rundir.MODEL
    final, tmp = run_dir / name, run_dir / f".{name}.tmp"
    if ranks.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    if ranks.world() > 1:
        # every rank takes part (FSDP gathers the shards); the Trainer writes on rank 0 alone
        trainer.save_model(str(tmp))
        if not ranks.is_main():
            return final
        (tmp / "training_args.bin").unlink(missing_ok=True)  # a pickle, and no part of an adapter
    else:
        trainer.model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if cfg["lora"]["enabled"]:
        from core.merge.fingerprint import record_base  # the merge engine imports torch: not at module level

        record_base(tmp, cfg["model"]["path"])  # the base weights it was trained on, checked when merged
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def report_failure(run_dir: Path, reason: str, smoke: bool) -> None:
    """failed + reason into status.json (and into smoke.json for a smoke test); a rank of a run on several
    processes tells its supervisor instead (its rank record), which writes the run's end."""
    if not run_dir.is_dir():
        return
    if ranks.spec() is not None:
        ranks.end_rank(run_dir, "failed", reason)
        return
    if smoke:
        rundir.write_smoke(run_dir, {"state": "failed", "reason": reason, "time": time.time()})
    write_status(run_dir, state="failed", reason=reason)
