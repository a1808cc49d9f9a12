"""A run on several processes: the process that keeps the run starts, watches and stops its ranks
(core.train.ranks); a machine other than the main one does the same from its own folder; each rank trains as one
process does (core.train.steps), writing nothing but rank 0's run files."""

from __future__ import annotations

import os
import time
from pathlib import Path

from core import checkpoints, procs, rundir
from core.estimate.from_config import resolve_strategy
from core.estimate.plan import PlanError
from core.estimate.specs import SpecError
from core.recipe import distributed
from core.recipe.config import ConfigError, load_config
from core.rundir import read_status, write_status
from core.train import ranks, sources
from core.train.model import choose_precision, quiet_progress_bars
from core.train.state import Run, StopFlag, TrainError
from core.train.steps import gpu_sampler, train_and_finish


def machine_folder(run_dir: Path, rank: int) -> Path:
    """What a machine other than the main one owns in the run directory (its lock, pid, status and output)."""
    return Path(run_dir) / ranks.MACHINES / f"machine-{rank}"


def supervise(run: Run, home: Path | None = None, config=None) -> dict:
    """This process keeps the run (lock, pid, status) and starts, watches and stops its ranks (core.train.ranks);
    on GPUs through accelerate with <home>/accelerate.yaml. home: the folder this process owns (the run directory;
    its own folder on a machine other than the main one); config: the config file the ranks read (the run's
    config.yaml)."""
    cfg, run_dir, prec = run.cfg, run.run_dir, run.prec
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
        "checkpoint": str(run.checkpoint) if run.checkpoint else None,
        "new_hyperparameters": run.new_hyperparameters,
        "strategy": strategy,
    }
    world = distributed.world_size(cfg)
    print(f"distributed: {world} processes, {strategy}", flush=True)
    sampler = gpu_sampler(home)  # every GPU, and the memory of this process's tree: every rank
    try:
        config = Path(config or run_dir / rundir.CONFIG)
        failed = ranks.supervise(cfg, config, run_dir, home, not prec.on_cpu, handed, run.stop)
    finally:
        sampler.stop()
    if rundir.folder_identity(run_dir) != identity:
        raise rundir.RunGone(f"the run folder {run_dir} was deleted or replaced while the run trained.")
    if failed:
        raise TrainError(failed)
    status = read_status(run_dir) or {}
    step = status.get("step") if isinstance(status.get("step"), int) else 0
    return {"state": status.get("state"), "step": step, "processes": world, "device": prec.device.label}


def run_machine(run: Run, config_path, keep_lock: bool, announce) -> dict:
    """Machine K > 0 of a run on several machines: start and watch this machine's ranks. The main machine owns the
    run directory (its status, metrics and checkpoints, written by global rank 0); this one owns
    <run>/machines/machine-K/ (lock, pid, status, its accelerate.yaml), so that on shared storage the machines
    never write each other's files, and on a disk of its own it has a folder to report into."""
    cfg, run_dir = run.cfg, run.run_dir
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
        run.prec = choose_precision(cfg)
        # the main machine's choice, read; what changed in a resume is its to say
        run.checkpoint = checkpoints.latest_checkpoint(run_dir) if run.resume else None
        print(f"machine {k} of {cfg['distributed']['num_machines']}: ranks of {run_dir}", flush=True)
        summary = supervise(run, home, config_path)
        write_status(home, state="finished", reason=None)
        return {**summary, "state": "finished"}
    finally:
        if not keep_lock:
            procs.disown(home, lock_fd)


def run_rank(config_path, run_dir: Path, handed: dict, stop: StopFlag | None) -> dict:
    """One rank of a run its supervisor set up (the config file it reads says what trains from here, the
    checkpoint is handed down): data, model and trainer, train, finish. Writes nothing but rank 0's run files."""
    import torch

    quiet_progress_bars()
    run = Run(
        cfg=sources.pinned(load_config(config_path), run_dir),  # its supervisor fetched the Hub ids
        run_dir=run_dir,
        stop=stop or StopFlag().install(),
        identity=rundir.folder_identity(run_dir),
        checkpoint=Path(handed["checkpoint"]) if handed.get("checkpoint") else None,
        new_hyperparameters=bool(handed.get("new_hyperparameters")),
    )
    run.prec = choose_precision(run.cfg)
    if not run.prec.on_cpu:  # each rank its own GPU, before the model lands on one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return train_and_finish(run)
