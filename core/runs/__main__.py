"""List, show, launch, stop, resume and delete runs from the terminal, the same as from the pages.

`python -m core.runs list|show|launch|stop|resume|delete` (`lora-cockpit runs ...`), `queue add|list|rm|move|resume`
(core.runs.queue_cli) and `export NAME --slurm` (an sbatch script for a cluster). The workspace is --workspace,
else $LORA_COCKPIT_WORKSPACE, else ./workspace, as for the app (core.workspace). A run is findable, stoppable and seen
dead at once whatever started it (the page, this command or `python -m core.train`): the trainer holds its run's
lock for its whole life and records its pid and start time (core.procs); a live run that stopped stepping is
listed as stalled.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from core import checkpoints, rundir
from core.files import read_json_object, read_yaml_mapping
from core.fmt import command, first_sentence, mem, run_piped, summary
from core.recipe import methods, mix
from core.recipe.config import field_errors
from core.recipe.mix_config import source_name
from core.runs import queue_cli
from core.runs.admin import check_new_run_name, delete_run
from core.runs.launcher import RunError, RunInfo, create_run, launch, list_runs, run_state, stop_run
from core.workspace import WorkspaceError, default_workspace, existing_run_name, runs_dir

EXIT_BAD_INPUT = 2


def run_object(info: RunInfo) -> dict:
    """What `list --json` / `show --json` print for one run."""
    from core.monitor.tail import JsonlTail
    from core.monitor.watch import run_method

    tail = JsonlTail(info.path / rundir.METRICS)
    method = run_method(info.path)
    wanted = methods.REGISTRY[method].headline if method in methods.REGISTRY else ()
    last: dict[str, float] = {}
    keys = ("loss", *(prefix + key for key, _, _ in wanted for prefix in ("", "eval_")))
    for rec in tail.read_new():
        for key in keys:
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                last[key] = float(value)
    # the method's own figures (a GRPO run's reward, a DPO run's reward accuracy): held-out ones when it evaluated
    source = "eval_" if any("eval_" + key in last for key, _, _ in wanted) else ""
    return {
        "name": info.name,
        "method": method,
        "path": str(info.path),
        "state": info.state,
        "alive": info.alive,
        "pid": info.pid,
        "step": info.step,
        "max_steps": info.max_steps,
        "loss": last.get("loss"),
        "headline": {label: last.get(source + key) for key, label, _ in wanted},
        "headline_source": (source.rstrip("_") or "train") if wanted else None,
        "malformed": tail.malformed,
        "reason": info.reason,
        "stalled_s": info.stalled_s,  # a live run that stopped stepping: seconds since its last step, and why
        "stall": info.stall,
    }


def strict_json(obj) -> str:
    """JSON any parser reads: a diverged loss (inf, NaN) is null there (the run's state and reason say it diverged)."""

    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(obj), allow_nan=False)


def _find(workspace: Path, name: str, leftovers: bool = False) -> Path:
    """The run folder NAME; leftovers: also a folder a start that failed before writing its config left behind
    (status, pid, lock), so that delete can remove it."""
    try:
        name = existing_run_name(name, runs_dir(workspace))
    except WorkspaceError as exc:
        raise RunError(str(exc)) from None
    path = runs_dir(workspace) / name
    if leftovers and path.is_dir() and rundir.is_leftover(path):
        return path
    if not (path / rundir.CONFIG).exists():  # as the listing counts runs: a broken config.yaml is still a run
        known = ", ".join(r.name for r in list_runs(workspace)[:10]) or "none yet"
        raise RunError(f"No run named {name!r} in {runs_dir(workspace)} (runs: {known}).")
    return path


LIST_HEADER = f"{'NAME':<32} {'METH':<4} {'STATE':<9} {'STEP':>11}  {'LOSS':<13} PID"


def _print_run(obj: dict, as_json: bool) -> None:
    if as_json:
        print(strict_json(obj))
        return
    loss = f"{obj['loss']:.4g}" if obj["loss"] is not None else "-"
    pid = obj["pid"] if obj["alive"] else "-"
    method = obj.get("method") or "-"
    stall = f"  stalled: {obj['stall']}" if obj.get("stall") else ""
    figures = "".join(
        f"  {label} {value:.4g}" for label, value in (obj.get("headline") or {}).items() if value is not None
    )
    print(
        f"{obj['name']:<32} {method:<4} {obj['state']:<9} step {obj['step']:>6}  loss {loss:<8} pid {pid}"
        f"{figures}{stall}"
    )
    if obj["reason"] and obj["state"] in ("failed", "stopped"):
        print(f"    {obj['reason'].splitlines()[0]}")


