"""The Monitor reads right (issue #40 item 5): axes in plain numbers, a smoothing window of whole steps, and a CPU
run's memory compared like with like (the process's RSS against what the plan expects the process to hold)."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from core import rundir
from core.estimate.ram import RUNTIME_BYTES

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "monitor.py")
MiB, GiB = 2**20, 2**30
TENSORS = 65 * MiB  # the demo's plan: its tensor peak


def cpu_run(workspace: Path) -> Path:
    """A finished run folder as the trainer leaves one on a CPU: 200 steps over 12 minutes, the process's RSS at
    each log line, and its plan."""
    run = workspace / "runs" / "on-cpu"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
    (run / rundir.STATUS).write_text(json.dumps({"state": "finished", "step": 200, "max_steps": 200}))
    (run / rundir.PLAN).write_text(
        json.dumps({"tensor_peak_bytes": TENSORS, "device_total_bytes": TENSORS, "gpu_bytes": 24 * GiB})
    )
    rows = [
        {"time": 1000.0 + 3.6 * step, "step": step, "loss": 3.0 / step, "learning_rate": 3e-3 * (1 - step / 201),
         "rss_bytes": (560 + step / 10) * MiB}
        for step in range(10, 201, 10)
    ]  # fmt: skip
    (run / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _page(workspace: Path, run: Path) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.session_state["workspace"] = str(workspace)
    at.session_state["monitor_run"] = str(run)
    at.run()
    assert not at.exception, at.exception
    return at


def _specs(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


def _encodings(spec: dict) -> list[dict]:
    layers, found = [spec], []
    while layers:
        layer = layers.pop()
        layers += layer.get("layer", [])
        if "encoding" in layer:
            found.append(layer["encoding"])
    return found


def test_every_axis_is_in_plain_numbers_and_steps_are_whole(workspace):
    """'1e+2, 1.2e+2' steps and '1e+1' minutes: "~g" took the ticks' precision as significant digits."""
    at = _page(workspace, cpu_run(workspace))
    specs = _specs(at)
    assert len(specs) >= 3  # loss, memory, learning rate
    for spec in specs:
        axes = [
            (channel, enc[channel]["field"], enc[channel]["axis"])
            for enc in _encodings(spec)
            for channel in ("x", "y")
            if "axis" in enc.get(channel, {})
        ]  # a rule drawn over the lines shares their axis
        assert {channel for channel, _, _ in axes} == {"x", "y"}, spec
        for channel, field, ax in axes:
            assert ax["format"] == ",~f", (channel, ax)
            assert (ax.get("tickMinStep") == 1) == (field == "step"), (channel, field, ax)


def test_the_smoothing_window_is_a_whole_number_of_steps(workspace):
    at = _page(workspace, cpu_run(workspace))
    window = at.number_input(key="mon_smoothing")
    assert window.value == 20 and isinstance(window.value, int)  # shown as "20", not "20.00"
    window.set_value(35).run()
    assert not at.exception, at.exception


def test_a_cpu_runs_rss_is_drawn_against_what_the_plan_expects_the_process_to_hold(workspace):
    """The chart drew RSS (~0.6 GiB) against the plan's tensor bytes (~0.06 GiB): a newcomer read a 10x miss."""
    at = _page(workspace, cpu_run(workspace))
    memory = next(s for s in _specs(at) if "CPU memory of the training process" in json.dumps(s))
    rules = [
        row
        for data in [
            *memory.get("datasets", {}).values(),
            *(lay.get("data", {}).get("values", []) for lay in memory.get("layer", [])),
        ]
        for row in data
        if isinstance(row, dict) and "line" in row
    ]
    if not rules:  # Streamlit sends the frames beside the spec
        import pyarrow as pa

        chart = next(c for c in at.get("vega_lite_chart") if "CPU memory" in c.proto.spec)
        frames = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets]
        rules = [r for f in frames if "line" in f for r in f.to_dict("records")]
    assert [r["line"] for r in rules] == ["plan: tensors + runtime"]
    assert abs(rules[0]["value"] - (TENSORS + RUNTIME_BYTES) / GiB) < 1e-6  # 0.56 GiB next to RSS ~0.57 GiB
    caption = next(c.value for c in at.caption if c.value.startswith("No GPU samples ("))
    assert "RSS is everything the training process holds" in caption
    assert (
        "its tensor peak (65.0 MiB) + about 0.50 GiB for Python, torch and the training libraries" in caption
    )
