"""What the Train and Runs pages need beyond the launcher (core.runs): field-by-field checks of a run form, the
planner's estimate for a run config, smoke-test runs kept apart from real runs, and deleting a run.

UI-free like the rest of core: the pages show the sentences these functions return or raise.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from core import liveness, logtail, rundir
from core.fmt import command
from core.recipe import methods
from core.recipe.config import ConfigError, dump_config, field_errors, load_config, validate_config
from core.rundir import LIVE_STATES
from core.runs.launcher import TAIL_LINES, RunError, launch, live_runs, run_state
from core.train.preflight import check_model_folder as check
from core.workspace import (
    MAKE_WRITABLE,
    WorkspaceError,
    check_run_name,
    inside,
    make_folder,
    runs_dir,
    unwritable,
)

SMOKE_DIR = "smoke"  # <workspace>/smoke/<run>-<n>/: one-step runs, not listed among the real runs
# The planner models sdpa and eager; flash/flex attention keep no score matrix either, like sdpa.


# ---- checking a run form --------------------------------------------------------------------------------------


def check_fields(raw: dict) -> dict[str, str]:
    """Every problem of a raw run config, keyed by the field's path ("training.learning_rate"), one sentence each.

    Unlike validate_config (which stops at the first problem) this reports all of them, so a form can show each
    message next to its field. Also checks what validation cannot: the model folder and the data's columns.
    """
    _, errors = field_errors(raw)
    errors = {k: v for k, v in errors.items() if k not in ("model.path", "data.path") or "required" not in v}
    model_path = ((raw or {}).get("model") or {}).get("path")
    if "model.path" not in errors:
        problem = check_model_folder(model_path)
        if problem:
            errors["model.path"] = problem
    data = (raw or {}).get("data") or {}
    # a mix of data.sources: preflight reads each source and names it in each finding
    if not any(k.startswith("data.") for k in errors) and not data.get("sources"):
        problem = check_data_columns(data, (raw or {}).get("method", "sft"))
        if problem:
            errors["data.path"] = problem
    return errors


def check_model_folder(path) -> str | None:
    """None when `path` is a usable local model folder; else what is wrong and how to fix it."""

    return check(path)


def check_data_columns(data_cfg: dict, method: str = "sft") -> str | None:
    """None when the dataset loads and has the columns the run's method needs; else its sentence."""
    if not data_cfg.get("path"):
        return "data.path is empty: give a .jsonl/.json/.csv/.parquet file or a save_to_disk folder."
    return methods.get(method).check_columns(data_cfg)


def check_new_run_name(workspace: str | os.PathLike, name: str) -> str | None:
    """None when `name` can become a new run folder in the workspace; else the reason."""
    try:
        name = check_run_name(name)
        run_dir = inside(workspace, runs_dir(workspace) / name)
    except WorkspaceError as exc:
        return str(exc)
    if run_dir.exists():
        return f"A run named {name!r} already exists in {run_dir.parent}: choose another name."
    return None


# ---- smoke tests ------------------------------------------------------------------------------------------------


def create_smoke_run(workspace: str | os.PathLike, name: str, config: dict) -> Path:
    """A fresh folder <workspace>/smoke/<name>-<n> holding the config for a one-step run (the trainer writes
    its plan.json).

    Kept out of <workspace>/runs so smoke tests do not crowd the Runs page and never block the run name.
    """
    name = check_run_name(name)
    cfg = validate_config(config)
    root = inside(workspace, Path(workspace) / SMOKE_DIR)
    make_folder(root, "smoke-test folder")
    n = 1
    while True:
        run_dir = root / f"{name}-{n}"
        try:
            run_dir.mkdir()  # atomic claim of the folder: two clicks never share one
            break
        except FileExistsError:
            n += 1
    dump_config(cfg, run_dir / rundir.CONFIG)
    return run_dir


def latest_smoke(workspace: str | os.PathLike, name: str) -> Path | None:
    """The newest smoke test of run name `name` (what the Train page reattaches to after a reload)."""
    root = Path(workspace) / SMOKE_DIR
    if not root.is_dir():
        return None
    found = [d for d in root.glob(f"{name}-*") if d.is_dir() and d.name[len(name) + 1 :].isdigit()]
    return max(found, key=lambda d: int(d.name[len(name) + 1 :])) if found else None


