"""What the Monitor and Runs pages call: one `RunWatcher.refresh()` per refresh tick, and run summaries.

The run directory is the source of truth. A watcher only caches what it has read (file offsets, the series,
the last chart frames), so a browser reload or a server restart that builds a new watcher re-reads the files
and loses no point. After the first read a tick costs a few stats plus the parsing of new lines; charts are
re-cut only when a file grew.

Chart frames are long-form pandas DataFrames (one row per point: x column, `value`, `series`) with compact
dtypes, ready for `alt.Chart(df).mark_line().encode(x=..., y="value", color="series")`.

A DPO run (config.yaml's `method: dpo`, or metrics that carry TRL's `rewards/*` figures) gets three more charts
beside the loss: its rewards (chosen, rejected, margin), its preference accuracy (train and eval, against the
0.5 of a coin flip) and its log-probs (chosen vs rejected). An SFT run's charts are the same as ever.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from core import liveness, rundir
from core.files import read_json_object, read_yaml_mapping
from core.monitor.advice import stall_warning
from core.monitor.completions import Completions, CompletionsReader
from core.monitor.diagnose import Diagnosis, diagnose, load_evidence
from core.monitor.health import HealthChecker, HealthWarning
from core.monitor.series import downsample_minmax, stride
from core.monitor.tail import RunFiles, RunSeries, TextTail
from core.recipe import methods

GiB = 1024**3


@dataclass
class ChartBudget:
    """Points per series. Extremes matter for raw loss, grad norm, memory and utilisation (min/max kept);
    smooth curves (EMA, learning rate, temperature) are strided. The defaults keep a tick's chart data under
    100 KB as Arrow (see benchmarks/monitor_refresh.py)."""

    spiky: int = 1200
    smooth: int = 400
    sparse: int = 600  # eval loss, torch memory curves (logged every few steps)


@dataclass
class Snapshot:
    run_dir: str
    name: str
    state: str  # starting|running|finished|failed|stopped, "unknown" without status.json, "deleted" when gone
    status: dict | None
    step: int | None
    max_steps: int | None
    progress: float | None  # 0..1
    elapsed_s: float | None
    eta_s: float | None
    steps_per_s: float | None
    tokens_per_s: float | None
    latest: dict[str, float]  # last logged value of each metric (loss, eval_loss, learning_rate, ...)
    # loss, learning_rate, grad_norm (x column "step"); gpu_memory (GiB), gpu_util, gpu_temperature (x "minutes");
    # a DPO run also dpo_rewards, dpo_accuracy, dpo_logps (x "step")
    charts: dict[str, pd.DataFrame]
    lines: dict[str, float]  # horizontal rules in GiB: gpu_capacity_gib, plan_peak_gib, plan_tensor_peak_gib
    peak_memory_gib: float | None
    warnings: list[HealthWarning]
    diagnosis: Diagnosis | None  # when the run failed
    stderr_tail: str
    stdout_tail: str
    other_processes: list[dict]  # other programs on the run's GPU (latest NVML sample)
    malformed_lines: int
    changed: bool  # new points since the previous tick
    method: str | None = None  # "sft", "dpo", ... (see resolve_method); None when no config or metrics tell
    stalled_s: float | None = None  # a live run that stopped stepping: seconds since its last step
    stall: str | None = None  # and why: "no step for 3 min (process stopped)" (core.rundir.stall)
    completions: Completions | None = None  # a GRPO run's newest sample completions and their rewards

    def chart_bytes(self) -> int:
        """Size of the chart data as Arrow IPC (what st.altair_chart ships per rerun)."""
        return sum(frame_bytes(df) for df in self.charts.values())


def frame_bytes(df: pd.DataFrame) -> int:
    import pyarrow as pa

    table = pa.Table.from_pandas(df, preserve_index=False)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.tell()


class _CachedJson:
    """A small JSON file (status.json, plan.json) re-read only when its stat changes."""

    def __init__(self, path: Path):
        self.path, self._key, self.data = path, None, None

    def read(self) -> dict | None:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            key = None
        if key != self._key:
            self._key = key
            self.data = read_json_object(self.path) if key else None
        return self.data


def _frame(x_name: str, parts: list[tuple[str, np.ndarray, np.ndarray]], x_dtype=np.float32) -> pd.DataFrame:
    names = [p[0] for p in parts]
    xs = [p[1] for p in parts]
    ys = [p[2] for p in parts]
    n = [len(x) for x in xs]
    codes = np.repeat(np.arange(len(parts), dtype=np.int8), n)
    return pd.DataFrame(
        {
            x_name: np.concatenate(xs).astype(x_dtype) if parts else np.empty(0, x_dtype),
            "value": np.concatenate(ys).astype(np.float32) if parts else np.empty(0, np.float32),
            # Categorical: one byte per row on the wire instead of the series name repeated.
            "series": pd.Categorical.from_codes(
                codes, dtype=pd.CategoricalDtype(pd.Index(names, dtype=object))
            ),
        }
    )


class _CachedMethod:
    """config.yaml's top-level `method`, re-read only when the file's stat changes."""

    def __init__(self, path: Path):
        self.path, self._key, self.method, self.exists = path, None, None, False

    def read(self) -> str | None:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if key != self._key:
            self._key = key
            self.method, self.exists = _config_method(self.path, key[1]) if key else (None, False)
        return self.method


def _config_method(path: Path, size: int) -> tuple[str | None, bool]:
    """(the config's `method`, lower-cased, or None when it names none; whether the file is a readable config).
    A broken or hostile config answers (None, False): the watcher then goes by the metrics alone."""
    data = read_yaml_mapping(path)
    if data is None:
        return None, False
    method = data.get("method")
    return (method.strip().lower() or None) if isinstance(method, str) else None, True


def run_method(run_dir: str | os.PathLike) -> str | None:
    """The method a run's config.yaml names ("sft" when it names none), None without a readable config: for the
    run selectors' labels (the watcher also goes by the metrics). Re-read only when the file changed."""
    cached = _cached_method(Path(run_dir))
    method = cached.read()
    return method or ("sft" if cached.exists else None)


def resolve_method(config_method: str | None, config_exists: bool, series: RunSeries) -> str | None:
    """What the run is: its config's method; without a readable config, the method whose figures it logged
    (robust to a config that is missing or unreadable); "sft" for a config without one (the default), None when
    nothing tells."""
    if config_method:
        return config_method
    if series.has_preference_metrics:  # no config to tell: rewards/* are a preference method's own figures
        return methods.from_metrics(series.metrics).name
    return "sft" if config_exists else None


def plan_peak_bytes(plan: dict | None) -> float | None:
    """The plan's predicted whole-GPU footprint, comparable with NVML's memory curve."""
    plan = plan or {}
    v = plan.get("device_total_bytes") or plan.get("reserved_peak_bytes")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


class RunWatcher:
    """Keep one per (browser session, run) in st.session_state; call `refresh()` each fragment tick."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        budget: ChartBudget | None = None,
        tail_lines: int = 80,
        clock=time.time,
    ):
        self.run_dir = Path(run_dir)
        self.budget = budget or ChartBudget()
        self.files = RunFiles(self.run_dir)
        self.status_file = _CachedJson(self.run_dir / rundir.STATUS)
        self.plan_file = _CachedJson(self.run_dir / rundir.PLAN)
        self.config_method = _CachedMethod(self.run_dir / rundir.CONFIG)
        self.stderr = TextTail(self.run_dir / rundir.STDERR, n_lines=tail_lines)
        self.stdout = TextTail(self.run_dir / rundir.STDOUT, n_lines=tail_lines)
        self.completions = CompletionsReader(self.run_dir)
        self.health = HealthChecker()
        self.clock = clock
        self._charts: dict[str, pd.DataFrame] | None = None
        self._warnings: list[HealthWarning] = []
        self._health_key = None
        self._diagnosis: tuple | None = None
        self._method: str | None = None

    @property
    def series(self) -> RunSeries:
        return self.files.series

    def set_smoothing(self, window_steps: float) -> None:
        """The smoothed loss's window, in training steps (the Monitor's control); charts are redrawn if it moved."""
        if self.files.series.set_smoothing(window_steps):
            self._charts = None

    def refresh(self) -> Snapshot:
        changed = self.files.poll()
        series = self.files.series
        status = self.status_file.read()
        plan = self.plan_file.read()
        method = resolve_method(self.config_method.read(), self.config_method.exists, series)
        if changed or self._charts is None or method != self._method:
            self._method = method
            self._charts = self._build_charts(series)
            self._charts.update(method_charts(series, method, self.budget))
        # the lock, not the last status written, says whether the process lives: a SIGKILLed trainer shows as
        # failed on the next tick, a trainer still exiting as stopping
        status, state, alive = liveness.read_live_status(self.run_dir, status)
        stalled = rundir.stall(self.run_dir, status, state, alive)
        if not self.run_dir.is_dir():
            state = "deleted"  # rm -rf under the page: say so, not "unknown"
        elif state == "new":
            state = "unknown"
        health_key = (series.n_metric_records, series.n_gpu_records, state, id(plan), id(series))
        if health_key != self._health_key:
            self._warnings = self.health.check(series, plan, status, method)
            self._health_key = health_key
        stderr = self.stderr.read()
        diagnosis = None
        if state == "failed":
            key = (stderr, health_key)
            if self._diagnosis is None or self._diagnosis[0] != key:
                ev = load_evidence(self.run_dir, series)
                self._diagnosis = (key, diagnose(ev))
            diagnosis = self._diagnosis[1]
        snap = self._snapshot(series, status, plan, state, changed, stderr, diagnosis)
        snap.stalled_s, snap.stall = stalled
        if snap.stall:  # the same stall the page and `core.runs show` report, in the watcher's own list
            snap.warnings = [stall_warning(snap.stall), *snap.warnings]
        snap.completions = self.completions.read()
        return snap

    # --- pieces -------------------------------------------------------------------------------------------

    def _build_charts(self, s: RunSeries) -> dict[str, pd.DataFrame]:
        b = self.budget
        charts: dict[str, pd.DataFrame] = {}
        loss_parts = []
        if "loss" in s.metrics:
            loss_parts.append(("train", *downsample_minmax(*s.metric("loss"), b.spiky)))
            loss_parts.append(("train (smoothed)", *stride(*s.ema_loss.arrays(), b.smooth)))
        if "eval_loss" in s.metrics:
            loss_parts.append(("eval", *downsample_minmax(*s.metric("eval_loss"), b.sparse)))
        for key in s.source_evals:  # a mix of data.sources: each source's eval loss, as "eval: <source>"
            loss_parts.append((f"eval: {key[5:-5]}", *downsample_minmax(*s.metric(key), b.sparse)))
        charts["loss"] = _frame("step", loss_parts)
        lr = (
            [("learning rate", *stride(*s.metric("learning_rate"), b.smooth))]
            if "learning_rate" in s.metrics
            else []
        )
        charts["learning_rate"] = _frame("step", lr, np.float32)
        gn = (
            [("grad norm", *downsample_minmax(*s.metric("grad_norm"), b.spiky))]
            if "grad_norm" in s.metrics
            else []
        )
        charts["grad_norm"] = _frame("step", gn)

        # GPU charts share a time axis: minutes since the run's first record (float32 keeps 0.01 s precision
        # at 24 h, unlike absolute unix seconds).
        t0 = self._t0(s)
        mem = []
        used = s.gpus_used()
        if len(used) > 1:  # a run on several GPUs: one line per GPU (its per-GPU plan is the chart's rule)
            for idx in used:
                t, v = s.gpu_series("process_memory", idx)
                t, v = downsample_minmax(t, v, b.spiky)
                mem.append((f"GPU {idx}: this run (NVML)", (t - t0) / 60.0, v / GiB))
        else:
            for name, label in (
                ("memory_used", "GPU used (all processes)"),
                ("process_memory", "this run (NVML)"),
            ):
                t, v = s.gpu_series(name)
                if t.size:
                    t, v = downsample_minmax(t, v, b.spiky)
                    mem.append((label, (t - t0) / 60.0, v / GiB))
        n = s.ranks()
        for name, label in (("cuda_allocated", "torch allocated"), ("cuda_reserved", "torch reserved")):
            for k in range(n):
                key = name if k == 0 else f"rank{k}_{name}"
                who = f"rank {k}: " if n > 1 else ""
                mem += self._timed(s, key, f"{who}{label}", t0, b.sparse)
        charts["gpu_memory"] = _frame("minutes", mem)
        cpu = []
        for k in range(n):  # the training processes' RAM: the memory curve of a run on a CPU
            key = "rss_bytes" if k == 0 else f"rank{k}_rss_bytes"
            cpu += self._timed(s, key, f"rank {k} (RSS)" if n > 1 else "training process (RSS)", t0, b.sparse)
        charts["cpu_memory"] = _frame("minutes", cpu)
        t, u = s.gpu_series("utilization")
        charts["gpu_util"] = _frame(
            "minutes", [("utilisation %", *_rel(downsample_minmax(t, u, b.spiky), t0))] if t.size else []
        )
        t, c = s.gpu_series("temperature")
        charts["gpu_temperature"] = _frame(
            "minutes", [("temperature °C", *_rel(stride(t, c, b.smooth), t0))] if t.size else []
        )
        return charts

    @staticmethod
    def _timed(s: RunSeries, name: str, label: str, t0: float, points: int) -> list:
        """[(label, minutes, GiB)] of a metric by its wall-clock time, or [] when the run has none."""
        if name not in s.metrics:
            return []
        _, v = s.metric(name)
        t = s.metric_time[name].arrays()[1]
        ok = np.isfinite(t)
        if not ok.any():
            return []
        t, v = downsample_minmax(t[ok], v[ok], points)
        return [(label, (t - t0) / 60.0, v / GiB)]

    @staticmethod
    def _t0(s: RunSeries) -> float:
        starts = [s.first_time] if s.first_time is not None else []
        for table in s.gpu.values():
            for p in table.values():
                if len(p):
                    starts.append(p.x[0])
                    break
        return min(starts) if starts else 0.0

    def _snapshot(self, s, status, plan, state, changed, stderr, diagnosis) -> Snapshot:
        st = status or {}
        step = st.get("step") if isinstance(st.get("step"), int) else s.last_step
        max_steps = st.get("max_steps") if isinstance(st.get("max_steps"), int) else None
        progress = min(1.0, step / max_steps) if step is not None and max_steps else None
        ended = st.get("ended")
        # every attempt's time: a resumed run's stop is not counted (core.rundir.run_seconds)
        elapsed = rundir.run_seconds(st, ended if isinstance(ended, (int, float)) else self.clock())
        sps = _steps_per_second(s)
        eta = None
        if state in ("running", "starting") and sps and step is not None and max_steps:
            eta = max(0.0, (max_steps - step) / sps)
        latest = {name: p.last() for name, p in s.metrics.items() if len(p)}
        latest = {k: v for k, v in latest.items() if v is not None}
        idx = s.main_gpu()
        lines = {}
        _, total = s.gpu_series("memory_total")
        cap = float(total[-1]) if total.size else (plan or {}).get("gpu_bytes")
        if cap:
            lines["gpu_capacity_gib"] = float(cap) / GiB
        peak_plan = plan_peak_bytes(plan)
        if peak_plan:
            lines["plan_peak_gib"] = peak_plan / GiB
        tensors = (plan or {}).get("tensor_peak_bytes")
        if isinstance(tensors, (int, float)) and tensors > 0:  # a CPU run's memory line is drawn from it
            lines["plan_tensor_peak_gib"] = tensors / GiB
        peak = run_peak_bytes(s)
        return Snapshot(
            run_dir=str(self.run_dir),
            name=self.run_dir.name,
            state=state,
            status=status,
            step=step,
            max_steps=max_steps,
            progress=progress,
            elapsed_s=elapsed,
            eta_s=eta,
            steps_per_s=sps,
            tokens_per_s=latest.get("tokens_per_s"),
            latest=latest,
            charts=self._charts,
            lines=lines,
            peak_memory_gib=peak / GiB if peak else None,
            warnings=self._warnings,
            diagnosis=diagnosis,
            stderr_tail=stderr,
            stdout_tail=self.stdout.read(),
            other_processes=list(s.gpu_other_processes.get(idx, [])) if idx is not None else [],
            malformed_lines=self.files.malformed,
            changed=changed,
            method=self._method,
        )


def method_charts(
    s: RunSeries, method: str | None, budget: ChartBudget | None = None
) -> dict[str, pd.DataFrame]:
    """The charts of the run's method's own figures (core.recipe.methods: a DPO run's rewards, preference accuracy
    and log-probs; a GRPO run's reward, each reward function's, completion lengths), keyed "<method>_<chart>", x
    column "step", each smoothed as the loss is (the debiased EMA beside the raw points). A figure not logged (yet)
    is a series left out, never an error; a frame with no series is empty (an optional chart's: left out)."""
    b = budget or ChartBudget()
    try:
        spec = methods.get(method)
    except ValueError:
        return {}

    def parts(names: tuple[tuple[str, str], ...], evals: tuple[tuple[str, str], ...] = ()):
        out = []
        for name, label in names:
            if name in s.metrics:
                # a third of the page wide, raw points drawn faint under the smoothed curve: `sparse` min/max
                # pairs are about one per pixel there
                out.append((label, *downsample_minmax(*s.metric(name), b.sparse)))
                if name in s.smoothed:
                    out.append((f"{label} (smoothed)", *stride(*s.smooth(name), b.smooth)))
        for name, label in evals:
            if name in s.metrics:
                out.append((label, *downsample_minmax(*s.metric(name), b.sparse)))
        return _frame("step", out)

    def family(chart) -> tuple[tuple[str, str], ...]:
        """The series named at run time: rewards/<function>/mean as "<function>"."""
        return tuple(
            (name, label.format(name[len(prefix) : -len(suffix)]))
            for prefix, suffix, label in chart.families
            for name in s.family_names
            if name.startswith(prefix) and name.endswith(suffix)
        )

    frames = {f"{spec.name}_{c.key}": (c, parts(c.train + family(c), c.eval)) for c in spec.charts}
    # an optional chart (a MoE's aux loss, GRPO's KL) exists once the run logs one of its figures
    return {key: frame for key, (c, frame) in frames.items() if not (c.optional and frame.empty)}


def _rel(xy: tuple[np.ndarray, np.ndarray], t0: float) -> tuple[np.ndarray, np.ndarray]:
    return (xy[0] - t0) / 60.0, xy[1]


def _steps_per_second(s: RunSeries, window: int = 50) -> float | None:
    """Recent training speed from the loss points' (step, time) pairs."""
    name = "loss" if "loss" in s.metric_time else next(iter(s.metric_time), None)
    if name is None:
        return None
    steps, times = s.metric_time[name].arrays()
    ok = np.isfinite(times)
    steps, times = steps[ok][-window:], times[ok][-window:]
    if steps.size < 2 or times[-1] <= times[0]:
        return None
    return float((steps[-1] - steps[0]) / (times[-1] - times[0]))


def run_peak_bytes(s: RunSeries) -> float | None:
    """The run's peak GPU memory: NVML per-process if sampled, else torch reserved, else torch peak."""
    for values in (s.gpu_series("process_memory")[1], s.metric("cuda_reserved")[1], s.metric("cuda_peak")[1]):
        values = values[np.isfinite(values)] if values.size else values
        if values.size:
            return float(values.max())
    return None


_FILES_CACHE: dict[str, RunFiles] = {}


_METHOD_CACHE: dict[str, _CachedMethod] = {}


def _files_for(run_dir: Path) -> RunFiles:
    """RunFiles kept per run dir across calls (process-wide), so the Runs page re-reads only what grew."""
    key = str(run_dir.resolve())
    files = _FILES_CACHE.get(key)
    if files is None:
        files = _FILES_CACHE[key] = RunFiles(run_dir)
    files.poll()
    return files


def _cached_method(run_dir: Path) -> _CachedMethod:
    key = str(run_dir.resolve())
    cached = _METHOD_CACHE.get(key)
    if cached is None:
        cached = _METHOD_CACHE[key] = _CachedMethod(run_dir / rundir.CONFIG)
    return cached


def forget_runs(root: Path, keep: set[str]) -> None:
    """Drop the cached files and methods of runs under `root` that are no longer there."""
    for cache in (_FILES_CACHE, _METHOD_CACHE):
        for key in [k for k in cache if k.startswith(str(root.resolve())) and k not in keep]:
            del cache[key]
