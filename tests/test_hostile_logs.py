"""One absurd line in a run's logs never stops its reader or breaks a page (issue #11): a huge number, deep
nesting, a multi-megabyte line, binary garbage. Each is skipped and counted; the lines after it are read."""

import json

from core.monitor.summary import summarize_runs
from core.monitor.tail import JsonlTail, RunSeries
from core.monitor.watch import RunWatcher

GOOD = [{"time": 1.0 + i, "step": i, "loss": 2.0 - i / 10} for i in range(1, 4)]
HOSTILE = [
    b'{"time": 5, "step": 5, "loss": 1' + b"0" * 400 + b"}",  # an integer beyond float range
    # nesting deeper than any JSON parser recurses (orjson 3.8 segfaulted from about 150k deep)
    b"[" * 200_000 + b"]" * 200_000,
    b'{"note": "' + b"x" * (9 << 20) + b'"}',  # a 9 MiB line (longer than a read chunk)
    b"\x00\xff\xfe garbage \x80",
]


def _write(path, lines):
    with open(path, "wb") as fh:
        for line in lines:
            fh.write(line + b"\n")


def test_reader_skips_counts_and_keeps_reading(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(GOOD[0]).encode(), *HOSTILE, *(json.dumps(r).encode() for r in GOOD[1:])]
    _write(path, lines)
    tail = JsonlTail(path)
    records = tail.read_new()
    series = RunSeries.from_records(records)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert tail.malformed == 4  # the huge number, the nesting, the long line, the garbage
    assert series.metric("loss")[0].tolist() == [1.0, 2.0, 3.0]  # step 5's unusable loss skipped
    with open(path, "ab") as fh:  # and the reader is not stuck: a later line still arrives
        fh.write(json.dumps({"time": 9.0, "step": 9, "loss": 0.5}).encode() + b"\n")
    assert [r["step"] for r in tail.read_new()] == [9]


def test_a_broken_run_is_one_row_and_the_others_still_show(tmp_path):
    runs = tmp_path / "runs"
    good, bad = runs / "good", runs / "bad"
    for d in (good, bad):
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("model: {path: m}\n")
    _write(good / "metrics.jsonl", [json.dumps(r).encode() for r in GOOD])
    (good / "status.json").write_text(json.dumps({"state": "finished", "step": 3, "started": 1.0}))
    _write(bad / "metrics.jsonl", HOSTILE)
    (bad / "status.json").write_text("[" * 100_000)
    rows = {r.name: r for r in summarize_runs(runs)}
    assert rows["good"].final_loss == GOOD[-1]["loss"] and rows["good"].state == "finished"
    assert rows["bad"].malformed == 4 and rows["bad"].final_loss is None
    snap = RunWatcher(bad).refresh()  # the Monitor's reader of the broken run does not raise either
    assert snap.malformed_lines >= 4


HUGE = "1" + "0" * 400  # an integer no float holds


def test_a_huge_integer_is_skipped_and_counted_by_every_reader(tmp_path):
    """Issue 25: a line with a 400-digit step and loss, then valid lines. The CLI's list/show (text and --json),
    the Runs and Monitor readers, the diagnosis and the resume-time rewrite of metrics.jsonl skip it, count it
    and read on; none raises."""
    import os
    import subprocess
    import sys

    from core.monitor.diagnose import diagnose_run
    from core.rundir import read_metrics, truncate_metrics

    run = tmp_path / "runs" / "huge"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: m}\n")
    (run / "status.json").write_text(
        json.dumps({"state": "failed", "step": 3, "started": 1.0, "reason": "x"})
    )
    huge = f'{{"time": 1.5, "step": {HUGE}, "loss": {HUGE}}}'.encode()
    _write(run / "metrics.jsonl", [huge, *(json.dumps(r).encode() for r in GOOD)])
    (run / "gpu.jsonl").write_text(f'{{"time": {HUGE}, "index": 0, "memory_used": {HUGE}}}\n')

    env = {**os.environ, "LORA_COCKPIT_WORKSPACE": str(tmp_path)}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for args in (["list", "--json"], ["show", "huge", "--json"], ["list"], ["show", "huge"]):
        done = subprocess.run(
            [sys.executable, "-m", "core.runs", *args], cwd=repo, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr[-2000:])
        if "--json" in args:
            obj = json.loads(done.stdout)
            obj = obj[0] if isinstance(obj, list) else obj
            assert obj["loss"] == GOOD[-1]["loss"] and obj["malformed"] == 1, obj
        else:
            assert "loss 1.7" in done.stdout, done.stdout

    (row,) = summarize_runs(tmp_path / "runs")  # the Runs page
    assert row.final_loss == GOOD[-1]["loss"] and row.malformed == 1
    watcher = RunWatcher(run)  # the Monitor page
    assert watcher.refresh().malformed_lines == 2  # the metrics line and the GPU line
    assert watcher.files.series.metric("loss")[0].tolist() == [1.0, 2.0, 3.0]
    assert diagnose_run(run).title  # the diagnosis of a failed run
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    truncate_metrics(run, 2)  # what a resume does to the file
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
