"""Incremental readers for the run directory's logs, so a refresh tick costs one stat when nothing changed.

- `JsonlTail`: new complete JSON lines of an append-only file (metrics.jsonl, gpu.jsonl). It remembers the
  file's identity (st_dev, st_ino) and its byte offset; a torn last line (the writer is mid-line) is held back
  until its newline arrives; a shrunk or replaced file is read again from the start; malformed lines are skipped
  and counted.
- `TextTail`: the last N lines of a possibly huge log (stderr.log), read only when it changed (core.logtail.tail_text
  reads only its end, and only from a regular file).
- `RunSeries`: column-wise accumulator of metrics and GPU points, fed with only the new records each tick.
"""

from __future__ import annotations

import math
import os
import stat
from array import array
from pathlib import Path

import numpy as np

from core import rundir
from core.files import loads_json, open_regular
from core.logtail import tail_text
from core.monitor.series import DEFAULT_SMOOTHING_STEPS, StepEMA
from core.recipe import methods
from core.rundir import RANK_MEMORY

try:  # 3-4x faster on the first read of a long run; optional. It refuses integers beyond float range itself.
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = loads_json

_FAST_MAX_BRACKETS = 1000
# Large enough to swallow a 100k-line backlog in a few reads, small enough to bound one tick's memory.
_CHUNK = 4 << 20
# Bytes of the file's start remembered to tell a replaced file from a grown one (first line holds a timestamp).
_HEAD = 64


