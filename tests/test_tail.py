"""Incremental JSONL/text tailing on real files, with a real writer subprocess for the live case."""

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

from core.monitor.tail import JsonlTail, RunFiles, RunSeries, TextTail, tail_text


def _append(path, text: str):
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


def _line(step, **kw):
    return json.dumps({"time": 1000.0 + step, "step": step, **kw}) + "\n"


def test_reads_only_new_lines_each_call(tmp_path):
    p = tmp_path / "metrics.jsonl"
    tail = JsonlTail(p)
    assert tail.read_new() == []  # missing file is not an error
    _append(p, _line(1, loss=2.0) + _line(2, loss=1.9))
    assert [r["step"] for r in tail.read_new()] == [1, 2]
    assert tail.read_new() == []
    _append(p, _line(3, loss=1.8))
    assert [r["step"] for r in tail.read_new()] == [3]
    assert tail.offset == p.stat().st_size


def test_torn_last_line_is_held_back_until_complete(tmp_path):
    p = tmp_path / "metrics.jsonl"
    full = _line(2, loss=1.5)
    _append(p, _line(1, loss=2.0) + full[:10])
    tail = JsonlTail(p)
    assert [r["step"] for r in tail.read_new()] == [1]
    assert tail.malformed == 0
    _append(p, full[10:-1])  # still no newline
    assert tail.read_new() == []
    _append(p, "\n")
    assert tail.read_new() == [{"time": 1002.0, "step": 2, "loss": 1.5}]
    assert tail.malformed == 0


def test_garbage_lines_are_skipped_and_counted(tmp_path):
    p = tmp_path / "gpu.jsonl"
    _append(p, _line(1) + "not json at all\n" + "[1, 2]\n" + "\xff\xfe{\n" + "\n" + _line(2))
    tail = JsonlTail(p)
    assert [r["step"] for r in tail.read_new()] == [1, 2]
    assert tail.malformed == 3


