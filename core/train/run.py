"""Train one run: `python -m core.train run.yaml --run-dir DIR [--resume] [--smoke]`.

An ordinary program (transformers Trainer + peft, bitsandbytes for QLoRA) whose only channel to the outside is
the run directory: status.json (state + reason), metrics.jsonl (one flushed line per log), gpu.jsonl (NVML at
1 Hz), checkpoints/, adapter/, smoke.json. The dashboard, a terminal or another machine run it the same way.

Signals: SIGTERM (or Ctrl+C) saves a checkpoint at the end of the current step and exits with state `stopped`;
`--resume` continues from the newest checkpoint in DIR/checkpoints with the same step count.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from core import procs, rundir
from core.precision import Device
from core.recipe import distributed
from core.recipe.config import ConfigError, load_config, validate_config
from core.recipe.data import DataError
from core.rundir import write_status
from core.train import ranks, sources
from core.train.model import quiet_progress_bars
from core.train.preflight import check_model, prepare_run
from core.train.resume import check_resume
from core.train.state import Run, StopFlag, TrainError
from core.train.steps import setup_run, train_and_finish
from core.train.supervise import run_machine, run_rank, supervise

__all__ = ["ConfigRefused", "StopFlag", "TrainError", "run_training"]

EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED = 2, 1, 0


class ConfigRefused(ConfigError):
    """A config problem found before the run folder was made or locked: nothing was written anywhere."""


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
    (core.train.supervise.run_machine)."""
    rundir.check_run_dir_path(run_dir)  # before resolve(): a dangling link must not name where to create it
    run_dir = Path(run_dir).resolve()
    handed = ranks.spec()
    if handed is not None:  # one rank of a run on several processes: its supervisor owns the folder
        if announce:
            announce(run_dir)
        return run_rank(config_path, run_dir, handed, stop)
    if not smoke and machine_rank(config_path, machine) > 0:
        cfg = checked_config(config_path, machine)
        distributed.pin_gpus(cfg, one_process=False)
        run = Run(cfg=cfg, run_dir=run_dir, stop=stop or StopFlag(), resume=resume)
        return run_machine(run, config_path, keep_lock, announce)
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
        run = Run(cfg=cfg, run_dir=run_dir, stop=stop or _stop_flag(), smoke=smoke, resume=resume, data=data)
        with rundir.folder_held(run_dir):  # a folder re-made after `rm -rf` is told from this one
            return _run_training(run, start)
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


def _run_training(run: Run, start) -> dict:
    """The run as torchtune's recipes do it: set up the run, its data, its model and trainer, train, finish
    (core.train.steps); or, on several processes, supervise the ranks that do (core.train.supervise)."""
    quiet_progress_bars()
    setup_run(run, start)
    if sources.hub_refs(run.cfg).get("data") is not None:
        # prepared from a streamed sample before the download: the run trains on the whole split
        run.data = None
    # Hub ids: fetched (progress in the run folder), then local folders
    run.cfg = sources.for_training(run.cfg, run.run_dir)
    if distributed.world_size(run.cfg) > 1 and not run.smoke:  # a smoke test measures one process's step
        return supervise(run)
    return train_and_finish(run)


def _stop_flag() -> StopFlag:
    """SIGTERM and SIGINT stop the run at the end of a step; a caller's thread other than the main one cannot
    install signal handlers (its caller stops it through the flag)."""
    return StopFlag().install() if threading.current_thread() is threading.main_thread() else StopFlag()


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
