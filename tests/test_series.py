"""Downsampling keeps extremes and bounds output; smoothing behaves on real-looking loss curves."""

import numpy as np
import pytest

from core.monitor.series import downsample_minmax, ema, rolling_median, stride


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
    with pytest.raises(ValueError, match="window"):
        rolling_median([1.0], window=0)


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


def test_rolling_median_ignores_outliers_and_nans():
    y = np.ones(100)
    y[50] = 100.0
    y[60] = np.nan
    med = rolling_median(y, 9)
    assert med[50] == 1.0 and med[60] == 1.0
    assert med[0] == 1.0  # short window at the start
