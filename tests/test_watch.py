"""RunWatcher (the Monitor's per-tick facade) and run summaries on real run directories and a live writer."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from core.monitor.watch import RunWatcher, compare_loss_frame, summarize_run, summarize_runs

GiB = 1024**3


def write_status(run_dir, **kw):
    status = {"state": "running", "reason": None, "step": 0, "max_steps": 100, "started": 1000.0}
    status.update(kw, updated=time.time(), ended=kw.get("ended"))
    tmp = run_dir / "status.json.tmp"
    tmp.write_text(json.dumps(status))
    os.replace(tmp, run_dir / "status.json")


def metric(step, loss=None, **kw):
    rec = {"time": 1000.0 + step, "step": step, "loss": 3.0 - step / 100 if loss is None else loss}
    rec.update(kw)
    return json.dumps(rec) + "\n"


def gpu(second, util=97.0, used=10 * GiB):
    rec = {
        "time": 1000.0 + second,
        "index": 0,
        "memory_used": used,
        "memory_total": 24 * GiB,
        "utilization": util,
        "temperature": 65.0,
        "power_w": 300.0,
        "process_memory": used - GiB,
        "other_processes": [],
    }
    return json.dumps(rec) + "\n"


def test_ticks_fold_in_only_new_points_and_cache_charts(tmp_path):
    run = tmp_path / "run-a"
    run.mkdir()
    write_status(run, step=10)
    (run / "metrics.jsonl").write_text(
        "".join(metric(s, learning_rate=1e-4, grad_norm=1.0) for s in range(1, 11))
    )
    (run / "gpu.jsonl").write_text("".join(gpu(s) for s in range(10)))
    w = RunWatcher(run, clock=lambda: 1010.0)
    snap = w.refresh()
    assert snap.changed and snap.state == "running" and snap.step == 10
    assert set(snap.charts) == {
        "loss",
        "learning_rate",
        "grad_norm",
        "gpu_memory",
        "cpu_memory",
        "gpu_util",
        "gpu_temperature",
    }
    assert snap.charts["cpu_memory"].empty  # these metrics lines carry no rss_bytes
    loss = snap.charts["loss"]
    assert set(loss["series"]) == {"train", "train (smoothed)"}
    assert len(loss[loss.series == "train"]) == 10
    assert snap.lines["gpu_capacity_gib"] == 24.0
    assert snap.steps_per_s == 1.0 and snap.eta_s == 90.0  # 1 step/s, 90 steps to go
    assert snap.elapsed_s == 10.0

    again = w.refresh()
    assert not again.changed and again.charts is snap.charts  # nothing new: cached frames, no re-cut

    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(metric(11) + metric(12)[:15])  # step 12 torn
    snap = w.refresh()
    assert snap.changed and snap.latest["loss"] == 3.0 - 11 / 100
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(metric(12)[15:] + "garbage{\n")
    snap = w.refresh()
    train = snap.charts["loss"][snap.charts["loss"].series == "train"]
    assert list(train.step) == list(range(1, 13))
    assert snap.malformed_lines == 1


def test_reload_mid_run_loses_no_points_live_writer(tmp_path):
    """A real writer process appends metrics/GPU lines and rewrites status.json while watchers come and go."""
    run = tmp_path / "live"
    run.mkdir()
    writer = textwrap.dedent(
        f"""
        import json, os, time
        run = {str(run)!r}
        with open(run + "/metrics.jsonl", "a") as m, open(run + "/gpu.jsonl", "a") as g:
            for step in range(1, 301):
                m.write(json.dumps({{"time": time.time(), "step": step, "loss": 2.0 + (step % 7) / 10}}) + "\\n")
                m.flush()
                g.write(json.dumps({{"time": time.time(), "index": 0, "utilization": 90, "memory_used": 1,
                                     "memory_total": 2}}) + "\\n")
                g.flush()
                st = {{"state": "running", "step": step, "max_steps": 300, "started": 0, "updated": time.time()}}
                with open(run + "/status.tmp", "w") as fh:
                    json.dump(st, fh)
                os.replace(run + "/status.tmp", run + "/status.json")
                if step % 30 == 0:
                    time.sleep(0.02)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer])
    first = RunWatcher(run)
    reloads = 0
    while proc.poll() is None:
        first.refresh()
        if reloads < 3 and first.series.n_metric_records > 50 * (reloads + 1):
            reloaded = RunWatcher(run)  # a browser reload: a fresh watcher reads from the files
            reloaded.refresh()
            steps = list(reloaded.series.metric("loss")[0])
            assert steps == list(range(1, len(steps) + 1)) and len(steps) >= first.series.n_metric_records
            reloads += 1
    assert proc.returncode == 0 and reloads >= 1
    final_first = first.refresh()
    fresh = RunWatcher(run).refresh()
    assert final_first.step == fresh.step == 300
    assert list(first.series.metric("loss")[0]) == list(range(1, 301))
    steps_fresh = RunWatcher(run)
    steps_fresh.refresh()
    assert np.array_equal(steps_fresh.series.metric("loss")[1], first.series.metric("loss")[1])
    assert first.series.n_gpu_records == 300 and fresh.malformed_lines == 0