class JsonlTail:
    """Yields each complete JSON-object line of `path` exactly once across calls to `read_new()`.

    Counters for the UI: `malformed` (lines skipped since the last restart), `restarts` (how often the file
    was truncated or replaced), `offset` (bytes consumed).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.identity: tuple[int, int] | None = None
        self.offset = 0
        self.malformed = 0
        self.restarts = 0
        self._size_seen = -1
        self._mtime_seen = -1
        self._head = b""  # the file's first bytes: a replaced file can reuse the old inode number

    def _restart(self, identity):
        if self.identity is not None:
            self.restarts += 1
        self.identity = identity
        self.offset = 0
        self.malformed = 0
        self._head = b""

    def read_new(self) -> list[dict]:
        """New records since the last call; [] when the file is missing or unchanged."""
        try:
            st = os.stat(self.path)
        except OSError:  # missing, or a link loop / a path through a file
            return []
        if not stat.S_ISREG(st.st_mode):
            return []  # a FIFO or a device in its place (/dev/zero never ends): nothing to read, never a hang
        identity = (st.st_dev, st.st_ino)
        # A new inode means the writer replaced the file; a smaller size means it was truncated. Either way
        # the points we hold are from another run of the file: the caller must start over (see `restarted`).
        if identity != self.identity or st.st_size < self.offset:
            self._restart(identity)
        elif st.st_size == self._size_seen and st.st_mtime_ns == self._mtime_seen:
            return []
        self._size_seen, self._mtime_seen = st.st_size, st.st_mtime_ns
        if st.st_size == self.offset:
            return []
        records: list[dict] = []
        try:
            fd = open_regular(self.path)  # replaced by a FIFO since the stat: never block on it
        except OSError:
            return []
        with os.fdopen(fd, "rb") as fh:
            # Guard against a replace between stat and open: read from the inode we actually opened.
            ost = os.fstat(fh.fileno())
            if (ost.st_dev, ost.st_ino) != self.identity:
                self._restart((ost.st_dev, ost.st_ino))
            if self.offset and fh.read(len(self._head)) != self._head:
                # Same inode number and not smaller, but different content: replaced (inode reused) or
                # rewritten in place. Start over.
                self._restart(self.identity)
            fh.seek(self.offset)
            while True:
                chunk = fh.read(_CHUNK)
                if not chunk:
                    break
                end = chunk.rfind(b"\n")
                if end < 0:
                    if len(chunk) < _CHUNK:
                        break  # a torn tail: the writer has not finished this line yet
                    # One line longer than a whole chunk (MiBs): no metrics line is that long. Skip to its end
                    # (counted as malformed) instead of waiting on it for ever.
                    skipped = self._skip_line(fh)
                    if skipped is None:
                        break  # its end is not written yet
                    self.offset += skipped
                    self.malformed += 1
                    fh.seek(self.offset)
                    continue
                self._parse(chunk[: end + 1], records)
                self.offset += end + 1
                if end + 1 < len(chunk):
                    fh.seek(self.offset)
            if len(self._head) < _HEAD:
                fh.seek(0)
                self._head = fh.read(min(_HEAD, self.offset))
        return records

    def _skip_line(self, fh) -> int | None:
        """Bytes from self.offset to just past the next newline, or None when the file ends first."""
        fh.seek(self.offset)
        n = 0
        while True:
            block = fh.read(_CHUNK)
            if not block:
                return None
            i = block.find(b"\n")
            if i >= 0:
                return n + i + 1
            n += len(block)

    def _parse(self, blob: bytes, out: list[dict]):
        for line in blob.split(b"\n"):
            if not line.strip():
                continue
            try:
                # orjson 3.8 overflows its C stack (a segfault) on nesting some 100k deep: such a line goes to
                # json, which raises RecursionError; a metrics line has a handful of brackets
                if line.count(b"[") + line.count(b"{") > _FAST_MAX_BRACKETS:
                    raise ValueError("deep")
                rec = _fast_loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                try:
                    # json.dumps writes NaN/Infinity (a diverged loss); orjson rejects those tokens. Like orjson,
                    # loads_json refuses an integer beyond float range (it would break every float() after).
                    rec = loads_json(line)
                except (ValueError, RecursionError):  # deep nesting overflows json's recursion
                    self.malformed += 1
                    continue
            if isinstance(rec, dict):
                out.append(rec)
            else:
                self.malformed += 1


class TextTail:
    """`tail_text` (core.procs) cached on (identity, size, mtime): an unchanged stderr.log costs one stat per
    tick."""

    def __init__(self, path: str | os.PathLike, n_lines: int = 200, max_bytes: int = 256 * 1024):
        self.path = Path(path)
        self.n_lines, self.max_bytes = n_lines, max_bytes
        self._key = None
        self.text = ""

    def read(self) -> str:
        try:
            st = os.stat(self.path)
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            key = None
        if key != self._key:
            self._key = key
            self.text = tail_text(self.path, self.n_lines, self.max_bytes) if key else ""
        return self.text


class Points:
    """One series as two growable float64 columns (x, y); `arrays()` gives zero-copy numpy views."""

    __slots__ = ("x", "y")

    def __init__(self):
        self.x = array("d")
        self.y = array("d")

    def append(self, x: float, y: float):
        self.x.append(x)
        self.y.append(y)

    def __len__(self):
        return len(self.x)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.x:
            return np.empty(0), np.empty(0)
        return np.frombuffer(self.x, dtype=np.float64), np.frombuffer(self.y, dtype=np.float64)

    def last(self) -> float | None:
        return self.y[-1] if self.y else None


def _num(v) -> float | None:
    """JSON value as float; NaN/inf kept (they are evidence); None for missing or non-numeric."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(
        v, (int, float, str)
    ):  # transformers formats some logged floats as strings ("4.553", "nan")
        try:
            return float(v)
        except (ValueError, OverflowError):  # not a number, or an integer beyond float range
            return None
    return None


