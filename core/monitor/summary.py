"""The Runs page's side of the monitor: one summary per run (state, duration, losses, peak memory, a preference
run's reward figures) and runs' curves side by side. One broken run is one row with its error."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from core import liveness, rundir
from core.files import read_json_object, read_yaml_mapping
from core.monitor.series import DEFAULT_SMOOTHING_STEPS, downsample_minmax, stride
from core.monitor.tail import RunSeries
from core.monitor.watch import (
    GiB,
    _cached_method,
    _files_for,
    _frame,
    forget_runs,
    resolve_method,
    run_peak_bytes,
)
from core.recipe import methods
from core.recipe.config_keys import DEFAULTS


@dataclass
class RunSummary:
    name: str
    run_dir: str
    state: str
    started: float | None
    duration_s: float | None
    step: int | None
    max_steps: int | None
    best_eval_loss: float | None
    final_loss: float | None
    peak_memory_gib: float | None
    malformed: int = 0  # log lines that could not be used
    error: str | None = None  # why this run's files could not be read at all
    method: str | None = None  # "sft", "dpo", ...; None without a readable config or telling metrics
    # a preference run's last accuracy (DPO) and reward margin (DPO, KTO): the last eval figures when the run
    # evaluated (held out, averaged over the eval set), else the last logged training figures; `reward_source`
    # says which
    reward_accuracy: float | None = None
    reward_margin: float | None = None
    reward_source: str | None = None  # "eval" | "train"
    # the method's headline figures (core.recipe.methods: DPO's accuracy and margin, GRPO's reward), from the same
    # source: [{"key", "label", "value", "format"}]
    headline: list[dict] = field(default_factory=list)
    # what it was trained with (config.yaml; the library's default where the config leaves a key out): None when
    # the config cannot be read, lora_r None for a full fine-tune
    learning_rate: float | None = None
    lora_r: int | None = None
    load_in_4bit: bool | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _method_for(run_dir: Path, s: RunSeries) -> str | None:
    cached = _cached_method(run_dir)
    return resolve_method(cached.read(), cached.exists, s)


def _last(s: RunSeries, name: str) -> float | None:
    """The last finite value of a metric, or None."""
    _, v = s.metric(name)
    v = v[np.isfinite(v)]
    return float(v[-1]) if v.size else None


def headline_summary(s: RunSeries, method: str | None) -> tuple[list[dict], str | None]:
    """(the method's headline figures, "eval" | "train"): the last eval figures if the run evaluated, else the last
    training figures; ([], None) for a method without them (SFT) or a run that has not logged them yet."""
    try:
        wanted = methods.get(method).headline
    except ValueError:
        wanted = ()
    for prefix, source in (("eval_", "eval"), ("", "train")):
        figures = [
            {"key": key, "label": label, "value": _last(s, prefix + key), "format": fmt}
            for key, label, fmt in wanted
        ]
        if any(f["value"] is not None for f in figures):
            return figures, source
    return [], None


def preference_summary(s: RunSeries, method: str | None) -> tuple[float | None, float | None, str | None]:
    """(preference accuracy, reward margin, "eval" | "train") of a method whose headline figures are rewards
    (DPO's accuracy and margin, KTO's margin); (None, None, None) for a method without them."""
    figures, source = headline_summary(s, method)
    by_key = {f["key"]: f["value"] for f in figures}
    acc, margin = by_key.get("rewards/accuracies"), by_key.get("rewards/margins")
    return (acc, margin, source) if acc is not None or margin is not None else (None, None, None)


def summarize_run(run_dir: str | os.PathLike, clock=time.time) -> RunSummary:
    run_dir = Path(run_dir)
    s = _files_for(run_dir).series
    # the state as every reader sees it: a run whose process vanished reads as failed (nothing is written)
    st = liveness.read_live_status(run_dir, read_json_object(run_dir / rundir.STATUS))[0] or {}
    started, ended = st.get("started"), st.get("ended")
    end = (
        ended
        if isinstance(ended, (int, float))
        else (clock() if st.get("state") == "running" else st.get("updated"))
    )
    duration = rundir.run_seconds(st, end)  # every attempt's time, not the time a resumed run sat stopped
    _, ev = s.metric("eval_loss")
    ev = ev[np.isfinite(ev)]
    loss = s.metrics.get("loss")
    peak = run_peak_bytes(s)
    method = _method_for(run_dir, s)
    accuracy, margin, _ = preference_summary(s, method)
    figures, source = headline_summary(s, method)
    return RunSummary(
        name=run_dir.name,
        run_dir=str(run_dir),
        state=st.get("state") or "unknown",
        started=started if isinstance(started, (int, float)) else None,
        duration_s=duration,
        step=st.get("step") if isinstance(st.get("step"), int) else s.last_step,
        max_steps=st.get("max_steps") if isinstance(st.get("max_steps"), int) else None,
        best_eval_loss=float(ev.min()) if ev.size else None,
        final_loss=loss.last() if loss is not None and len(loss) else None,
        peak_memory_gib=peak / GiB if peak else None,
        malformed=_files_for(run_dir).metrics_tail.malformed,
        method=method,
        reward_accuracy=accuracy,
        reward_margin=margin,
        reward_source=source,
        headline=figures,
        **run_settings(run_dir),
    )


def run_settings(run_dir: str | os.PathLike) -> dict:
    """The learning rate, LoRA rank and 4-bit loading a run's config.yaml trains with ({} when it cannot be read):
    read as a plain mapping, so a config from another version still shows what it can."""
    data = read_yaml_mapping(Path(run_dir) / rundir.CONFIG)
    if data is None:
        return {}

    def get(section: str, key: str):
        value = (data.get(section) or {}).get(key) if isinstance(data.get(section), dict) else None
        return DEFAULTS[section][key] if value is None else value

    lora = get("lora", "enabled") is not False
    lr = get("training", "learning_rate")
    return {
        "learning_rate": float(lr) if isinstance(lr, (int, float, str)) and _is_number(lr) else None,
        "lora_r": get("lora", "r") if lora else None,
        "load_in_4bit": bool(get("quantization", "load_in_4bit")),
    }


def _is_number(value) -> bool:
    try:
        float(value)  # YAML reads 2e-4 without a dot as a string
    except (TypeError, ValueError):
        return False
    return True


def _summary_or_error(run_dir: Path) -> RunSummary:
    """One broken run is one row with its error, never a broken page for the others."""
    try:
        return summarize_run(run_dir)
    except Exception as exc:  # anything a hostile or half-written file can raise
        return RunSummary(
            run_dir.name,
            str(run_dir),
            "unreadable",
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            error=f"{type(exc).__name__}: {str(exc)[:200]}",
        )


def summarize_runs(runs_dir: str | os.PathLike) -> list[RunSummary]:
    """Every run folder under `runs_dir` (<workspace>/runs), newest first."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    forget_runs(
        root, keep={str(d.resolve()) for d in dirs}
    )  # a deleted run must not keep its points in memory
    out = [_summary_or_error(d) for d in dirs]
    return sorted(out, key=lambda r: r.started or 0.0, reverse=True)