def test_charts_stay_small_on_a_long_run(tmp_path):
    run = tmp_path / "long"
    run.mkdir()
    rng = np.random.default_rng(0)
    with open(run / "metrics.jsonl", "w") as fh:
        for s in range(1, 30_001):
            fh.write(
                metric(
                    s,
                    loss=float(1 + rng.random()),
                    grad_norm=float(rng.random()),
                    learning_rate=1e-4,
                    cuda_reserved=5 * GiB,
                )
            )
    with open(run / "gpu.jsonl", "w") as fh:
        for s in range(30_000):
            fh.write(gpu(s, util=float(90 + rng.random() * 10)))
    snap = RunWatcher(run).refresh()
    for name, df in snap.charts.items():
        for series, part in df.groupby("series", observed=True):
            assert len(part) <= 1200, (name, series, len(part))
    assert snap.chart_bytes() < 100 * 1024
    # Extremes survive: the max of the raw loss is in the chart.
    raw_max = max(json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines())
    train = snap.charts["loss"][snap.charts["loss"].series == "train"]
    assert abs(float(train.value.max()) - raw_max) < 1e-6


def test_failed_run_gets_a_diagnosis_and_stderr_tail(tmp_path):
    run = tmp_path / "bad"
    run.mkdir()
    (run / "metrics.jsonl").write_text(metric(1) + metric(2))
    src = os.path.join(os.path.dirname(__file__), "data", "stderr", "cpu_alloc_rlimit.txt")
    (run / "stderr.log").write_text(Path(src).read_text())
    write_status(run, state="running", step=2)
    w = RunWatcher(run)
    assert w.refresh().diagnosis is None
    write_status(run, state="failed", step=2, reason="exited with code 1", ended=1002.0)
    snap = w.refresh()
    assert snap.diagnosis is not None and snap.diagnosis.rule == "cpu_oom"
    assert "DefaultCPUAllocator" in snap.stderr_tail
    assert snap.eta_s is None and snap.elapsed_s == 2.0


def test_health_warnings_and_plan_line_in_snapshot(tmp_path):
    run = tmp_path / "hot"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(metric(s) for s in range(1, 20)) + metric(20, loss=float("nan"))
    )
    (run / "gpu.jsonl").write_text("".join(gpu(s, used=int(23 * GiB)) for s in range(20)))
    (run / "plan.json").write_text(json.dumps({"device_total_bytes": 12 * GiB, "gpu_bytes": 24 * GiB}))
    write_status(run, step=20)
    snap = RunWatcher(run).refresh()
    assert {w.code for w in snap.warnings} >= {"nonfinite_loss", "memory_high", "plan_mismatch"}
    assert snap.warnings[0].level == "error"
    assert snap.lines["plan_peak_gib"] == 12.0
    assert abs(snap.peak_memory_gib - 22.0) < 1e-6


def test_summaries_and_comparison(tmp_path):
    runs = tmp_path / "runs"
    for name, started, final in (("old", 100.0, 1.5), ("new", 200.0, 0.9)):
        d = runs / name
        d.mkdir(parents=True)
        lines = [metric(s, loss=3.0 - s * (3.0 - final) / 50) for s in range(1, 51)]
        lines.append(json.dumps({"time": 2000.0, "step": 50, "eval_loss": final + 0.1}) + "\n")
        lines.append(json.dumps({"time": 2001.0, "step": 25, "eval_loss": final + 0.3}) + "\n")
        (d / "metrics.jsonl").write_text("".join(lines))
        (d / "status.json").write_text(
            json.dumps(
                {"state": "finished", "step": 50, "max_steps": 50, "started": started, "ended": started + 60}
            )
        )
    (runs / "empty").mkdir()
    summaries = summarize_runs(runs)
    assert [s.name for s in summaries] == ["new", "old", "empty"]
    new = summaries[0]
    assert (
        new.duration_s == 60
        and new.step == 50
        and abs(new.final_loss - 0.9) < 1e-9
        and abs(new.best_eval_loss - 1.0) < 1e-9
    )
    assert summaries[2].state == "unknown" and summaries[2].final_loss is None
    df = compare_loss_frame([runs / "old", runs / "new"], smoothed=False)
    assert set(df["run"]) == {"old", "new"} and len(df) == 100
    # Summaries are incremental too: appending one line shows up.
    with open(runs / "new" / "metrics.jsonl", "a") as fh:
        fh.write(metric(51, loss=0.5))
    assert summarize_run(runs / "new").final_loss == 0.5
