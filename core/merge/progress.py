"""A merge's progress: the record the engine reports and the sentence a page shows. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.fmt import disk


@dataclass
class MergeProgress:
    phase: str  # "merge", "verify", "done"
    tensors_done: int
    tensors_total: int
    bytes_written: int
    bytes_total: int
    key: str = ""


ProgressFn = Callable[[MergeProgress], None]


def progress_sentence(progress: dict) -> str:
    """A merge job's progress (core.jobs' run_merge report) in words; before anything is counted it says what it
    is doing, never '0/0 tensors, 0 B of 0 B written'."""
    total, done = progress.get("total") or 0, progress.get("done") or 0
    label = {"merge": "Merging", "verify": "Verifying", "done": "Done"}.get(progress.get("phase"))
    if progress.get("phase") == "preflight":
        return "Preflight passed: the merge starts…"
    if label is None or not total:
        return "Preflight: reading the adapter and the base, checking RAM and disk…"
    return (
        f"{label}: {done}/{total} tensors, {disk(progress.get('bytes_done') or 0)} of "
        f"{disk(progress.get('bytes_total') or 0)} written"
    )
