"""A full disk in a run: the space a trainer sets aside (reserve_space) so that its last words -- the final status,
a smoke result -- can still be written on a full disk, and how a full disk is recognised and said (is_disk_full,
disk_full_reason). The run directory's state files (core.rundir) write their last words through write_last_words.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

from core.files import atomic_write_text
from core.fmt import nbytes

RESERVE = ".space-reserve"  # bytes the trainer sets aside so that it can still say "disk full" on a full disk
RESERVE_BYTES = 64 * 1024
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|StorageFull|os error 28\b|Errno 28\b"
)


def reserve_space(run_dir: str | os.PathLike) -> None:
    """Set RESERVE_BYTES aside in the run directory (really allocated, not a sparse file): the last status a trainer
    writes on a full disk (state failed, reason "disk full") is written into the space this frees."""
    path = Path(run_dir) / RESERVE
    with contextlib.suppress(OSError):  # no room even for this: the run fails on its first write, as it would
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError:
            os.write(fd, bytes(RESERVE_BYTES))
        finally:
            os.close(fd)


def release_space(run_dir: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):
        (Path(run_dir) / RESERVE).unlink()


def is_disk_full(exc: BaseException, run_dir: str | os.PathLike | None = None) -> bool:
    """The error is a full disk (or quota): ENOSPC/EDQUOT anywhere in its chain, the libraries' wordings of it
    (safetensors' StorageFull, "os error 28"), or any write error while the run's disk has under 1 MiB free."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if _DISK_FULL_TEXT.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    if run_dir is not None:
        with contextlib.suppress(OSError):
            return shutil.disk_usage(run_dir).free < 1 << 20
    return False


def disk_full_reason(run_dir: str | os.PathLike, exc: BaseException | None = None) -> str:
    """status.json's reason for a run stopped by a full disk: where, how much is free, what to do."""
    free = ""
    with contextlib.suppress(OSError):
        free = f" ({nbytes(shutil.disk_usage(run_dir).free)} free)"
    what = ""
    if exc is not None:
        text = str(exc).strip().splitlines()
        what = f"; {type(exc).__name__}: {text[0][:200]}" if text else f"; {type(exc).__name__}"
    return (
        f"disk full: no space left on the disk that holds {run_dir}{free}{what}. Free space there (or move the "
        "run to a larger disk), then resume the run."
    )


def write_last_words(path: Path, text: str) -> None:
    """An atomic write that ends a run (its final status, a smoke result): on a full disk, the space the trainer set
    aside (reserve_space) is given back and the write tried once more."""
    try:
        atomic_write_text(path, text, parents=False)  # a run folder deleted under its trainer stays deleted
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS or not (path.parent / RESERVE).exists():
            raise
        release_space(path.parent)
        atomic_write_text(path, text, parents=False)