METRIC_FIELDS = (
    "loss",
    "eval_loss",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
    "samples_per_s",
    "cuda_allocated",
    "cuda_reserved",
    "cuda_peak",
    "rss_bytes",
    "epoch",
)
# What the methods' trainers log on top (rewards, log-probs, KL: core.recipe.methods; per logging step, their eval
# twins carry the eval_ prefix). An SFT run's lines have none of them: each costs one dict lookup per line there.
METHOD_FIELDS = tuple(name for name in methods.all_metrics() if name not in METRIC_FIELDS)
EVAL_METHOD_FIELDS = tuple(f"eval_{name}" for name in METHOD_FIELDS)
# Training series kept with a smoothed twin (`RunSeries.smoothed`), like the loss.
SMOOTHED_FIELDS = ("loss", *METHOD_FIELDS)
_ALL_FIELDS = METRIC_FIELDS + METHOD_FIELDS + EVAL_METHOD_FIELDS
# A run on several processes: rank 0 writes every other rank's memory as rankK_<name> (core.train.run_callbacks).
MAX_RANKS = 16
RANK_FIELDS = tuple(f"rank{k}_{name}" for k in range(1, MAX_RANKS) for name in RANK_MEMORY)
_RANKS_MARK = "rank1_rss_bytes"  # on every line of such a run
_METHOD_KEYS = frozenset(METHOD_FIELDS + EVAL_METHOD_FIELDS)
_SMOOTHED = frozenset(SMOOTHED_FIELDS)
# Keys named at run time (GRPO: rewards/<function>/mean and /std, core.recipe.methods' metric_families), train and
# eval: looked for only on a line that carries a figure no other method logs (GRPO's reward), so an SFT or DPO line
# never walks its keys for them.
_FAMILIES = tuple(dict.fromkeys(f for m in methods.REGISTRY.values() for f in m.metric_families))
FAMILY_PREFIXES = tuple(dict.fromkeys(p for pre, _ in _FAMILIES for p in (pre, f"eval_{pre}")))
FAMILY_SUFFIXES = tuple(dict.fromkeys(suffix for _, suffix in _FAMILIES))
_FAMILY_MARKS = frozenset(
    name
    for m in methods.REGISTRY.values()
    if m.metric_families
    for own in m.metrics
    if not any(own in o.metrics for o in methods.REGISTRY.values() if o is not m)
    for name in (own, f"eval_{own}")
)
_FIXED = frozenset(_ALL_FIELDS)
GPU_FIELDS = ("memory_used", "memory_total", "utilization", "temperature", "power_w", "process_memory")


