"""Monitor refresh cost on a long run: incremental watcher vs re-reading the whole files each tick.

Synthesises a 24 h run directory (100k-step metrics.jsonl, 86,400-line 1 Hz gpu.jsonl), reads it once, then
appends a few lines per tick and times `RunWatcher.refresh()`. The baseline re-reads and re-parses both files
every tick and downsamples the same way (what a page without tailing would do).

Goals: one tick <= 50 ms of server time after the first read; chart data per tick <= 100 KB (Arrow IPC, what
st.altair_chart ships). Last line: `monitor_refresh: ...`; exits 1 when a goal is missed.

    python benchmarks/monitor_refresh.py [--ticks 20] [--baseline-ticks 3] [--quick]

`--quick` (the suite's check that the script runs): a 1 h run (3,600 steps and GPU lines), 3 ticks; headline
printed, exit 0 even on a goal miss, non-zero on an error.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core.monitor.watch import RunWatcher  # noqa: E402

GiB = 1024**3
STEPS = 100_000
GPU_SECONDS = 86_400
T0 = 1_700_000_000.0
TICK_GOAL_S = 0.050
BYTES_GOAL = 100 * 1024


def metric_line(step: int, rng: random.Random) -> str:
    t = T0 + step * GPU_SECONDS / STEPS
    loss = 2.5 * math.exp(-step / 20000) + 0.6 + rng.gauss(0, 0.05)
    if rng.random() < 0.0005:
        loss *= 3  # occasional spikes so extremes matter
    rec = {
        "time": t,
        "step": step,
        "epoch": step / 25000,
        "loss": round(loss, 5),
        "learning_rate": 2e-4 * min(1.0, step / 3000) * (1 - step / STEPS / 1.01),
        "grad_norm": round(abs(rng.gauss(0.8, 0.2)), 5),
        "tokens_per_s": 4100 + rng.gauss(0, 50),
        "cuda_allocated": int(14.2 * GiB + rng.random() * 0.3 * GiB),
        "cuda_reserved": int(16.0 * GiB),
        "cuda_peak": int(15.1 * GiB),
    }
    if step % 500 == 0:
        rec["eval_loss"] = round(loss * 1.05, 5)
    return json.dumps(rec)


def gpu_line(second: int, rng: random.Random) -> str:
    return json.dumps(
        {
            "time": T0 + second,
            "index": 0,
            "memory_used": int(17.5 * GiB + rng.random() * 0.2 * GiB),
            "memory_total": int(24 * GiB),
            "utilization": min(100.0, max(0.0, rng.gauss(96, 3))),
            "temperature": 70 + rng.gauss(0, 1),
            "power_w": 380 + rng.gauss(0, 10),
            "process_memory": int(17.0 * GiB),
            "other_processes": [],
        }
    )


def synthesise(run_dir: Path, rng: random.Random, steps: int = STEPS, gpu_seconds: int = GPU_SECONDS):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as fh:
        fh.write("\n".join(metric_line(s, rng) for s in range(1, steps + 1)) + "\n")
    with open(run_dir / "gpu.jsonl", "w") as fh:
        fh.write("\n".join(gpu_line(s, rng) for s in range(gpu_seconds)) + "\n")
    status = {
        "state": "running",
        "reason": None,
        "step": steps,
        "max_steps": 2 * steps,
        "started": T0,
        "updated": T0 + gpu_seconds,
        "ended": None,
    }
    (run_dir / "status.json").write_text(json.dumps(status))
    (run_dir / "plan.json").write_text(
        json.dumps({"gpu_bytes": int(17.2 * GiB), "device_total_bytes": 24 * GiB})
    )
    (run_dir / "stderr.log").write_text("".join(f"{i}/200000 [..]\n" for i in range(5000)))


def append_tick(run_dir: Path, step: int, second: int, rng: random.Random, n_metrics=2, n_gpu=2):
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write("".join(metric_line(step + i, rng) + "\n" for i in range(n_metrics)))
    with open(run_dir / "gpu.jsonl", "a") as fh:
        fh.write("".join(gpu_line(second + i, rng) + "\n" for i in range(n_gpu)))


def full_reread_tick(run_dir: Path):
    """Baseline: no tailing, every tick re-reads and re-parses both files (a fresh watcher does exactly that)."""
    return RunWatcher(run_dir).refresh()


def shipped_bytes(charts: dict) -> tuple[int, str]:
    """Bytes st.altair_chart would send for these frames: Streamlit's own Altair->Arrow conversion.

    Uses a private Streamlit helper (the exact serialiser); falls back to pyarrow IPC if it moved.
    """
    try:
        import altair as alt
        from streamlit.elements.vega_charts import _convert_altair_to_vega_lite_spec

        total = 0
        for df in charts.values():
            x = df.columns[0]
            chart = alt.Chart(df).mark_line().encode(x=f"{x}:Q", y="value:Q", color="series:N")
            spec = _convert_altair_to_vega_lite_spec(chart)
            total += sum(len(b) for b in spec.get("datasets", {}).values() if isinstance(b, bytes))
            total += len(json.dumps({k: v for k, v in spec.items() if k != "datasets"}))
        return total, "Streamlit Altair spec + Arrow datasets"
    except Exception as exc:  # pragma: no cover
        from core.monitor.watch import frame_bytes

        return sum(frame_bytes(df) for df in charts.values()), f"pyarrow IPC ({exc.__class__.__name__})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--baseline-ticks", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a 1 h run, 3 ticks (goal not judged)")
    args = ap.parse_args()
    steps, gpu_seconds = (3600, 3600) if args.quick else (STEPS, GPU_SECONDS)
    if args.quick:
        args.ticks, args.baseline_ticks = 3, 1
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "runs" / "long-run"
        t = time.perf_counter()
        synthesise(run_dir, rng, steps, gpu_seconds)
        m_mb = (run_dir / "metrics.jsonl").stat().st_size / 1e6
        g_mb = (run_dir / "gpu.jsonl").stat().st_size / 1e6
        print(
            f"synthesised {steps} metric lines ({m_mb:.1f} MB) + {gpu_seconds} GPU lines ({g_mb:.1f} MB) "
            f"in {time.perf_counter() - t:.1f} s"
        )

        watcher = RunWatcher(run_dir)
        t = time.perf_counter()
        snap = watcher.refresh()
        first = time.perf_counter() - t
        print(
            f"first read (whole files): {first * 1000:.0f} ms, {snap.chart_bytes() / 1024:.1f} KB chart data"
        )

        ticks, sizes = [], []
        step, second = steps + 1, gpu_seconds
        for _ in range(args.ticks):
            append_tick(run_dir, step, second, rng)
            step, second = step + 2, second + 2
            t = time.perf_counter()
            snap = watcher.refresh()
            ticks.append(time.perf_counter() - t)
            sizes.append(shipped_bytes(snap.charts)[0])
            assert snap.changed and snap.step is not None
        idle = []
        for _ in range(5):
            t = time.perf_counter()
            watcher.refresh()
            idle.append(time.perf_counter() - t)
        n_points = sum(len(df) for df in snap.charts.values())
        series_lens = {k: len(df) for k, df in snap.charts.items()}
        json_bytes = sum(len(df.to_json(orient="records")) for df in snap.charts.values())

        base = []
        for _ in range(args.baseline_ticks):
            append_tick(run_dir, step, second, rng)
            step, second = step + 2, second + 2
            t = time.perf_counter()
            full_reread_tick(run_dir)
            base.append(time.perf_counter() - t)

    tick = statistics.median(ticks)
    worst = max(ticks)
    base_t = statistics.median(base)
    size = max(sizes)
    size_how = shipped_bytes(snap.charts)[1]
    print(
        f"incremental tick (2 metric + 2 GPU lines appended): median {tick * 1000:.1f} ms, "
        f"max {worst * 1000:.1f} ms over {len(ticks)} ticks"
    )
    print(f"unchanged tick (nothing appended): median {statistics.median(idle) * 1000:.2f} ms")
    print(f"full re-read tick: median {base_t * 1000:.0f} ms over {len(base)} ticks")
    print(f"speed-up: {base_t / tick:.0f}x")
    print(
        f"chart data per tick: {size / 1024:.1f} KB ({size_how}); {snap.chart_bytes() / 1024:.1f} KB as plain "
        f"Arrow IPC; {json_bytes / 1024:.1f} KB if sent as JSON records"
    )
    print(
        f"points per tick: {n_points} {series_lens} from {steps} steps x 6 metric series + {gpu_seconds} x 4 GPU"
    )
    ok = tick <= TICK_GOAL_S and size <= BYTES_GOAL
    quick = "; --quick: not judged" if args.quick else ""
    print(
        f"monitor_refresh: tick {tick * 1000:.1f} ms (goal <= 50 ms{quick}), chart data {size / 1024:.1f} KB "
        f"(goal <= 100 KB{quick}), {base_t / tick:.0f}x faster than re-reading {'OK' if ok else 'MISSED'}"
    )
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
