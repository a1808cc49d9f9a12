"""Temporary folders of processes that may be killed (a merge's or an export's work folder): each carries an owner
record (mark_temp), so that a later run removes those whose process is gone (clean_stale_temps) and never one the
user made or one whose process still runs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from core.files import read_json_object
from core.procs import process_start_time, same_process

TEMP_OWNER = ".lora-cockpit-owner"  # the owner record inside a temporary folder (see mark_temp)

_own_temps: set[Path] = set()  # temp folders this process works in now (a server may run two, under one pid)


def mark_temp(folder: str | os.PathLike, marker: str = TEMP_OWNER, **extra) -> None:
    """Write the owner record (this process's pid and start time, plus `extra`) into a temporary folder just
    made, so that clean_stale_temps knows it is ours and whose; unmark_temp once it is renamed or removed."""
    folder = Path(folder)
    me = os.getpid()
    record = {"pid": me, "start_time": process_start_time(me), **extra}
    (folder / marker).write_text(json.dumps(record))
    _own_temps.add(folder.resolve())


def unmark_temp(folder: str | os.PathLike) -> None:
    _own_temps.discard(Path(folder).resolve())


def clean_stale_temps(parent: str | os.PathLike, pattern: str, marker: str = TEMP_OWNER) -> list[Path]:
    """Remove the folders matching `pattern` in `parent` whose owner (the record `marker` inside) is gone.

    Only folders carrying the record are touched, so nothing the user made is ever deleted, and never one whose
    process still runs (in this process: one it still works in)."""
    parent, removed = Path(parent), []
    if not parent.is_dir():
        return removed
    for folder in parent.glob(pattern):
        record_path = folder / marker
        if not record_path.is_file():
            continue
        record = read_json_object(record_path) or {}
        if record.get("pid") == os.getpid():
            running = folder.resolve() in _own_temps
        else:
            running = same_process(record)
        if not running:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
