"""Train a run config into a run folder, or check it and print its plan without training (`--dry-run`).

`python -m core.train run.yaml --run-dir DIR [--resume] [--smoke]` (`lora-cockpit train ...`): the trainer as a program.

Exit codes: 0 finished or stopped, 2 bad input (a config, data or run folder problem, or a resume the checkpoint
cannot take: one sentence), 1 training failed (or its run folder was deleted under it). Signals: SIGTERM (or
Ctrl+C) saves a checkpoint at the end of the current step and exits as `stopped`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

from core import diskfull, fmt, procs, rundir
from core.estimate.from_config import plan_json, write_accelerate_config
from core.estimate.plan import PlanError
from core.estimate.specs import SpecError
from core.precision import Device
from core.recipe.config import ConfigError, load_config
from core.recipe.data import DataError
from core.train import ranks
from core.train.preflight import check_model, prepare_run
from core.train.run import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_STOPPED,
    ConfigRefused,
    TrainError,
    machine_rank,
    report_failure,
    run_training,
)
from core.train.smoke import smoke_line
from core.train.state import StopFlag
from core.train.supervise import machine_folder


def dry_run(
    config_path: str, gpu_gb: float | None = None, device: str | None = None, run_dir: str | None = None
) -> int:
    """Everything a launch checks, without a model's weights: the config, the data against the tokenizer and the
    model config, the data tokenized, the libraries' own classes built from the config, and the plan. Prints the
    plan as JSON. With `run_dir`, a config on several GPUs also gets the accelerate config its launch uses:
    run_dir/accelerate.yaml."""

    try:
        cfg = load_config(config_path)
        problem = check_model(cfg["model"]["path"])
        if problem:
            raise ConfigError(problem)
        # what the run checks before it makes its folder (planned for another device: as the config says)
        prepare_run(cfg, None if device else Device.local(), file=sys.stderr)
        plan = plan_json(cfg, gpu_gb, device)
        try:
            written = write_accelerate_config(cfg, run_dir, gpu_gb) if run_dir else None
        except OSError as exc:  # not the model folder's fault: say which path
            raise ConfigError(
                f"--run-dir {run_dir}: accelerate.yaml cannot be written there ({exc.strerror or exc}); give a "
                "folder (or a new name) for the run."
            ) from None
        if written:
            print(f"accelerate config: {written}", file=sys.stderr, flush=True)
    except (ConfigError, DataError, PlanError, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except (OSError, ValueError) as exc:  # the model folder's config.json could not be read
        print(f"error: model.path: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if plan.get("peak_phase") == "eval":  # the first evaluation is where such a run runs out of memory
        print(eval_peak_note(cfg, plan), file=sys.stderr, flush=True)
    print(json.dumps(plan, indent=1, default=str), flush=True)
    return 0


def eval_peak_note(cfg: dict, plan: dict) -> str:
    """One sentence when the evaluation phase is the plan's peak: its moment and the largest eval batch that fits."""
    from core.estimate.fit import eval_batch_for_config

    ev = plan["evaluation"]
    fits = eval_batch_for_config(cfg, plan["gpu_bytes"] / 2**30, plan["plan"].get("device", "cuda"))
    return (
        f"plan: the peak is the evaluation phase ({ev['moment']} of an eval batch of {ev['rows']}: "
        f"{ev['bytes'] / 2**30:.2f} GiB of tensors); the largest per_device_eval_batch_size that fits is {fits}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=fmt.command("train"), description=fmt.summary(__doc__))
    parser.add_argument("config", help="run config YAML (its keys: docs/run-config.md)")
    parser.add_argument(
        "--run-dir",
        help="the run directory to write into (with --dry-run: only a config on several GPUs writes there, its "
        "accelerate.yaml)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in the run dir"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one step at the smallest batch size (1; KTO 2): measure peak memory",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, run the data preflight and print the plan (plan.json's object); no training",
    )
    parser.add_argument(
        "--gpu-gb", type=float, help="plan for a card of this many GiB (default: this machine's)"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="with --dry-run: plan for this device (default: the one this machine trains on)",
    )
    parser.add_argument(
        "--machine-rank",
        type=int,
        help="a run on several machines: this machine's rank (over distributed.machine_rank; a SLURM script passes "
        "$SLURM_NODEID)",
    )
    parser.add_argument(
        "--main-process-ip", help="a run on several machines: the main machine's address (over the config's)"
    )
    stop = StopFlag().install()  # first thing: a stop during the slow imports must not kill us mid-write
    args = parser.parse_args(argv)
    procs.enter_start_folder()  # launched from the app or a tool: relative paths start where the user typed them
    if ranks.spec() is not None:  # one rank of a run on several processes (core.train.ranks)
        ranks.become_rank(Path(args.run_dir))
    if args.dry_run:
        return dry_run(args.config, args.gpu_gb, args.device, args.run_dir)
    if not args.run_dir:
        print("error: give --run-dir DIR (the folder the run writes into), or --dry-run.", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = Path(args.run_dir)
    mode = " (smoke test)" if args.smoke else " (resume)" if args.resume else ""

    def announce(folder: Path) -> None:  # once the folder is this run's: never before a refusal
        print(f"core.train: pid {os.getpid()} training {folder}{mode}", file=sys.stderr, flush=True)

    machine = {"machine_rank": args.machine_rank, "main_process_ip": args.main_process_ip}
    if not args.smoke and machine_rank(args.config, machine) > 0:
        # a machine other than the main one reports into its own folder, never over the run's status
        home = machine_folder(run_dir, machine_rank(args.config, machine))
    else:
        home = run_dir
    try:
        summary = run_training(
            args.config,
            run_dir,
            resume=args.resume,
            smoke=args.smoke,
            stop=stop,
            keep_lock=True,
            machine=machine,
            announce=announce,
        )
    except (rundir.RunRefused, rundir.RunBusy, ConfigRefused) as exc:  # nothing was written: touch nothing
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except rundir.RunGone as exc:  # the folder was deleted or replaced under us: write nothing anywhere
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except (ConfigError, DataError, TrainError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        report_failure(home, str(exc), args.smoke)
        return EXIT_BAD_INPUT if isinstance(exc, (ConfigError, DataError)) else EXIT_FAILED
    except Exception as exc:
        # the status first: on a full disk stderr.log cannot take the traceback, and the reason must still say why
        if diskfull.is_disk_full(exc, run_dir if run_dir.is_dir() else None):
            reason = diskfull.disk_full_reason(run_dir.resolve(), exc)
        else:
            reason = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            report_failure(home, reason, args.smoke)
        with contextlib.suppress(OSError):
            traceback.print_exc()
            print(f"error: {reason}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    if ranks.spec() is not None:
        ranks.end_rank(run_dir, summary["state"])
    print(f"run {summary['state']} at step {summary['step']}", flush=True)
    if args.smoke:
        print(smoke_line(summary.get("smoke") or {}), flush=True)
    return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
