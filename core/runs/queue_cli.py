"""`python -m core.runs queue add|list|rm|move|resume` (`lora-cockpit queue ...`): the run queue from the terminal
(core.runs.queue).

python -m core.runs queue add run.yaml [--name N]     # a run config, or a sweep (its `sweep:` section)
python -m core.runs queue list [--json]               # `ls` is accepted too
python -m core.runs queue rm ID
python -m core.runs queue move ID --to K
python -m core.runs queue resume                      # start the supervisor again (after a reboot, a pause)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from core.files import YamlError, read_yaml
from core.fmt import command, mem
from core.recipe.config import ConfigError
from core.runs import queue as Q
from core.runs import sweep as S
from core.runs.supervisor import ensure_running
from core.workspace import WorkspaceError, suggest_run_name

EXIT_BAD_INPUT = 2


def add_arguments(
    parser: argparse.ArgumentParser, parents: list[argparse.ArgumentParser] | None = None
) -> None:
    """The queue's verbs under `parser`; `parents`: flags every verb takes (core.runs' --workspace)."""
    sub = parser.add_subparsers(dest="queue_command", required=True, metavar="{add,list,rm,move,resume}")
    parents = list(parents or [])
    p = sub.add_parser(
        "add", parents=parents, help="queue a run config (or each point of its sweep: section)"
    )
    p.add_argument("config", help="run config YAML")
    p.add_argument(
        "--name", help="the run's name (a sweep's points: NAME-1, NAME-2, ...); default: the file's name"
    )
    # `list` as on the runs and the Hub (one verb per action); `ls`, what it was, still works
    p = sub.add_parser("list", aliases=["ls"], parents=parents, help="the queue, in order")
    p.add_argument("--json", action="store_true", help="a JSON list of entry objects (a stable format)")
    p = sub.add_parser("rm", parents=parents, help="cancel a waiting entry")
    p.add_argument("id")
    p = sub.add_parser("move", parents=parents, help="move a waiting entry to another place")
    p.add_argument("id")
    p.add_argument("--to", type=int, required=True, help="1 = the next to start")
    sub.add_parser(
        "resume",
        parents=parents,
        help="start the supervisor again (after a restart, or a pause on a full disk)",
    )


def run(args, workspace: Path) -> int:
    try:
        return _COMMANDS[args.queue_command](args, workspace)
    except (Q.QueueError, S.SweepError, ConfigError, WorkspaceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _add(args, workspace: Path) -> int:
    try:
        raw = read_yaml(args.config)
    except YamlError as exc:
        raise ConfigError(str(exc)) from None
    stem = args.name or suggest_run_name(Path(args.config).stem)
    lines, queued = [], 0
    for p in S.enqueue(workspace, raw, stem):
        where = f" ({S.label(p['point'])})" if p["point"] else ""
        if p["entry"] is None:
            lines.append(f"{p['name']}{where}: not queued, does not fit ({_fraction(p['plan'])})")
        else:
            queued += 1
            lines.append(
                f"{p['entry'].id}  {p['name']}{where}: queued, {p['plan'].get('verdict')} ({_fraction(p['plan'])})"
            )
    print("\n".join(sorted(lines, key=lambda line: "not queued" in line)))
    if not queued:
        print(f"error: nothing was queued from {args.config}: no point fits this machine.", file=sys.stderr)
        return EXIT_BAD_INPUT
    pid = ensure_running(workspace)
    if pid:
        print(f"supervisor: pid {pid} ({command('queue')} list to follow)")
    return 0


def _fraction(plan: dict) -> str:
    total, card = plan.get("device_total_bytes") or 0, plan.get("gpu_bytes") or 0
    return f"{mem(total)} of {mem(card)}" if card else mem(total)


HEADER = f"{'ID':<6} {'NAME':<28} {'STATE':<10} {'PLAN':<14} {'PLANNED':>10}  NOTE"


def _ls(args, workspace: Path) -> int:
    state = Q.read_queue(workspace)
    objs = [Q.entry_object(e) for e in state.entries]
    if args.json:
        print(json.dumps(objs, indent=1))
        return 0
    if state.paused:
        print(f"paused: {state.paused}")
    if not objs:
        print(f"the queue of {workspace} is empty ({command('queue')} add run.yaml)")
        return 0
    print(HEADER)
    for o in objs:
        said = [(o["reason"] or "").strip().splitlines()[-1:], [o["diagnosis"]] if o["diagnosis"] else []]
        note = " | ".join(s for part in said for s in part) or (
            S.label(o["sweep"]["values"]) if o["sweep"] else ""
        )
        if o["state"] == "running" and o["started"]:
            note = f"started {time.strftime('%H:%M', time.localtime(o['started']))}"
        planned = mem(o["planned_bytes"]) if o["planned_bytes"] else "-"
        print(
            f"{o['id']:<6} {o['name'][:28]:<28} {o['state']:<10} {o['verdict'] or '-':<14} {planned:>10}  {note}"
        )
    return 0


def _rm(args, workspace: Path) -> int:
    entry = Q.remove(workspace, args.id)
    print(f"{entry.id} ({entry.name}): cancelled")
    return 0


def _move(args, workspace: Path) -> int:
    waiting = Q.move(workspace, args.id, args.to)
    print("waiting, in order: " + ", ".join(f"{e.id} ({e.name})" for e in waiting))
    return 0


def _resume(args, workspace: Path) -> int:
    Q.resume(workspace)
    pid = ensure_running(workspace)
    state = Q.read_queue(workspace)
    if pid:
        print(f"supervisor: pid {pid}")
    elif state.waiting() or state.active():
        print("supervisor: already running")
    else:
        print("nothing waits in the queue")
    return 0


_COMMANDS = {"add": _add, "list": _ls, "ls": _ls, "rm": _rm, "move": _move, "resume": _resume}
