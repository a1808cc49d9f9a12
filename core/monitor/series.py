"""Chart-sized series: min/max downsampling that keeps spikes, and smoothing for loss curves.

A browser chart is a few hundred pixels wide and every refresh re-sends its data, so each series is cut to a
bounded number of points on the server. Plain striding would hide the spikes a user watches for (a loss jump,
a memory peak), so each bucket keeps both its minimum and its maximum, and the first and last points stay.
"""

from __future__ import annotations

import math

import numpy as np


def downsample_minmax(x, y, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` points of (x, y), in x order, keeping each bucket's min and max and both ends.

    Non-finite y values are dropped (a chart cannot draw them; health warnings report them). Buckets are
    fixed runs of consecutive points counted from the start, so a growing series keeps the same buckets
    between ticks except when the bucket width steps up.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"x and y differ in length ({x.size} vs {y.size})")
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4 (first, last, one min/max pair); got {max_points}")
    finite = np.isfinite(y)
    if not finite.all():
        x, y = x[finite], y[finite]
    n = y.size
    if n <= max_points:
        return x, y
    buckets = (max_points - 2) // 2
    width = math.ceil(n / buckets)
    pad = buckets * width - n
    # Pad with the last value so the reshape works; padded slots map back to index n-1 (kept anyway).
    grid = (
        np.concatenate([y, np.full(pad, y[-1])]).reshape(buckets, width) if pad else y.reshape(buckets, width)
    )
    base = np.arange(buckets) * width
    lo = np.minimum(base + grid.argmin(axis=1), n - 1)
    hi = np.minimum(base + grid.argmax(axis=1), n - 1)
    keep = np.unique(np.concatenate([[0, n - 1], lo, hi]))
    return x[keep], y[keep]


def stride(x, y, max_points: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """Every k-th point plus the last: for smooth curves (learning rate, EMA) where extremes carry no news."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    finite = np.isfinite(y)
    if not finite.all():
        x, y = x[finite], y[finite]
    n = y.size
    if n <= max_points:
        return x, y
    k = math.ceil(n / (max_points - 1))
    idx = np.arange(0, n, k)
    if idx[-1] != n - 1:
        idx = np.append(idx, n - 1)
    return x[idx], y[idx]


def ema(y, alpha: float = 0.05) -> np.ndarray:
    """Exponential moving average; non-finite points hold the previous average instead of poisoning it.

    (`RunSeries` keeps the same average incrementally; this is the whole-array form for one-off curves.)
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1]; got {alpha}")
    y = np.asarray(y, dtype=np.float64)
    out = np.empty_like(y)
    state = math.nan
    for i, v in enumerate(y.tolist()):
        if math.isfinite(v):
            state = v if math.isnan(state) else alpha * v + (1 - alpha) * state
        out[i] = state
    return out


DEFAULT_SMOOTHING_STEPS = 20.0


class StepEMA:
    """A debiased exponential moving average whose window is in training steps (as TensorBoard's smoothing,
    debiased), not in logged points: each point decays the past by exp(-Δstep / window), and the average is
    divided by the weight it has accumulated, so the first points are not pulled toward the first value and a
    run logged every step or every 50 steps smooths over the same span of training. Non-finite values are
    skipped (they are evidence for the health checks, not part of a trend)."""

    def __init__(self, window_steps: float = DEFAULT_SMOOTHING_STEPS):
        if not window_steps > 0:
            raise ValueError(f"window_steps must be > 0; got {window_steps}")
        self.window = float(window_steps)
        self._num = 0.0
        self._den = 0.0
        self._last_step: float | None = None

    def update(self, step: float, value: float) -> float | None:
        if not math.isfinite(value):
            return None if self._den == 0 else self._num / self._den
        decay = 0.0 if self._last_step is None else math.exp(-max(0.0, step - self._last_step) / self.window)
        self._num = self._num * decay + value
        self._den = self._den * decay + 1.0
        self._last_step = step
        return self._num / self._den