# What the Runs page can put side by side: (metric, axis title). A method's figures only for runs that logged them.
COMPARABLE = (
    ("loss", "loss"),
    ("rewards/accuracies", "preference accuracy (rewards/accuracies)"),
    ("rewards/margins", "reward margin (rewards/margins)"),
    ("reward", "mean reward (reward)"),
)


def comparable_metrics(run_dirs: list[str | os.PathLike]) -> list[str]:
    """The COMPARABLE metrics at least one of these runs has logged, in COMPARABLE's order ("loss" always first
    when any run has a loss): a metric selector never offers a curve none of them can draw."""
    have: set[str] = set()
    for d in run_dirs:
        have.update(_files_for(Path(d)).series.metrics)
    return [name for name, _ in COMPARABLE if name in have]


def compare_frame(
    run_dirs: list[str | os.PathLike],
    metric: str = "loss",
    smoothed: bool = True,
    max_points: int = 1000,
    smoothing_steps: float = DEFAULT_SMOOTHING_STEPS,
) -> pd.DataFrame:
    """One metric's curves of several runs on one chart: columns step, value, run (long form). A run that did
    not log the metric is left out (the caller can say so)."""
    parts = []
    for d in run_dirs:
        s = _files_for(Path(d)).series
        s.set_smoothing(smoothing_steps)
        if metric not in s.metrics:
            continue
        x, y = (
            stride(*s.smooth(metric), max_points)
            if smoothed and metric in s.smoothed
            else downsample_minmax(*s.metric(metric), max_points)
        )
        parts.append((Path(d).name, x, y))
    df = _frame("step", parts)
    return df.rename(columns={"series": "run"})
