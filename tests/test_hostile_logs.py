"""One absurd line in a run's logs never stops its reader or breaks a page (issue #11): a huge number, deep
nesting, a multi-megabyte line, binary garbage. Each is skipped and counted; the lines after it are read."""

import json

from core.monitor.summary import summarize_runs
from core.monitor.tail import JsonlTail, RunSeries
from core.monitor.watch import RunWatcher

GOOD = [{"time": 1.0 + i, "step": i, "loss": 2.0 - i / 10} for i in range(1, 4)]
HOSTILE = [
    b'{"time": 5, "step": 5, "loss": 1' + b"0" * 400 + b"}",  # an integer beyond float range
    b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than any JSON parser recurses
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
    assert [r["step"] for r in records if "loss" in r and r["step"] != 5] == [1, 2, 3]
    assert tail.malformed == 3  # nesting, the long line, the garbage; the huge number parses but is not used
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
    assert rows["bad"].malformed == 3 and rows["bad"].final_loss is None
    snap = RunWatcher(bad).refresh()  # the Monitor's reader of the broken run does not raise either
    assert snap.malformed_lines >= 3
