"""The one set of formatters for sizes and durations (the pages, the CLIs and the messages use these)."""

from __future__ import annotations

import re

GiB, MiB, KiB = 2**30, 2**20, 2**10
GB, MB, KB = 2**30, 2**20, 2**10  # file sizes as the merge and GGUF exports have always reported them


def gib(b: float, digits: int = 2, width: int = 0) -> str:
    """Memory in GiB: "12.34 GiB" (`width` pads the number, for tables)."""
    return f"{b / GiB:{width}.{digits}f} GiB"


def mem(b: float) -> str:
    """Memory in the unit that reads best: GiB from a tenth of one, else MiB ("37.8 MiB", not "0.04 GiB")."""
    return gib(b) if b >= GiB / 10 else f"{b / MiB:.1f} MiB"


def nbytes(n: float) -> str:
    """Any byte count in binary units that read best: "512 B" (not "0 KiB"), "1.5 KiB", "37.8 MiB", "1.25 GiB"."""
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div:
            return f"{n / div:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def disk(n: float) -> str:
    """A file's size: "1.25 GB", "3.4 MB"; small files are not "0.0 MB"."""
    if n >= 0.1 * GB:
        return f"{n / GB:.2f} GB"
    if n >= 0.1 * MB:
        return f"{n / MB:.1f} MB"
    return f"{n / KB:.1f} KB" if n >= KB else f"{int(n)} B"


def duration(seconds: float | None) -> str | None:
    """h:mm:ss (or m:ss under an hour); None for no duration."""
    if seconds is None:
        return None
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def first_sentence(reason: str | None, empty: str = "No reason recorded.") -> str:
    """A status reason's first line as a sentence: capitalised ("loss became NaN at step 9" from the trainer reads
    "Loss became NaN at step 9"), `empty` when there is none. For the pages that show one line of a reason."""
    line = next((ln.strip() for ln in (reason or "").splitlines() if ln.strip()), "")
    return line[:1].upper() + line[1:] if line else empty


def error_line(exc: BaseException, limit: int = 300) -> str:
    """A library exception as one line for a message, or its type's name when it says nothing. A message on
    several lines keeps them (joined, bullets and blank lines dropped): transformers says "...but found" and lists
    what it found on the lines below, and that list is the part the user needs. At most `limit` characters, cut
    at a word."""
    lines = [_BULLET.sub("", ln.strip()) for ln in str(exc).splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    for i, ln in enumerate(lines[1:]):
        # a line that ends mid-sentence ("but found") introduces the next; items after it are a list
        text += " " if text.endswith((":", ",", ";", ".", "!", "?")) else ("; " if i else ": ")
        text += ln
    if len(text) > limit:
        cut = text.rfind(" ", 0, limit - 3)
        text = text[: cut if cut > limit // 2 else limit - 3].rstrip(" ,;:") + "..."
    return text


_BULLET = re.compile(r"^[-*•]\s+")


def run_piped(main) -> int:
    """Run a CLI's `main()` whose output may go to `| head`: a reader that closes the pipe early ends the
    program quietly (no BrokenPipeError trace), as Python's documentation recommends."""
    import os
    import sys

    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(
            os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno()
        )  # the interpreter's last flush goes nowhere
        return 0  # the reader had enough (`| head`): not a failure, so `set -o pipefail` scripts go on
