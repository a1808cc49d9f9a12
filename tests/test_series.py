"""Downsampling keeps extremes and bounds output; smoothing behaves on real-looking loss curves."""

import numpy as np
import pytest

from core.monitor.series import downsample_minmax, ema, stride


def _noisy_loss(n, seed=0):
    rng = np.random.default_rng(seed)
    x = np.arange(n, dtype=float)
    return x, 2.0 * np.exp(-x / (n / 5)) + 0.5 + rng.normal(0, 0.05, n)


@pytest.mark.parametrize("n", [10, 1999, 2000, 2001, 12_345, 100_000, 1_000_003])
def test_output_is_bounded_and_ordered(n):
    x, y = _noisy_loss(n)
    dx, dy = downsample_minmax(x, y, 2000)
    assert len(dx) == len(dy) <= 2000
    assert np.all(np.diff(dx) > 0)  # original order, no duplicates
    assert dx[0] == x[0] and dx[-1] == x[-1]
    if n <= 2000:
        assert np.array_equal(dy, y)
    else:
        assert len(dx) >= 1000  # uses its budget (a bucket whose min and max coincide gives one point)


def test_spikes_and_dips_survive():
    x, y = _noisy_loss(100_000)
    y[31_337] = 50.0  # one-point loss spike
    y[77_777] = -3.0  # one-point dip
    dx, dy = downsample_minmax(x, y, 1000)
    assert 31_337 in dx and 77_777 in dx
    assert dy.max() == 50.0 and dy.min() == -3.0
    # Striding the same budget loses both: this is why charts use min/max buckets.
    sx, sy = stride(x, y, 1000)
    assert sy.max() < 50.0 and sy.min() > -3.0


def test_every_bucket_extreme_is_kept():
    x, y = _noisy_loss(50_000, seed=3)
    dx, dy = downsample_minmax(x, y, 502)  # 250 buckets of 200 points
    kept = set(dx.astype(int))
    for b in range(250):
        seg = y[b * 200 : (b + 1) * 200]
        assert b * 200 + int(seg.argmax()) in kept
        assert b * 200 + int(seg.argmin()) in kept


def test_non_finite_values_are_dropped_from_chart_data():
    x = np.arange(10.0)
    y = np.array([1, 2, np.nan, 4, np.inf, 6, 7, -np.inf, 9, 10], dtype=float)
    dx, dy = downsample_minmax(x, y, 2000)
    assert list(dx) == [0, 1, 3, 5, 6, 8, 9]
    assert np.isfinite(dy).all()


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="differ in length"):
        downsample_minmax([1, 2], [1], 100)
    with pytest.raises(ValueError, match="at least 4"):
        downsample_minmax([1, 2], [1, 2], 3)
    with pytest.raises(ValueError, match="alpha"):
        ema([1.0], alpha=0)


def test_stride_keeps_ends_and_bound():
    x = np.arange(10_001.0)
    sx, sy = stride(x, x * 2, 500)
    assert len(sx) <= 500 and sx[0] == 0 and sx[-1] == 10_000


def test_ema_smooths_and_holds_over_nan():
    x, y = _noisy_loss(5000)
    sm = ema(y, 0.05)
    # Smoothed curve is much less noisy than the raw one but follows its trend.
    assert np.std(np.diff(sm)) < 0.2 * np.std(np.diff(y))
    assert abs(sm[-200:].mean() - y[-200:].mean()) < 0.05
    with_nan = ema(np.array([1.0, np.nan, 3.0]), 0.5)
    assert list(with_nan) == [1.0, 1.0, 2.0]


def test_step_ema_is_debiased_and_windowed_in_steps():
    """Issue #16: the old EMA (alpha 0.05 per logged point, seeded at the first point) still read 0.4 at step
    150 on the demo while the raw loss had been 0.005 since step 20. The step-windowed debiased EMA follows."""
    from core.monitor.series import StepEMA

    def ema_steps(x, y, window_steps):
        step_ema = StepEMA(window_steps)
        return x, np.array([step_ema.update(step, v) for step, v in zip(x.tolist(), y.tolist(), strict=True)])

    steps = np.arange(5, 155, 5, dtype=float)  # the demo logs every 5 steps
    loss = np.where(steps < 20, 2.0, 0.005)
    _, old = steps, ema(loss, 0.05)
    _, new = ema_steps(steps, loss, window_steps=20)
    assert old[-1] > 0.3  # the bug as reported
    assert new[-1] < 0.01  # the 2.0 of steps 5-15 weighs exp(-135/20) by step 150
    assert new[0] == 2.0  # debiased: the first point is its own average, not pulled toward zero
    # the same training span smooths the same whether logged every step or every 5 steps
    fine = ema_steps(np.arange(1, 155, dtype=float), np.where(np.arange(1, 155) < 20, 2.0, 0.005), 20)[1]
    assert abs(fine[-1] - new[-1]) < 1e-3
    with pytest.raises(ValueError, match="window_steps"):
        StepEMA(0)


def test_watcher_smoothing_window_is_the_users(tmp_path):
    import json

    from core.monitor.watch import RunWatcher

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"time": float(i), "step": i, "loss": 2.0 if i < 20 else 0.005} for i in range(5, 155, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = RunWatcher(run)
    w.set_smoothing(5.0)
    short = w.refresh().charts["loss"]
    w.set_smoothing(200.0)
    long = w.refresh().charts["loss"]
    at = lambda df: float(df[df["series"] == "train (smoothed)"]["value"].iloc[3])  # noqa: E731 - step 20
    assert at(long) > at(short)  # a longer window remembers the early 2.0 longer