def show_lines(info: RunInfo) -> list[str]:
    """The whole run for `show`: state and process, progress and last figures, why it ended, what it trains (its
    config), its plan and its checkpoints. Every file is read bounded and may be missing or broken."""
    obj = run_object(info)
    raw = read_yaml_mapping(info.path / rundir.CONFIG)
    cfg = field_errors(raw, here=False)[0] if raw else {}  # the library defaults filled in, never raising
    plan = read_json_object(info.path / rundir.PLAN) or {}
    of = f" of {obj['max_steps']}" if obj["max_steps"] else ""
    process = f"pid {obj['pid']}, alive" if obj["alive"] else "no live process"
    lines = [
        f"{obj['name']}: {obj['method'] or '-'} run, {obj['state']} ({process})",
        f"  folder       {obj['path']}",
        f"  step         {obj['step']}{of}"
        + (f", loss {obj['loss']:.4g}" if obj["loss"] is not None else ""),
    ]
    if obj.get("stall"):
        lines.append(f"  stalled      {obj['stall']}")
    if obj["reason"]:
        lines.append(f"  reason       {first_sentence(obj['reason'])}")
    if obj["malformed"]:
        lines.append(f"  metrics      {obj['malformed']} malformed line(s) skipped")
    model, data, lora, t = (
        cfg.get(k) if isinstance(cfg.get(k), dict) else {} for k in ("model", "data", "lora", "training")
    )
    if cfg:
        adapter = f"LoRA r{lora.get('r', '?')}" if lora.get("enabled", True) else "full fine-tune"
        lines += [
            f"  model        {model.get('path', '?')} ({adapter})",
            f"  data         {data.get('path') or _sources_line(data)}",
            f"  training     max_length {t.get('max_length', '?')}, batch {t.get('per_device_train_batch_size', '?')} x "
            f"{t.get('gradient_accumulation_steps', '?')} accumulation, learning rate {t.get('learning_rate', '?')}",
        ]
        d = cfg.get("distributed") if isinstance(cfg.get("distributed"), dict) else {}
        gpus, machines = d.get("gpus", 1), d.get("num_machines", 1)
        if gpus != 1 or machines != 1:
            per = len(gpus) if isinstance(gpus, list) else gpus
            lines.append(
                f"  processes    {per} GPU(s) x {machines} machine(s), strategy {d.get('strategy', 'auto')} "
                f"(ranks/: each rank's record and output)"
            )
    if isinstance(plan.get("device_total_bytes"), (int, float)):
        device = (plan.get("plan") or {}).get("device", "?")
        lines.append(
            f"  plan         {mem(plan['device_total_bytes'])} on {device} ({plan.get('verdict', '?')}), tensor peak "
            f"{mem(plan.get('tensor_peak_bytes') or 0)}"
        )
    lines += mix.drawn_lines(info.path)
    ckpts = checkpoints.checkpoints(info.path)
    newest = ", ".join(c.name for c in ckpts[:3])
    lines.append(f"  checkpoints  {newest + ' (newest first)' if ckpts else 'none yet'}")
    return lines


def _sources_line(data: dict) -> str:
    listed = data.get("sources") if isinstance(data.get("sources"), list) else []
    return f"{len(listed)} sources: " + ", ".join(source_name(s) for s in listed) if listed else "?"


def checked_launch(workspace: Path, name: str, config: str) -> dict:
    """The config of a new run NAME, checked as its trainer checks it before it trains (the data preflight, the
    data tokenized, the libraries' objects: core.train.preflight.prepare_run), so that bad input is refused here,
    before a run folder exists, and not by a run that fails a minute later."""
    from core.precision import Device
    from core.recipe.config import ConfigError, load_config
    from core.recipe.data import DataError
    from core.train.preflight import check_model, prepare_run

    try:
        cfg = load_config(config)
        problem = check_new_run_name(workspace, name) or check_model(cfg["model"]["path"])
        if problem:
            raise RunError(problem)
        prepare_run(cfg, Device.local(), file=sys.stderr)
    except (ConfigError, DataError) as exc:
        raise RunError(str(exc)) from None
    return cfg