class RunSeries:
    """Metrics and GPU samples of one run, column-wise, appended to as new records arrive.

    Metric series are indexed by step (`metrics[name]`, plus `metric_time[name]` with the wall-clock time of
    each point); GPU series by unix time, per GPU index (`gpu[index][field]`). `smoothed[name]` is the smoothed
    curve of each of SMOOTHED_FIELDS that was logged (the training loss, and a DPO run's rewards and log-probs): a
    debiased EMA over `smoothing_steps` training steps (core.monitor.series.StepEMA), kept up to date point by
    point so smoothing never re-walks the history. `ema_loss` is the smoothed loss.
    """

    def __init__(self, smoothing_steps: float = DEFAULT_SMOOTHING_STEPS):
        self.metrics: dict[str, Points] = {}
        self.metric_time: dict[str, Points] = {}
        self.gpu: dict[int, dict[str, Points]] = {}
        self.gpu_other_processes: dict[int, list[dict]] = {}  # latest sample's other processes per GPU
        self.smoothing_steps = smoothing_steps
        self.smoothed: dict[str, Points] = {}
        self._emas: dict[str, StepEMA] = {}
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.last_step: int | None = None
        self.n_metric_records = 0
        self.n_gpu_records = 0
        self.family_names: list[str] = []  # the training keys of metric_families seen, first seen first
        self.source_evals: list[str] = []  # a mix's eval_<source>_loss keys seen, first seen first

    @classmethod
    def from_records(cls, metrics: list[dict] = (), gpu: list[dict] = (), **kw) -> RunSeries:
        s = cls(**kw)
        s.add_metrics(metrics)
        s.add_gpu(gpu)
        return s

    def _point(self, table: dict[str, Points], name: str) -> Points:
        p = table.get(name)
        if p is None:
            p = table[name] = Points()
        return p

    def add_metrics(self, records: list[dict]):
        metrics, times = self.metrics, self.metric_time
        for rec in records:
            step = _num(rec.get("step"))
            if step is None or not math.isfinite(step):
                continue
            t = _num(rec.get("time"))
            self.n_metric_records += 1
            self.last_step = int(step)
            if t is not None:
                self.first_time = t if self.first_time is None or t < self.first_time else self.first_time
                self.last_time = t if self.last_time is None or t > self.last_time else self.last_time
            tt = math.nan if t is None else t
            # a line without any method figure skips their lookups
            names, smooth = (METRIC_FIELDS if _METHOD_KEYS.isdisjoint(rec) else _ALL_FIELDS), _SMOOTHED
            if names is _ALL_FIELDS and not _FAMILY_MARKS.isdisjoint(rec):
                found = self._family_keys(rec)
                names, smooth = names + found, _SMOOTHED.union(k for k in found if not k.startswith("eval_"))
            if "eval_loss" in rec:  # a mix's lines: each source's eval loss too (core.train.eval_sources)
                names = names + self._source_evals(rec)
            for name in names + RANK_FIELDS if _RANKS_MARK in rec else names:
                v = rec.get(name)
                if v is None:
                    continue
                if type(v) is not float:  # the common case skips the conversion call (ints may overflow)
                    v = _num(v)
                    if v is None:
                        continue
                p = metrics.get(name)
                if p is None:
                    p, times[name] = self._point(metrics, name), Points()
                p.x.append(step)
                p.y.append(v)
                q = times[name]
                q.x.append(step)
                q.y.append(tt)
                if name in smooth:
                    self._update_ema(name, step, v)

    def _source_evals(self, rec: dict) -> tuple[str, ...]:
        """An evaluation line's eval_<source>_loss keys, remembered in source_evals (first seen first)."""
        found = tuple(k for k in rec if k.startswith("eval_") and k.endswith("_loss") and k not in _FIXED)
        self.source_evals += [k for k in found if k not in self.source_evals]
        return found

    def _family_keys(self, rec: dict) -> tuple[str, ...]:
        """The run-time named keys of one line (rewards/<function>/mean ...), remembered for set_smoothing."""
        found = tuple(
            k
            for k in rec
            if k.startswith(FAMILY_PREFIXES) and k.endswith(FAMILY_SUFFIXES) and k not in _FIXED
        )
        for k in found:
            if k not in self.family_names and not k.startswith("eval_"):
                self.family_names.append(k)
        return found

    def _update_ema(self, name: str, step: float, v: float):
        # Non-finite values would poison the average forever: they show up in health warnings instead.
        if not math.isfinite(v):
            return
        ema = self._emas.get(name)
        if ema is None:
            ema = self._emas[name] = StepEMA(self.smoothing_steps)
            self.smoothed[name] = Points()
        self.smoothed[name].append(step, ema.update(step, v))

    @property
    def ema_loss(self) -> Points:
        """The smoothed training loss (empty before the first finite loss)."""
        p = self.smoothed.get("loss")
        return p if p is not None else Points()

    def smooth(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, smoothed values) of one of SMOOTHED_FIELDS; empty arrays when it was never logged."""
        p = self.smoothed.get(name)
        return p.arrays() if p else (np.empty(0), np.empty(0))

    def set_smoothing(self, window_steps: float) -> bool:
        """Smooth over another window (in steps); recomputes the curves from the raw points. True if it changed."""
        if window_steps == self.smoothing_steps:
            return False
        self.smoothing_steps, self._emas, self.smoothed = window_steps, {}, {}
        for name in (*SMOOTHED_FIELDS, *self.family_names):
            for step, v in zip(*self.metric(name), strict=True):
                self._update_ema(name, float(step), float(v))
        return True

    def add_gpu(self, records: list[dict]):
        for rec in records:
            t = _num(rec.get("time"))
            if t is None or not math.isfinite(t):
                continue
            idx = rec.get("index", 0)
            idx = idx if isinstance(idx, int) else 0
            self.n_gpu_records += 1
            table = self.gpu.get(idx)
            if table is None:
                table = self.gpu[idx] = {}
            for name in GPU_FIELDS:
                v = rec.get(name)
                if v is None:
                    continue
                if type(v) is not float:
                    v = _num(v)
                    if v is None:
                        continue
                p = table.get(name)
                if p is None:
                    p = self._point(table, name)
                p.x.append(t)
                p.y.append(v)
            others = rec.get("other_processes")
            if isinstance(others, list):
                self.gpu_other_processes[idx] = others

    @property
    def has_preference_metrics(self) -> bool:
        """The run logged what only a preference trainer (DPO, KTO) logs: rewards/*, train or eval."""
        return any(name.startswith(("rewards/", "eval_rewards/")) for name in self.metrics)

    def metric(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        p = self.metrics.get(name)
        return p.arrays() if p else (np.empty(0), np.empty(0))

    def gpu_series(self, name: str, index: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        idx = self.main_gpu() if index is None else index
        p = self.gpu.get(idx, {}).get(name) if idx is not None else None
        return p.arrays() if p else (np.empty(0), np.empty(0))

    def ranks(self) -> int:
        """How many training processes the run's metrics speak of (1 for a run on one process)."""
        k = 1
        while f"rank{k}_rss_bytes" in self.metrics:
            k += 1
        return k

    def gpus_used(self) -> list[int]:
        """The GPUs where the run's process tree holds memory (NVML), lowest first."""
        return [idx for idx in sorted(self.gpu) if len(self.gpu[idx].get("process_memory", ()))]

    def main_gpu(self) -> int | None:
        """The GPU the run uses: the one where the run's process tree holds memory, else the lowest index."""
        if not self.gpu:
            return None
        for idx in sorted(self.gpu):
            if len(self.gpu[idx].get("process_memory", ())):
                return idx
        return min(self.gpu)


class RunFiles:
    """The tails of one run directory's metrics.jsonl and gpu.jsonl feeding one `RunSeries`.

    `poll()` folds new lines in and returns True when anything changed. When a file is truncated or
    replaced the whole series is rebuilt from the files, which stay the source of truth.
    """

    def __init__(self, run_dir: str | os.PathLike, smoothing_steps: float = DEFAULT_SMOOTHING_STEPS):
        self.run_dir = Path(run_dir)
        self.smoothing_steps = smoothing_steps
        self.metrics_tail = JsonlTail(self.run_dir / rundir.METRICS)
        self.gpu_tail = JsonlTail(self.run_dir / rundir.GPU)
        self.series = RunSeries(smoothing_steps)
        self.restarts = 0

    def poll(self) -> bool:
        restarts = self.metrics_tail.restarts + self.gpu_tail.restarts
        new_m = self.metrics_tail.read_new()
        new_g = self.gpu_tail.read_new()
        if self.metrics_tail.restarts + self.gpu_tail.restarts != restarts:
            # One file started over: rebuild both from scratch (simplest correct answer, rare event).
            self.restarts += 1
            self.metrics_tail = JsonlTail(self.metrics_tail.path)
            self.gpu_tail = JsonlTail(self.gpu_tail.path)
            self.series = RunSeries(self.series.smoothing_steps)
            self.series.add_metrics(self.metrics_tail.read_new())
            self.series.add_gpu(self.gpu_tail.read_new())
            return True
        self.series.add_metrics(new_m)
        self.series.add_gpu(new_g)
        return bool(new_m or new_g)

    @property
    def malformed(self) -> int:
        return self.metrics_tail.malformed + self.gpu_tail.malformed
