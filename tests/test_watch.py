"""RunWatcher (the Monitor's per-tick facade) and run summaries on real run directories and a live writer."""

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from core.monitor.summary import (
    comparable_metrics,
    compare_frame,
    summarize_run,
    summarize_runs,
)
from core.monitor.watch import RunWatcher
from core.recipe import methods

DPO_CHARTS = tuple(f"dpo_{chart.key}" for chart in methods.get("dpo").charts)

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
    df = compare_frame([runs / "old", runs / "new"], "loss", smoothed=False)
    assert set(df["run"]) == {"old", "new"} and len(df) == 100
    # Summaries are incremental too: appending one line shows up.
    with open(runs / "new" / "metrics.jsonl", "a") as fh:
        fh.write(metric(51, loss=0.5))
    assert summarize_run(runs / "new").final_loss == 0.5


# --- DPO runs ------------------------------------------------------------------------------------------------

DPO_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)


def dpo_curves(kind: str, t: float) -> tuple[float, float, float]:
    """(rewards/chosen, rewards/margins, rewards/accuracies) without noise at training progress t in (0, 1]:

    healthy  - the margin rises and saturates, the chosen reward dips a little, accuracy climbs to ~0.95;
    chance   - nothing moves: accuracy a coin flip, margin and rewards ~0 (the policy stays the reference);
    flat     - accuracy a little above chance from the start but the margin never grows (a tiny beta, a tiny lr);
    collapse - the margin grows because the chosen reward falls steadily, the rejected one faster."""
    if kind == "healthy":
        return -0.3 * t, 3.0 * (1 - math.exp(-5 * t)), 0.5 + 0.45 * (1 - math.exp(-6 * t))
    if kind == "chance":
        return 0.0, 0.0, 0.5
    if kind == "flat":
        return -0.002, 0.01, 0.7
    if kind == "collapse":
        return -6.0 * t, 4.0 * t, 0.5 + 0.4 * (1 - math.exp(-6 * t))
    raise ValueError(kind)


def dpo_records(
    kind: str = "healthy", steps: int = 100, max_steps: int | None = None, eval_every: int = 25, seed: int = 0
) -> list[dict]:
    """metrics.jsonl records as the trainer writes them for TRL's DPOTrainer: every number DPOTrainer logs per
    logging step (here every step), the trainer's own figures, and eval lines with the eval_ twins. Noise per
    point as a batch of 8 pairs gives (accuracy in eighths)."""
    rng = np.random.default_rng(seed)
    beta, total = 0.1, max_steps or steps
    out = []
    for step in range(1, steps + 1):
        t = step / total
        chosen, margin, acc = dpo_curves(kind, t)
        acc_eval = round(acc * 16) / 16  # held-out pairs, averaged over the eval set: the curve itself
        scale = 0.02 if kind in ("chance", "flat") else 0.15
        chosen += float(rng.normal(0, scale / 3))
        margin += float(rng.normal(0, scale))
        acc = round(min(1.0, max(0.0, acc + float(rng.normal(0, 0.08)))) * 8) / 8
        rejected = chosen - margin
        ref_c, ref_r = -80.0 + float(rng.normal(0, 2)), -95.0 + float(rng.normal(0, 2))
        rec = {
            "time": 1000.0 + step,
            "step": step,
            "epoch": step / total,
            "loss": math.log1p(math.exp(-margin)),
            "grad_norm": float(abs(rng.normal(4.0, 1.0))),
            "learning_rate": 5e-6 * (1 - t),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/accuracies": acc,
            "rewards/margins": margin,
            "logps/chosen": ref_c + chosen / beta,
            "logps/rejected": ref_r + rejected / beta,
            "logits/chosen": -1.2 + float(rng.normal(0, 0.1)),
            "logits/rejected": -1.3 + float(rng.normal(0, 0.1)),
            "entropy": 2.4 + float(rng.normal(0, 0.05)),
            "mean_token_accuracy": 0.41 + float(rng.normal(0, 0.02)),
            "num_tokens": float(step * 1024),
            "tokens_per_s": 900.0,
            "samples_per_s": 7.5,
            "rss_bytes": 2.0 * GiB,
        }
        out.append(rec)
        if eval_every and step % eval_every == 0:
            ev = {"time": 1000.5 + step, "step": step, "epoch": step / total, "eval_loss": rec["loss"] + 0.05}
            for key in DPO_KEYS:
                ev[f"eval_{key}"] = rec[key]
            ev["eval_rewards/accuracies"] = acc_eval
            ev.update(
                {
                    "eval_runtime": 1.9,
                    "eval_samples_per_second": 33.1,
                    "eval_steps_per_second": 4.2,
                    "rss_bytes": 2.0 * GiB,
                }
            )
            out.append(ev)
    return out


