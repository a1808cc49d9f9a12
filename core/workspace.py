"""The workspace: the one folder the app writes into (run dirs, demo assets, merged models).

Everything the UI or a CLI writes goes under a workspace the user chose; paths coming from the user are
resolved and checked against it before anything is written. One rule for the app and every tool: `--workspace`,
else $LORA_COCKPIT_WORKSPACE, else `./workspace` of the folder the command was started in (never beside the
installed package: that may be a read-only prefix, and a venv's site-packages goes with the venv).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

ENV_VAR = "LORA_COCKPIT_WORKSPACE"
_RUN_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class WorkspaceError(ValueError):
    """A user-facing problem with a path or a name; the message says what to change."""


def default_workspace(given: str | os.PathLike | None = None) -> Path:
    """The workspace, absolute: `given` (a tool's --workspace), else $LORA_COCKPIT_WORKSPACE, else `./workspace`
    of the folder this process works in (the start folder: the app does not leave it, and a child started by
    core.procs.spawn goes back to it)."""
    chosen = given or os.environ.get(ENV_VAR) or "workspace"
    return Path(chosen).expanduser().resolve()


def runs_dir(workspace: str | os.PathLike) -> Path:
    return Path(workspace) / "runs"


def check_run_name(name: str) -> str:
    """Return the run name unchanged if it is safe as a single folder name, else raise with the rule."""
    name = (name or "").strip()
    if not name:
        raise WorkspaceError("Run name is empty: give the run a name such as 'demo-1'.")
    if not _RUN_NAME_OK.match(name) or name in {".", ".."}:
        raise WorkspaceError(
            f"Run name {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..', no spaces)."
        )
    return name


def existing_run_name(name: str, runs: str | os.PathLike) -> str:
    """A name to look an existing run up by: the rule for new names, or any folder name that is already a run
    under `runs` (`core.train --run-dir "runs/my run"` can make one with a space or accents). Never a path."""
    try:
        return check_run_name(name)
    except WorkspaceError:
        plain = name and "/" not in name and "\\" not in name and not name.startswith(".")
        if plain and (Path(runs) / name).is_dir():
            return name
        raise


def suggest_run_name(text: str) -> str:
    """Turn free text into a valid run name (for defaults, never for silently renaming user input)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:64]
    return slug or "run"


def inside(workspace: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Resolve `path` and make sure it lies inside `workspace`; raise otherwise."""
    ws = Path(workspace).expanduser().resolve()
    target = Path(path).expanduser()
    target = (target if target.is_absolute() else ws / target).resolve()
    if target != ws and ws not in target.parents:
        raise WorkspaceError(f"{target} is outside the workspace {ws}: choose a folder inside it.")
    return target


def make_folder(path: Path, what: str = "folder") -> Path:
    """mkdir -p with one sentence instead of a traceback when the workspace cannot hold it (read-only, /proc)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WorkspaceError(
            f"Cannot create the {what} {path} ({exc.strerror or exc}): choose a workspace folder you can write "
            "to in the sidebar (or $LORA_COCKPIT_WORKSPACE)."
        ) from None
    return path


MAKE_WRITABLE = "make it writable (or remount its disk read-write)"


def unwritable(folder: str | os.PathLike, exc: OSError) -> str:
    """Which folder refused a write and why, for the sentence of the action that needed it: "<folder> is
    read-only", "... is not writable by this user", "the disk holding ... is full"."""
    if exc.errno == errno.EROFS:
        return f"{folder} is read-only"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{folder} is not writable by this user"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk holding {folder} is full"
    return f"{folder} cannot be written ({exc.strerror or exc})"