def test_truncation_restarts_from_zero(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _append(p, _line(1) + _line(2) + _line(3))
    tail = JsonlTail(p)
    assert len(tail.read_new()) == 3
    with open(p, "w") as fh:  # same inode, shorter content
        fh.write(_line(10))
    assert [r["step"] for r in tail.read_new()] == [10]
    assert tail.restarts == 1


def test_replaced_file_restarts_even_when_larger(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _append(p, _line(1))
    tail = JsonlTail(p)
    assert len(tail.read_new()) == 1
    tmp = tmp_path / "metrics.jsonl.tmp"
    tmp.write_text("".join(_line(s) for s in range(100, 105)))
    os.replace(tmp, p)  # new inode, larger than the old offset
    assert [r["step"] for r in tail.read_new()] == [100, 101, 102, 103, 104]
    assert tail.restarts == 1


def test_run_files_rebuild_series_on_replacement(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(_line(1, loss=5.0) + _line(2, loss=4.0))
    files = RunFiles(tmp_path)
    assert files.poll()
    assert list(files.series.metric("loss")[1]) == [5.0, 4.0]
    assert not files.poll()
    tmp = tmp_path / "new"
    tmp.write_text(_line(1, loss=3.0) + _line(2, loss=2.0) + _line(3, loss=1.0))
    os.replace(tmp, tmp_path / "metrics.jsonl")
    assert files.poll()
    assert list(files.series.metric("loss")[1]) == [3.0, 2.0, 1.0]  # old points gone, not mixed in
    assert files.restarts == 1


def test_live_writer_subprocess_loses_and_duplicates_nothing(tmp_path):
    """A real writer flushing half lines at random while we poll: every step arrives exactly once."""
    p = tmp_path / "metrics.jsonl"
    writer = textwrap.dedent(
        f"""
        import json, time
        with open({str(p)!r}, "a") as fh:
            for step in range(1, 401):
                line = json.dumps({{"time": time.time(), "step": step, "loss": 1.0 / step}}) + "\\n"
                cut = len(line) // 2
                fh.write(line[:cut]); fh.flush()
                fh.write(line[cut:]); fh.flush()
                if step % 50 == 0:
                    time.sleep(0.01)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer])
    tail, steps = JsonlTail(p), []
    while proc.poll() is None:
        steps += [r["step"] for r in tail.read_new()]
    steps += [r["step"] for r in tail.read_new()]
    assert proc.returncode == 0
    assert steps == list(range(1, 401))
    assert tail.malformed == 0


def test_unchanged_file_costs_no_read(tmp_path, monkeypatch):
    p = tmp_path / "metrics.jsonl"
    _append(p, _line(1))
    tail = JsonlTail(p)
    tail.read_new()
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    for _ in range(5):
        assert tail.read_new() == []
    assert opened == []


def test_tail_text_reads_only_the_end_of_a_big_file(tmp_path):
    p = tmp_path / "stderr.log"
    with open(p, "w") as fh:
        for i in range(200_000):
            fh.write(f"line {i}\n")
    out = tail_text(p, n_lines=3, max_bytes=4096)
    assert out.splitlines() == ["line 199997", "line 199998", "line 199999"]
    # A cut first line is dropped, never shown half.
    all_lines = tail_text(p, n_lines=10_000, max_bytes=100).splitlines()
    assert all(ln.startswith("line ") for ln in all_lines) and all_lines[-1] == "line 199999"
    assert tail_text(tmp_path / "missing.log") == ""


def test_tail_text_keeps_last_state_of_progress_bars(tmp_path):
    p = tmp_path / "stderr.log"
    p.write_text("start\n 10%|#  | 1/10\r 50%|#####  | 5/10\r100%|##########| 10/10\ndone\n")
    assert tail_text(p).splitlines() == ["start", "100%|##########| 10/10", "done"]


def test_text_tail_follows_growth(tmp_path):
    p = tmp_path / "stderr.log"
    t = TextTail(p, n_lines=2)
    assert t.read() == ""
    p.write_text("a\nb\n")
    assert t.read() == "a\nb"
    _append(p, "c\n")
    assert t.read() == "b\nc"


def test_run_series_columns_and_incremental_ema(tmp_path):
    s = RunSeries(smoothing_steps=1.0)
    s.add_metrics(
        [{"time": 1, "step": 1, "loss": 4.0}, {"time": 2, "step": 2, "loss": 2.0, "eval_loss": 3.0}]
    )
    s.add_metrics([{"time": 3, "step": 3, "loss": float("nan")}, {"time": 4, "step": 4, "loss": 1.0}])
    s.add_metrics([{"step": "x", "loss": 1.0}, {"time": 5}, {"step": 5, "loss": "oops"}])  # unusable: ignored
    steps, loss = s.metric("loss")
    assert list(steps) == [1, 2, 3, 4]  # step 5 had no numeric loss
    assert math.isnan(loss[2])
    # the debiased EMA over 1 step skips the NaN: each point decays the past by exp(-Δstep)
    e1 = math.exp(-1)
    first, second = 4.0, (4.0 * e1 + 2.0) / (e1 + 1)
    third = ((4.0 * e1 + 2.0) * e1**2 + 1.0) / ((e1 + 1) * e1**2 + 1)
    assert list(s.ema_loss.arrays()[1]) == pytest.approx([first, second, third])
    assert list(s.metric("eval_loss")[0]) == [2.0]
    s.add_gpu(
        [{"time": 10.0, "index": 0, "memory_used": 5, "utilization": 90, "other_processes": [{"pid": 7}]}]
    )
    assert list(s.gpu_series("memory_used")[1]) == [5.0]
    assert s.gpu_other_processes[0] == [{"pid": 7}]
    assert s.last_step == 5 and s.first_time == 1 and s.last_time == 4


def test_replace_during_polling_with_real_atomic_writes(tmp_path):
    """status-like rewrites by os.replace while polling never yield a half-written record."""
    p = tmp_path / "metrics.jsonl"
    tail = JsonlTail(p)
    seen = []
    for gen in range(20):
        tmp = tmp_path / f".m{gen}"
        tmp.write_text("".join(_line(gen * 100 + i) for i in range(gen + 1)))
        os.replace(tmp, p)
        seen.append([r["step"] for r in tail.read_new()])
        time.sleep(0.001)
    assert seen[-1] == [1900 + i for i in range(20)]
    assert tail.malformed == 0


def test_rewritten_in_place_with_more_content_restarts(tmp_path):
    """Same inode, bigger size, different start (a writer that reopened with "w"): caught by the head check."""
    p = tmp_path / "metrics.jsonl"
    _append(p, _line(1) + _line(2))
    tail = JsonlTail(p)
    assert len(tail.read_new()) == 2
    with open(p, "w") as fh:
        fh.write("".join(_line(s) for s in range(50, 60)))
    assert [r["step"] for r in tail.read_new()] == list(range(50, 60))
    assert tail.restarts == 1


def test_nan_and_infinity_tokens_as_json_dumps_writes_them(tmp_path):
    """A diverged loss is logged as NaN/Infinity by json.dumps; it must arrive as a number, not as garbage."""
    p = tmp_path / "metrics.jsonl"
    p.write_text(
        json.dumps({"step": 1, "loss": float("nan")})
        + "\n"
        + json.dumps({"step": 2, "loss": float("inf")})
        + "\n"
    )
    tail = JsonlTail(p)
    recs = tail.read_new()
    assert tail.malformed == 0
    assert math.isnan(recs[0]["loss"]) and recs[1]["loss"] == float("inf")


def test_dpo_figures_are_columns_with_smoothed_twins():
    """TRL's DPOTrainer figures (names with a slash, eval_ twins) become series; the training ones get the same
    debiased EMA as the loss, recomputed when the window changes; SFT lines carry none and get none."""
    s = RunSeries(smoothing_steps=1.0)
    s.add_metrics([{"time": 1, "step": 1, "loss": 2.0}])
    assert not s.has_preference_metrics and set(s.smoothed) == {"loss"}
    s.add_metrics(
        [
            {"time": 2, "step": 2, "loss": 0.69, "rewards/margins": 0.0, "rewards/accuracies": 0.5},
            {"time": 3, "step": 3, "loss": 0.6, "rewards/margins": 2.0, "rewards/accuracies": "nan"},
            {"time": 4, "step": 3, "eval_loss": 0.7, "eval_rewards/accuracies": 0.75, "logps/chosen": "x"},
        ]
    )
    assert s.has_preference_metrics
    assert list(s.metric("eval_rewards/accuracies")[1]) == [0.75]
    assert "logps/chosen" not in s.metrics and "eval_rewards/accuracies" not in s.smoothed
    e1 = math.exp(-1)
    assert list(s.smooth("rewards/margins")[1]) == pytest.approx([0.0, 2.0 / (e1 + 1)])
    assert list(s.smooth("rewards/accuracies")[1]) == [0.5]  # the NaN is skipped, as for the loss
    assert s.smooth("logps/rejected")[0].size == 0  # never logged: empty, not an error
    assert s.set_smoothing(100.0)
    assert list(s.smooth("rewards/margins")[1]) == pytest.approx([0.0, 2.0 * 1 / (math.exp(-0.01) + 1)])
    assert list(s.ema_loss.arrays()[0]) == [1, 2, 3]
