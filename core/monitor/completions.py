"""Sample completions of a GRPO run with their rewards, for the Monitor's live table.

trl.GRPOTrainer (training.log_completions) writes, at each logging step, the completions it last generated into
<run>/checkpoints/completions/completions_<step>.parquet: columns step, prompt, completion, one column per reward
function (named as TRL logs it) and advantage. They are read like every other log of the run: only the newest
few files, only their first rows, each file parsed once (cached on its size and mtime), and bounded in bytes.
A file TRL is still writing, a broken one or one in the way of a FIFO is skipped and named; the page never breaks.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from core import rundir
from core.files import open_regular
from core.recipe.data import user_text
from core.recipe.rewards import completion_text

# where TRL writes them: <its output_dir, the run's checkpoints/>/completions
COMPLETIONS = f"{rundir.CHECKPOINTS}/completions"
_NAME = re.compile(r"completions_(\d+)\.parquet")
_NOT_REWARDS = frozenset(("step", "prompt", "completion", "advantage"))
TEXT_WIDTH = 400  # characters of a prompt or a completion the table shows


@dataclass
class Completions:
    """What the table shows: rows newest step first, the reward functions' columns, and what was left out."""

    rows: list[dict] = field(default_factory=list)  # step, prompt, completion, <each reward>, advantage
    rewards: list[str] = field(default_factory=list)
    files: int = 0  # completion files in the folder
    skipped: list[str] = field(default_factory=list)  # "<file>: <why>", one sentence each


class CompletionsReader:
    """Keep one per run (the Monitor's RunWatcher does); `read()` each tick costs a directory listing when nothing
    new was written. `files`: the newest files read; `rows`: the rows read from each; `max_bytes`: a file larger
    than that (on disk, or once decompressed) is skipped."""

    def __init__(self, run_dir: str | os.PathLike, files: int = 3, rows: int = 32, max_bytes: int = 16 << 20):
        self.folder = Path(run_dir) / COMPLETIONS
        self.files, self.rows, self.max_bytes = files, rows, max_bytes
        self._cache: dict[str, tuple[tuple, tuple[list[dict], list[str]] | str]] = {}

    def read(self) -> Completions | None:
        """The newest completions, or None when the run logs none (no completions folder)."""
        try:
            with os.scandir(self.folder) as it:
                found = [(int(m.group(1)), e) for e in it if (m := _NAME.fullmatch(e.name))]
        except FileNotFoundError:
            return None
        except OSError as exc:  # not a folder, no permission: said, not raised
            return Completions(skipped=[f"{self.folder}: cannot be listed ({exc.strerror or exc})."])
        found.sort(key=lambda x: x[0], reverse=True)
        out = Completions(files=len(found))
        newest = found[: self.files]
        for _, entry in newest:
            got = self._file(entry)
            if isinstance(got, str):
                out.skipped.append(f"{entry.name}: {got}")
                continue
            out.rows.extend(got[0])
            out.rewards += [name for name in got[1] if name not in out.rewards]
        self._cache = {k: v for k, v in self._cache.items() if k in {e.name for _, e in newest}}
        return out

    def _file(self, entry: os.DirEntry) -> tuple[list[dict], list[str]] | str:
        """The file's rows, or why it was skipped (one sentence); cached until its size or mtime changes."""
        try:
            st = entry.stat()
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})."
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._cache.get(entry.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        got = self._parse(Path(entry.path), st)
        self._cache[entry.name] = (key, got)
        return got

    def _parse(self, path: Path, st: os.stat_result) -> tuple[list[dict], list[str]] | str:
        """(rows, the reward functions' columns: the numeric ones besides step and advantage), or why not."""
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file."
        if st.st_size > self.max_bytes:
            return f"{st.st_size:,} bytes, more than the {self.max_bytes:,} the table reads."
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            fd = open_regular(path)
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})."
        with os.fdopen(fd, "rb") as fh:
            try:
                pf = pq.ParquetFile(fh)
                meta = pf.metadata
                unpacked = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
                if unpacked > 8 * self.max_bytes:
                    return f"{unpacked:,} bytes once decompressed, more than the table reads."
                names = [
                    f.name
                    for f in pf.schema_arrow
                    if f.name not in _NOT_REWARDS
                    and (pa.types.is_floating(f.type) or pa.types.is_integer(f.type))
                ]
                if meta.num_rows == 0:
                    return [], names
                batch = next(pf.iter_batches(batch_size=self.rows))
            except (pa.ArrowException, OSError, ValueError, StopIteration) as exc:
                # TRL writes the file in place: a file being written reads as a broken one until it is complete
                return f"not a readable parquet file yet (being written, or damaged: {str(exc)[:120]})."
        return [_row(r, names) for r in batch.to_pylist()[: self.rows]], names


def _row(raw: dict, rewards: list[str]) -> dict:
    step = raw.get("step")
    row = {
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
        "prompt": _short(_prompt_text(raw.get("prompt"))),
        "completion": _short(completion_text(raw.get("completion"))),
    }
    for name in rewards:  # a function that returned None for a completion: no score, shown as such
        row[name] = _number(raw.get(name))
    row["advantage"] = _number(raw.get("advantage"))
    return row


def _prompt_text(prompt) -> str:
    """What was asked: a conversation's user turn, or the prompt's text."""
    if isinstance(prompt, list):
        return str(user_text([m for m in prompt if isinstance(m, dict)]) or "")
    return str(user_text(prompt) if isinstance(prompt, str) else (prompt if prompt is not None else ""))


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN: no score
        return None
    return float(value)


def _short(text: str) -> str:
    return text if len(text) <= TEXT_WIDTH else text[: TEXT_WIDTH - 1] + "…"
