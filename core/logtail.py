"""The end of a process's log (stdout.log, stderr.log), read bounded: never blocks on a FIFO, never fills memory
with a huge or endless file. Stdlib only.
"""

from __future__ import annotations

import os
import stat


def tail_text(path: str | os.PathLike, n_lines: int = 200, max_bytes: int = 256 * 1024) -> str:
    """The last `n_lines` lines of a log file, reading at most its last `max_bytes` bytes; "" when it is missing
    or not a regular file (a FIFO or /dev/zero in its place never blocks nor fills memory).

    A first line cut by the byte limit is dropped; progress bars redrawn with carriage returns keep their last
    state only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        start = max(0, st.st_size - max_bytes)
        data = os.pread(fd, st.st_size - start, start)
    except OSError:
        return ""
    finally:
        os.close(fd)
    if start > 0:
        cut = data.find(b"\n")
        data = data[cut + 1 :] if cut >= 0 else data
    text = data.decode("utf-8", errors="replace")
    lines = [
        ln.rsplit("\r", 1)[-1] if "\r" in ln.rstrip("\r") else ln.rstrip("\r") for ln in text.split("\n")
    ]
    if lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines[-n_lines:])
