"""The run's experiment trackers (training.report_to): TensorBoard and Trackio, both writing inside the run folder.

The run directory is the only channel between the trainer and whatever watches it, so the engine points each
tracker there (RUN/tensorboard: event files; RUN/trackio: Trackio's local SQLite database) rather than at
transformers' defaults (checkpoints/runs/..., ~/.cache/huggingface/trackio). TensorBoard is installed with the
project; Trackio is optional (`pip install trackio`), and a config that names it where it is missing is refused
with that sentence before anything loads.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import threading
from pathlib import Path

from core import rundir

# The report_to choices the Train form offers; a YAML may name any other integration transformers knows.
CHOICES = ("tensorboard", "trackio", "none")
FOLDERS = {"tensorboard": rundir.TENSORBOARD, "trackio": rundir.TRACKIO}


def named(report_to) -> list[str]:
    """The integrations training.report_to names ("none" and an absent key name none)."""
    if report_to is None:
        return []
    items = [report_to] if isinstance(report_to, str) else list(report_to)
    return [str(i) for i in items if str(i) != "none"]


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def missing(report_to) -> str | None:
    """The sentence refusing a tracker this machine lacks, or None. Checked with the config, so the run does not
    fail with transformers' trace after the model has loaded."""
    for name in FOLDERS:
        if name in named(report_to) and not installed(name):
            return (
                f"training.report_to {name} needs the {name} package, which is not installed here: "
                f"`pip install {name}`, or set training.report_to to none."
            )
    return None


def _quiet_writer_thread(args) -> None:
    """TensorBoard's writer thread keeps its error for the trainer's next flush, which raises it where the engine
    says why (a run folder deleted under the run: core.train.run); printed here as well it would be a second,
    raw traceback."""
    if type(args.thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, OSError):
        return
    _PREVIOUS_HOOK(args)


_PREVIOUS_HOOK = threading.excepthook


def route(cfg: dict, run_dir: str | os.PathLike, smoke: bool) -> str | None:
    """Point the trackers at the run folder (before the trainer is built: transformers reads
    TENSORBOARD_LOGGING_DIR, Trackio TRACKIO_DIR at import); returns the report_to the engine adds when the config
    names none: TensorBoard when it is installed. A smoke test reports nowhere (one step, no run to watch)."""
    if smoke:
        return None
    run_dir = Path(run_dir)
    # set, not setdefault: a folder inherited from another run's environment would mix the two runs' curves
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir / rundir.TENSORBOARD)
    os.environ["TRACKIO_DIR"] = str(run_dir / rundir.TRACKIO)
    threading.excepthook = _quiet_writer_thread
    if "report_to" in cfg["training"]:
        return None
    return "tensorboard" if installed("tensorboard") else "none"


def project(run_dir: str | os.PathLike) -> str:
    """Trackio's project for the run: the run's name (its database is RUN/trackio/<name>.db)."""
    return Path(run_dir).name


def viewers(run_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """(tracker, the command that shows it) for each tracker folder the run wrote, for the Monitor and `runs show`."""
    run_dir = Path(run_dir)
    out = []
    board = run_dir / rundir.TENSORBOARD
    if board.is_dir():
        out.append(("TensorBoard", f"tensorboard --logdir {shlex.quote(str(board))}"))
    track = run_dir / rundir.TRACKIO
    if track.is_dir():
        name = shlex.quote(project(run_dir))
        out.append(("Trackio", f"TRACKIO_DIR={shlex.quote(str(track))} trackio show --project {name}"))
    return out