def write_dpo_run(
    run_dir: Path,
    kind: str = "healthy",
    steps: int = 100,
    max_steps: int | None = None,
    state: str = "running",
    method: str | None = "dpo",
    eval_every: int = 25,
    started: float = 1000.0,
) -> Path:
    """A DPO run directory as the engine leaves it: config.yaml with top-level `method: dpo` (`method=None`: a
    config that names no method), metrics.jsonl, status.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    head = f"method: {method}\n" if method else ""
    (run_dir / "config.yaml").write_text(
        head + "model: {path: m}\ndata: {path: prefs.jsonl}\ntraining: {beta: 0.1, learning_rate: 5.0e-06}\n"
    )
    recs = dpo_records(kind, steps, max_steps, eval_every)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ended = started + steps if state in ("finished", "failed", "stopped") else None
    (run_dir / "status.json").write_text(
        json.dumps(
            {
                "state": state,
                "step": steps,
                "max_steps": max_steps or steps,
                "started": started,
                "ended": ended,
                # a live run reported just now (an old report would read as a stall)
                "updated": started + steps if ended else time.time(),
            }
        )
    )
    return run_dir


def test_dpo_run_gets_rewards_accuracy_and_logps_charts(tmp_path):
    run = write_dpo_run(tmp_path / "dpo", steps=100)
    snap = RunWatcher(run).refresh()
    assert snap.method == "dpo"
    assert set(DPO_CHARTS) <= set(snap.charts)
    rewards, acc, logps = (snap.charts[name] for name in DPO_CHARTS)
    assert set(rewards["series"]) == {
        "chosen",
        "chosen (smoothed)",
        "rejected",
        "rejected (smoothed)",
        "margin",
        "margin (smoothed)",
        "eval margin",
    }
    assert set(acc["series"]) == {"train", "train (smoothed)", "eval"}
    assert set(logps["series"]) == {"chosen", "chosen (smoothed)", "rejected", "rejected (smoothed)"}
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_acc = [r["rewards/accuracies"] for r in recs if "rewards/accuracies" in r]
    assert acc[acc.series == "train"].value.tolist() == train_acc  # every logged point, in order
    assert len(acc[acc.series == "eval"]) == 4  # eval at 25, 50, 75, 100
    assert list(acc[acc.series == "eval"].step) == [25, 50, 75, 100]
    assert methods.chance_of("rewards/accuracies") == methods.chance_of("eval_rewards/accuracies") == 0.5
    # the loss chart and the others are as for SFT
    assert set(snap.charts["loss"]["series"]) == {"train", "train (smoothed)", "eval"}
    assert not snap.charts["learning_rate"].empty and not snap.charts["grad_norm"].empty


def test_dpo_smoothing_is_the_debiased_ema_and_follows_the_window(tmp_path):
    from core.monitor.series import StepEMA

    def ema_steps(x, y, window_steps):  # the debiased EMA, point by point
        step_ema = StepEMA(window_steps)
        return x, [step_ema.update(step, v) for step, v in zip(x, y, strict=True)]

    run = write_dpo_run(tmp_path / "dpo", steps=60, eval_every=0)
    w = RunWatcher(run)
    snap = w.refresh()
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    margins = [r["rewards/margins"] for r in recs]
    rewards = snap.charts["dpo_rewards"]
    smoothed = rewards[rewards.series == "margin (smoothed)"]
    _, expected = ema_steps(steps, margins, 20.0)
    assert np.allclose(smoothed.value, expected, rtol=1e-5, atol=1e-6)
    w.set_smoothing(5.0)
    again = w.refresh().charts["dpo_rewards"]
    _, expected = ema_steps(steps, margins, 5.0)
    assert np.allclose(again[again.series == "margin (smoothed)"].value, expected, rtol=1e-5, atol=1e-6)


def test_dpo_is_told_by_config_or_by_metrics_and_sft_runs_are_unchanged(tmp_path):
    # config says dpo, nothing logged yet: the DPO charts are there, empty (the page says "not logged yet")
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.yaml").write_text("method: dpo\nmodel: {path: m}\ndata: {path: p.jsonl}\n")
    snap = RunWatcher(early).refresh()
    assert snap.method == "dpo" and all(snap.charts[name].empty for name in DPO_CHARTS)
    # no method in the config (or no config at all) but DPO's figures in the metrics: a DPO run
    assert RunWatcher(write_dpo_run(tmp_path / "nomethod", method=None)).refresh().method == "dpo"
    bare = write_dpo_run(tmp_path / "bare")
    (bare / "config.yaml").unlink()
    assert RunWatcher(bare).refresh().method == "dpo"
    # a DPO run that logged only some figures: the others are series left out, never an error
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.yaml").write_text("method: dpo\n")
    (partial / "metrics.jsonl").write_text(
        metric(1, **{"rewards/accuracies": 0.5, "rewards/margins": "nan", "logps/chosen": "oops"})
        + metric(2, **{"rewards/accuracies": 0.75, "rewards/margins": 0.1})
    )
    snap = RunWatcher(partial).refresh()
    assert set(snap.charts["dpo_accuracy"]["series"]) == {"train", "train (smoothed)"}
    assert set(snap.charts["dpo_rewards"]["series"]) == {"margin", "margin (smoothed)"}
    assert snap.charts["dpo_logps"].empty
    # an SFT run: the same charts as ever, no DPO ones
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.yaml").write_text("method: sft\nmodel: {path: m}\ndata: {path: d.jsonl}\n")
    (sft / "metrics.jsonl").write_text(
        "".join(metric(s, learning_rate=1e-4, grad_norm=1.0) for s in range(1, 11))
    )
    snap = RunWatcher(sft).refresh()
    assert snap.method == "sft"
    assert set(snap.charts) == {
        "loss",
        "learning_rate",
        "grad_norm",
        "gpu_memory",
        "cpu_memory",
        "gpu_util",
        "gpu_temperature",
    }
    # a config that is not YAML does not break the watcher: the metrics still tell
    (sft / "config.yaml").write_text("method: [dpo\n")
    assert RunWatcher(sft).refresh().method is None


def test_dpo_charts_stay_small_on_a_long_run(tmp_path):
    run = write_dpo_run(tmp_path / "long", steps=20_000, eval_every=500)
    snap = RunWatcher(run).refresh()
    for name in DPO_CHARTS:
        for series, part in snap.charts[name].groupby("series", observed=True):
            assert len(part) <= 1200, (name, series, len(part))
    assert snap.chart_bytes() < 200 * 1024


def test_runs_summaries_show_method_and_dpo_figures(tmp_path):
    runs = tmp_path / "runs"
    write_dpo_run(runs / "dpo-eval", steps=100, state="finished", started=300.0)
    write_dpo_run(runs / "dpo-train", steps=40, eval_every=0, state="finished", started=200.0)
    sft = runs / "sft"
    sft.mkdir()
    (sft / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")  # no method: sft
    (sft / "metrics.jsonl").write_text("".join(metric(s) for s in range(1, 11)))
    (sft / "status.json").write_text(json.dumps({"state": "finished", "step": 10, "started": 100.0}))
    rows = {r.name: r for r in summarize_runs(runs)}
    recs = [json.loads(line) for line in (runs / "dpo-eval" / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in recs if "eval_rewards/accuracies" in r][-1]
    d = rows["dpo-eval"]
    assert (d.method, d.reward_source) == ("dpo", "eval")
    assert d.reward_accuracy == last_eval["eval_rewards/accuracies"]
    assert d.reward_margin == last_eval["eval_rewards/margins"]
    recs = [json.loads(line) for line in (runs / "dpo-train" / "metrics.jsonl").read_text().splitlines()]
    t = rows["dpo-train"]
    assert (t.method, t.reward_source) == ("dpo", "train")
    assert (
        t.reward_accuracy == recs[-1]["rewards/accuracies"] and t.reward_margin == recs[-1]["rewards/margins"]
    )
    s = rows["sft"]
    assert s.method == "sft" and s.reward_accuracy is s.reward_margin is s.reward_source is None
    # the compare chart offers only what the chosen runs logged
    assert comparable_metrics([sft]) == ["loss"]
    assert comparable_metrics([sft, runs / "dpo-eval"]) == ["loss", "rewards/accuracies", "rewards/margins"]
    df = compare_frame([sft, runs / "dpo-eval", runs / "dpo-train"], "rewards/accuracies", smoothed=False)
    assert set(df["run"]) == {"dpo-eval", "dpo-train"} and len(df) == 140  # the SFT run has none: left out
    smooth = compare_frame([runs / "dpo-train"], "rewards/margins", smoothed=True, smoothing_steps=5.0)
    raw = compare_frame([runs / "dpo-train"], "rewards/margins", smoothed=False)
    assert len(smooth) == len(raw) == 40 and not np.allclose(smooth.value, raw.value)


def test_a_run_on_two_gpus_draws_one_memory_line_per_gpu_and_per_rank(tmp_path):
    """gpu.jsonl as the supervisor's NVML sampler writes it for two GPUs (the file, not a driver, is the input)
    and metrics lines with rank 1's memory (rank1_*, as rank 0 writes them)."""
    run = tmp_path / "run"
    run.mkdir()
    write_status(run, step=4)
    (run / "metrics.jsonl").write_text(
        "".join(
            metric(
                s, cuda_reserved=5 * GiB, rss_bytes=GiB, rank1_cuda_reserved=6 * GiB, rank1_rss_bytes=2 * GiB
            )
            for s in range(1, 5)
        )
    )
    lines = []
    for second in range(4):
        for index, used in ((0, 10 * GiB), (1, 12 * GiB)):
            rec = json.loads(gpu(second, used=used))
            lines.append(json.dumps({**rec, "index": index}) + "\n")
    (run / "gpu.jsonl").write_text("".join(lines))
    snap = RunWatcher(run).refresh()
    mem = snap.charts["gpu_memory"]
    assert set(mem["series"]) == {
        "GPU 0: this run (NVML)",
        "GPU 1: this run (NVML)",
        "rank 0: torch reserved",
        "rank 1: torch reserved",
    }
    gpu1 = mem[mem.series == "GPU 1: this run (NVML)"]["value"]
    assert np.allclose(gpu1, 11.0)  # 12 GiB used minus the 1 GiB other processes hold, in GiB
    rank1 = mem[mem.series == "rank 1: torch reserved"]["value"]
    assert np.allclose(rank1, 6.0)
    assert set(snap.charts["cpu_memory"]["series"]) == {"rank 0 (RSS)", "rank 1 (RSS)"}