def workspace_flag() -> argparse.ArgumentParser:
    """--workspace for every verb, so that it may follow the verb (`runs list --workspace W`) or come before it:
    absent after the verb, it is SUPPRESSed, and so does not wipe out one given before."""
    flag = argparse.ArgumentParser(add_help=False)
    flag.add_argument(
        "--workspace",
        default=argparse.SUPPRESS,
        help="the workspace (default: $LORA_COCKPIT_WORKSPACE, else ./workspace)",
    )
    return flag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command("runs"), description=summary(__doc__))
    parser.add_argument(
        "--workspace", help="the workspace (default: $LORA_COCKPIT_WORKSPACE, else ./workspace)"
    )
    verbs = "{list,show,launch,stop,resume,delete,queue,export}"  # `ls` works too, undocumented here
    sub = parser.add_subparsers(dest="command", required=True, metavar=verbs)
    ws = [workspace_flag()]
    # one verb per action across the tools: `list` (documented), `ls` accepted as on the queue and the Hub
    p = sub.add_parser("list", aliases=["ls"], parents=ws, help="every run, newest first")
    p.add_argument("--json", action="store_true", help="a JSON list of run objects")
    p = sub.add_parser("show", parents=ws, help="one run")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="one run object")
    p = sub.add_parser("launch", parents=ws, help="create a run from a config and start it, detached")
    p.add_argument("config", help="run config YAML")
    p.add_argument("--name", required=True, help="the run's name (its folder under <workspace>/runs)")
    p = sub.add_parser(
        "stop", parents=ws, help="graceful stop: checkpoint, then exit; returns once the process is gone"
    )
    p.add_argument("name")
    p.add_argument("--grace", type=float, default=60.0, help="seconds before SIGKILL (default 60)")
    p = sub.add_parser(
        "resume", parents=ws, help="continue a stopped or failed run from its newest checkpoint"
    )
    p.add_argument("name")
    p = sub.add_parser("delete", parents=ws, help="delete an ended run (never a live one)")
    p.add_argument("name")
    # prog: `lora-cockpit queue add` in its usage lines, not `lora-cockpit runs queue add`
    queue_cli.add_arguments(
        sub.add_parser(
            "queue",
            parents=ws,
            prog=command("queue"),
            help="the run queue: add (a config or a sweep), list, rm, move, resume",
            description="The run queue and sweeps: add a run config (or each point of its sweep), list, rm, "
            "move, resume.",
        ),
        ws,
    )
    p = sub.add_parser(
        "export", parents=ws, help="write a launch script for the run: --slurm, an sbatch file beside it"
    )
    p.add_argument("name")
    p.add_argument(
        "--slurm", action="store_true", required=True, help="<run>/slurm.sbatch (srun, one task a machine)"
    )
    args = parser.parse_args(argv)
    workspace = default_workspace(args.workspace)
    if args.command == "ls":
        args.command = "list"
    if args.command == "queue":
        return queue_cli.run(args, workspace)
    try:
        if args.command == "list":
            objs = [run_object(r) for r in list_runs(workspace)]
            if args.json:
                print(strict_json(objs))
            elif not objs:
                print(f"no runs in {runs_dir(workspace)}")
            else:
                print(LIST_HEADER)
            for obj in [] if args.json else objs:
                _print_run(obj, False)
        elif args.command == "show":
            info = run_state(_find(workspace, args.name))
            if args.json:
                _print_run(run_object(info), True)
            else:
                print("\n".join(show_lines(info)))
        elif args.command == "launch":
            run_dir = create_run(workspace, args.name, checked_launch(workspace, args.name, args.config))
            launch(run_dir)
            print(run_dir)
        elif args.command == "stop":
            state = stop_run(_find(workspace, args.name), grace_s=args.grace)
            print(f"{args.name}: {state}")
        elif args.command == "resume":
            run_dir = _find(workspace, args.name)
            if not checkpoints.checkpoints(run_dir):  # unusable ones: launch names them
                raise RunError(f"Run {args.name} has no checkpoint to resume from yet.")
            launch(run_dir, resume=True)
            print(run_dir)
        elif args.command == "export":
            from core.recipe.config import ConfigError, load_config
            from core.runs.slurm import export_slurm

            run_dir = _find(workspace, args.name)
            try:
                cfg = load_config(run_dir / rundir.CONFIG)
            except ConfigError as exc:
                raise RunError(str(exc)) from None
            try:
                print(export_slurm(run_dir, cfg))
            except OSError as exc:
                raise RunError(str(exc)) from None
        elif args.command == "delete":
            delete_run(_find(workspace, args.name, leftovers=True), workspace)
            print(f"deleted {args.name}")
    except (RunError, WorkspaceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(run_piped(main))
