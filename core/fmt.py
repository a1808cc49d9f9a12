"""The one set of formatters for sizes and durations (the pages, the CLIs and the messages use these), and how a
tool is named in its usage line and in the hints that tell the user what to type."""

from __future__ import annotations

import os
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


# Set by the `lora-cockpit` command for itself and everything it starts (the app, trainers, jobs): its name, so that
# usage lines and hints name what the user typed; unset, the tools speak as `python -m core.<tool>`.
PROG_ENV = "LORA_COCKPIT_PROG"


def command(tool: str) -> str:
    """What to type to run `tool` (a `lora-cockpit` tool name: runs, queue, train, ...), for usage lines and hints:
    `lora-cockpit runs` under the installed command, else `python -m core.runs` (the queue: `python -m core.runs
    queue`)."""
    prog = os.environ.get(PROG_ENV)
    if prog:
        return f"{prog} {tool}"
    return "python -m core.runs queue" if tool == "queue" else f"python -m core.{tool}"


_SENTENCE_END = re.compile(r"[.!?](?=\s+[^a-z\s]|\s*$)")  # not `core.demo`, not "e.g. the"
_NAMED_AS = re.compile(r"^(?:CLI:\s*)?`[^`]+`(?:\s+and\s+`[^`]+`)?:\s*")


def summary(doc: str | None) -> str:
    """A CLI module's docstring as its --help description: the first sentence of its first paragraph, joined across
    lines (a period inside `core.demo`, a file name or "e.g. the" does not end it), without a leading
    "`python -m core.X`: " that names the command another way."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    para = _NAMED_AS.sub("", para)
    end = _SENTENCE_END.search(para)
    text = para[: end.end()] if end else para
    return text[:1].upper() + text[1:]
