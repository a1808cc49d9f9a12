"""The merge's one error type, and the JSON reader that raises it. Imports no torch."""

from __future__ import annotations

from pathlib import Path

from core.files import BadFile, load_json_object


class MergeError(ValueError):
    """A user-facing problem with a merge; the message says what is wrong and how to fix it."""


def load_json(path: Path, fix: str) -> dict:
    """The JSON object in `path` (core.files.load_json_object: bounded, regular files only, so a FIFO never
    blocks); a broken file is a MergeError naming it and `fix` (how to repair it)."""
    try:
        return load_json_object(path)
    except BadFile as e:
        raise MergeError(f"{path} {e.why}: {fix}") from None