def smoke_result(run_dir: str | os.PathLike) -> dict | None:
    """smoke.json, or a failed result for a smoke process that died without one, or None while it runs."""
    run_dir = Path(run_dir)
    result = rundir.read_smoke(run_dir)
    if result is not None:
        return result
    if liveness.live_state(run_dir)[1]:
        return None
    result = rundir.read_smoke(run_dir)  # it may have written just before exiting
    if result is not None:
        return result
    return {
        "state": "failed",
        "reason": "the smoke test ended without a result; stderr.log:\n"
        + logtail.tail_text(run_dir / rundir.STDERR, TAIL_LINES),
    }


def smoke_ran(run_dir: str | os.PathLike, config: dict) -> bool:
    """Whether the smoke test in `run_dir` ran `config` (validated): its result, a failure above all, says nothing
    about other settings, so a page shows it only while its form still holds the config it ran (kept in the
    smoke folder, so a reload or another tab judges it alike)."""
    try:
        return load_config(Path(run_dir) / rundir.CONFIG) == config
    except (ConfigError, OSError):
        return False  # its config is gone or no longer valid (a model folder deleted): not these settings


def start_smoke_test(workspace, name: str, config: dict) -> Path:
    """Create a smoke run and launch it (one step at batch size 1); returns its folder."""
    run_dir = create_smoke_run(workspace, name, config)
    launch(run_dir, smoke=True)
    return run_dir


# ---- a second run beside a live one --------------------------------------------------------------------------


def beside_live_runs(workspace: str | os.PathLike) -> str | None:
    """One sentence when a run of the workspace is training on this machine, where a run launched now would train
    beside it (on one GPU, both can run out of memory); None when none is."""
    live = live_runs(workspace)
    if not live:
        return None
    named = ", ".join(
        f"{r.name} (step {r.step}" + (f" of {r.max_steps})" if r.max_steps else ")") for r in live
    )
    them = "it" if len(live) == 1 else "them"
    return (
        f"{'Run' if len(live) == 1 else 'Runs'} {named} {'is' if len(live) == 1 else 'are'} still training on this "
        f"machine: a run launched now trains beside {them} (on one GPU, both can run out of memory), so add this "
        f"one to the queue to start it when the machine is free, or launch beside {them} if you know it fits."
    )


# ---- deleting a run ---------------------------------------------------------------------------------------------


def delete_run(run_dir: str | os.PathLike, workspace: str | os.PathLike) -> None:
    """Delete a finished, failed or stopped run folder inside <workspace>/runs; refuse anything else.

    The folder is first renamed to a hidden name (one atomic step: it leaves every listing at once), then
    removed, so an interrupted delete never leaves half a run that looks real.
    """
    root = runs_dir(workspace).expanduser().resolve()
    target = Path(run_dir).expanduser().resolve()
    if target.parent != root:
        raise RunError(f"{target} is not a run folder in {root}: only runs of this workspace can be deleted.")
    if not target.is_dir():
        raise RunError(f"Run {target.name} does not exist (already deleted?).")
    info = run_state(target)
    if info.alive or info.state in LIVE_STATES:
        raise RunError(
            f"Run {target.name} is {info.state} (pid {info.pid}): stop it first (Stop on the Monitor page, or "
            f"`{command('runs')} stop {target.name}`), then delete it."
        )
    trash = root / f".deleting-{target.name}-{time.time_ns()}"
    try:
        os.replace(target, trash)
    except OSError as exc:
        raise RunError(
            f"Cannot delete run {target.name}: {unwritable(root, exc)}, so nothing was deleted; {MAKE_WRITABLE} "
            "and delete it again."
        ) from None
    shutil.rmtree(trash, ignore_errors=True)


__all__ = [
    "SMOKE_DIR",
    "check_data_columns",
    "check_fields",
    "check_model_folder",
    "check_new_run_name",
    "create_smoke_run",
    "delete_run",
    "latest_smoke",
    "smoke_result",
    "start_smoke_test",
]
