"""The Monitor page through AppTest, on run directories written by real runs: one that finished (trained in this
process by core.train.run.run_training) and one that failed (a real trainer subprocess whose model folder vanished)."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from core.monitor.diagnose import diagnose_run
from core.runs.launcher import create_run, launch, wait_for
from core.train.run import StopFlag, run_training

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "monitor.py")


def write_dataset(path: Path, n: int = 40) -> Path:
    path.write_text(
        "".join(json.dumps({"instruction": f"twice {i}", "output": f"{2 * i}"}) + "\n" for i in range(n))
    )
    return path


def finished_run(workspace: Path, model: Path, name: str = "done") -> Path:
    """A real, short LoRA run with eval, trained in this process (the trainer's own code path)."""
    data = write_dataset(workspace / "train.jsonl")
    cfg = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "max_length": 48, "eval_split": 0.2},
        "training": {
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "max_steps": 6,
            "logging_steps": 1,
            "eval_steps": 3,
            "save_steps": 3,
        },
    }
    run_dir = create_run(workspace, name, cfg)
    run_training(run_dir / "config.yaml", run_dir, stop=StopFlag())
    return run_dir


def failed_run(workspace: Path, model: Path, name: str = "broken") -> Path:
    """A real trainer subprocess that dies: its model folder is deleted between create and launch."""
    gone = shutil.copytree(model, workspace / "model-that-vanishes")
    cfg = {"model": {"path": str(gone)}, "data": {"path": str(write_dataset(workspace / "d2.jsonl"))}}
    run_dir = create_run(workspace, name, cfg)
    shutil.rmtree(gone)
    launch(run_dir)
    info = wait_for(run_dir, timeout=120)
    assert info.state == "failed", info
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama) -> tuple[Path, Path, Path]:
    ws = tmp_path_factory.mktemp("ws_monitor")
    return ws, finished_run(ws, tiny_llama), failed_run(ws, tiny_llama)


def _page(workspace: Path, monitor_run: Path | None = None) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.session_state["workspace"] = str(workspace)
    if monitor_run is not None:
        at.session_state["monitor_run"] = str(monitor_run)
    at.run()
    assert not at.exception, at.exception
    return at


def _metric(at, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_no_runs_is_a_friendly_message(workspace):
    at = _page(workspace)
    assert any("No runs yet" in i.value for i in at.info)
    assert not at.error


@pytest.mark.slow  # builds the two real runs (~20 s) shared by this module
def test_finished_run_shows_state_charts_and_no_gpu_reason(runs):
    ws, done, _ = runs
    at = _page(ws, done)
    assert at.selectbox(key="mon_run").value == str(done)
    assert _metric(at, "State") == "finished"
    status = json.loads((done / "status.json").read_text())
    assert _metric(at, f"Step (of {status['max_steps']})") == str(status["step"])
    assert at.button(key="mon_stop").disabled  # nothing to stop
    charts = at.get("vega_lite_chart")
    assert len(charts) >= 4  # loss, learning rate, grad norm, memory
    # No NVML here (a reason is given): the memory chart is the training process's CPU memory (issue #16)
    assert any(c.value.startswith("No GPU samples (") and "CPU memory" in c.value for c in at.caption)
    specs = [json.dumps(c.proto.spec) if hasattr(c, "proto") else "" for c in charts]
    assert any("CPU memory of the training process" in sp for sp in specs)
    rss = [m["rss_bytes"] for m in map(json.loads, (done / "metrics.jsonl").read_text().splitlines())]
    assert rss and all(r > 50 * 2**20 for r in rss)  # a real process's resident memory, every log line
    assert not at.error


@pytest.mark.slow
def test_failed_run_shows_reason_diagnosis_and_stderr(runs):
    ws, _, broken = runs
    at = _page(ws, broken)
    assert _metric(at, "State") == "failed"
    assert any(e.value.startswith("**The run failed.**") for e in at.error)
    title = diagnose_run(broken).title
    assert any("#### Diagnosis" in m.value for m in at.markdown)
    assert any(title in m.value for m in at.markdown), title
    stderr = (broken / "stderr.log").read_text().strip().splitlines()[-1]
    assert any(stderr in c.value for c in at.code)


@pytest.mark.slow
def test_newest_run_is_the_default_and_the_selection_follows_other_pages(runs):
    ws, done, broken = runs
    at = _page(ws)
    assert at.selectbox(key="mon_run").value == str(broken)  # created last
    at.session_state["monitor_run"] = str(done)  # what the Train or Runs page sets before switching
    at.run()
    assert at.selectbox(key="mon_run").value == str(done)
    assert _metric(at, "State") == "finished"


@pytest.mark.slow
def test_stopped_run_with_a_checkpoint_offers_resume_and_says_why(workspace, tiny_llama):
    """Issue #11: controls follow the state: no Stop on a stopped run, a Resume button, the stop reason."""
    import time

    from core.runs.launcher import run_state, stop_run

    cfg = {
        "model": {"path": str(tiny_llama)},
        "data": {"path": str(write_dataset(workspace / "t.jsonl"))},
        "training": {"max_length": 48, "max_steps": 2000, "save_steps": 5, "logging_steps": 5},
    }
    run_dir = create_run(workspace, "pausing", cfg)
    launch(run_dir)
    deadline = time.time() + 180
    while run_state(run_dir).step < 6:
        assert time.time() < deadline, "the run did not get going"
        time.sleep(0.2)
    assert stop_run(run_dir, grace_s=120) == "stopped"
    at = _page(workspace, run_dir)
    assert [b.label for b in at.button if b.key == "mon_stop"] == []  # nothing to stop
    assert any(c.value.startswith("Why it stopped: Stopped by SIGTERM") for c in at.caption)
    at.button(key="mon_resume").click().run()
    assert not at.exception, at.exception
    try:
        assert run_state(run_dir).state in ("starting", "running")
    finally:
        stop_run(run_dir, grace_s=120)


def test_a_reload_comes_back_on_the_run_the_url_names(workspace):
    """Issue #51: reloaded while watching a run, the Monitor came back on the newest one. The URL keeps the run
    shown (?run=NAME); a new session (what a reload is) opens it; a name no longer there falls back to the
    newest; a run chosen on another page comes first."""
    import os

    runs = {}
    for age, name in enumerate(("watched", "newest")):
        run = runs[name] = workspace / "runs" / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
        (run / "status.json").write_text(json.dumps({"state": "finished", "step": 5, "max_steps": 5}))
        (run / "metrics.jsonl").write_text(json.dumps({"time": 1.0, "step": 5, "loss": 1.5}) + "\n")
        os.utime(run / "config.yaml", (1e9 + age, 1e9 + age))  # the newest run is listed first
    at = _page(workspace)
    assert at.selectbox(key="mon_run").value == str(runs["newest"]) and at.query_params["run"] == "newest"
    at.selectbox(key="mon_run").set_value(str(runs["watched"])).run()
    assert at.query_params["run"] == "watched"  # the user's pick, in the URL

    def reload(run_name: str, **state) -> AppTest:
        again = AppTest.from_file(PAGE, default_timeout=60)
        again.session_state["workspace"] = str(workspace)
        for key, value in state.items():
            again.session_state[key] = value
        again.query_params["run"] = run_name
        again.run()
        assert not again.exception, again.exception
        return again

    assert reload("watched").selectbox(key="mon_run").value == str(runs["watched"])
    assert reload("deleted-since").selectbox(key="mon_run").value == str(runs["newest"])
    chosen = reload("watched", monitor_run=str(runs["newest"]))  # what the Runs or Train page sets
    assert (
        chosen.selectbox(key="mon_run").value == str(runs["newest"])
        and chosen.query_params["run"] == "newest"
    )


def test_a_resumed_runs_time_leaves_out_the_time_it_sat_stopped(workspace, tiny_llama):
    """Issue #51: a resumed run showed 3:45 for ~1:50 of training (Elapsed was now minus its first start). Two real
    attempts of one run (its trainer fails at once: its model folder is gone) with a stop between them: the
    Monitor and the Runs page's summary count the attempts, not the stop."""
    import time

    from core.monitor.summary import summarize_run

    stopped = 6.0  # longer than the slack of the attempts' measured spans below
    gone = shutil.copytree(tiny_llama, workspace / "model-that-vanishes")
    cfg = {"model": {"path": str(gone)}, "data": {"path": str(write_dataset(workspace / "d.jsonl"))}}
    run_dir = create_run(workspace, "resumed", cfg)
    shutil.rmtree(gone)
    spans = []
    for resume in (False, True):
        t0 = time.time()
        launch(run_dir, resume=resume)
        assert wait_for(run_dir, timeout=120).state == "failed"
        spans.append(time.time() - t0)  # at least the attempt's own span
        if not resume:
            time.sleep(stopped)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["ended"] - status["started"] > stopped  # the wall clock spans the stop
    m, s = map(int, _metric(_page(workspace, run_dir), "Elapsed").split(":"))
    assert 60 * m + s <= sum(spans), (m, s, spans)  # the stop alone would be more
    assert 0 < summarize_run(run_dir).duration_s <= sum(spans), spans


def test_a_chart_of_one_point_shows_it_with_plain_axis_labels(workspace):
    """Issue #16: one logged point drew nothing, axes read 5.000000, and series came out in similar blues."""
    run = workspace / "runs" / "one-point"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 5, "max_steps": 5}))
    (run / "metrics.jsonl").write_text(
        json.dumps({"time": 1.0, "step": 5, "loss": 1.5, "learning_rate": 1e-4}) + "\n"
    )
    at = _page(workspace, run)
    specs = [c.proto.spec for c in at.get("vega_lite_chart")]
    loss = next(json.loads(sp) for sp in specs if '"loss"' in sp)
    layer = loss.get("layer", [loss])[0]
    assert layer["mark"].get("point") is True
    assert layer["encoding"]["x"]["axis"]["format"] == ",~f"
    assert layer["encoding"]["color"]["scale"]["scheme"] == "tableau10"


def test_a_live_run_whose_process_is_stopped_says_it_is_stalled(workspace):
    """Issue #21 item 6: a frozen trainer read as running for ever. Its process here is a real one that owns the
    run folder (core.procs.spawn) and is stopped with SIGSTOP; once continued, the warning goes."""
    import os
    import re
    import signal
    import sys
    import time

    from core import procs, stopping

    run = workspace / "runs" / "frozen"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
    now = time.time()
    status = {"state": "running", "step": 5, "max_steps": 100, "started": now - 60, "updated": now - 30}
    (run / "status.json").write_text(json.dumps(status))
    fd = procs.claim(run)
    try:
        pid = procs.spawn(run, [sys.executable, "-c", "import time; time.sleep(600)"], fd)
    finally:
        os.close(fd)
    try:
        os.kill(pid, signal.SIGSTOP)
        deadline = time.time() + 30
        while not procs.is_stopped(pid):
            assert time.time() < deadline
            time.sleep(0.05)
        at = _page(workspace, run)
        stalled = [w.value for w in at.warning if w.value.startswith("**Stalled**")]
        assert len(stalled) == 1 and re.search(r"no step for \d+ s \(process stopped\)", stalled[0]), stalled
        assert _metric(at, "State") == "running"
        os.kill(pid, signal.SIGCONT)
        while procs.is_stopped(pid):
            assert time.time() < deadline
            time.sleep(0.05)
        at = _page(workspace, run)
        assert not [w for w in at.warning if w.value.startswith("**Stalled**")]
    finally:
        stopping.stop(run, grace_s=30)


def _titled_charts(at) -> dict[str, tuple[dict, list]]:
    """{chart title: (vega-lite spec, [each layer's data as a DataFrame])} in page order."""
    import pyarrow as pa

    out = {}
    for chart in at.get("vega_lite_chart"):
        spec = json.loads(chart.proto.spec)
        title = spec.get("title") or next(
            lay.get("title") for lay in spec.get("layer", []) if lay.get("title")
        )
        # a chart drawn from a cached spec carries its data as the chart's own; an Altair chart as named datasets
        own = [chart.proto.data.data] if chart.proto.HasField("data") and chart.proto.data.data else []
        frames = [
            pa.ipc.open_stream(b).read_all().to_pandas()
            for b in own + [d.data.data for d in chart.proto.datasets]
        ]
        # a layer's own small data (the dashed lines) rides inline in the spec
        frames += [
            pd.DataFrame(lay["data"]["values"])
            for lay in spec.get("layer", [])
            if "values" in lay.get("data", {})
        ]
        out[title] = (spec, frames)
    return out


DPO_TITLES = ("Rewards (DPO)", "Preference accuracy", "Log-probs (chosen vs rejected)")


def test_dpo_run_shows_rewards_accuracy_and_logps_under_the_loss(workspace):
    """Issue #13: a DPO run (synthetic, in the trainer's format) gets its three charts under the loss chart."""
    from test_watch import write_dpo_run

    run = write_dpo_run(workspace / "runs" / "dpo", "healthy", steps=100, state="finished")
    at = _page(workspace, run)
    assert any(" · DPO · " in label for label in at.selectbox(key="mon_run").options)  # the selector names it
    charts = _titled_charts(at)
    titles = list(charts)
    assert titles[0] == "Loss" and all(t in titles for t in DPO_TITLES)
    assert titles.index("Log-probs (chosen vs rejected)") < titles.index(
        "Learning rate"
    )  # under the loss row
    series = {t: set(charts[t][1][0]["series"]) for t in DPO_TITLES}
    assert series["Rewards (DPO)"] == {
        "chosen",
        "chosen (smoothed)",
        "rejected",
        "rejected (smoothed)",
        "margin",
        "margin (smoothed)",
        "eval margin",
    }
    assert series["Preference accuracy"] == {"train", "train (smoothed)", "eval"}
    assert series["Log-probs (chosen vs rejected)"] == {
        "chosen",
        "chosen (smoothed)",
        "rejected",
        "rejected (smoothed)",
    }
    # the coin-flip line under the accuracy, on a 0..1 axis
    spec, frames = charts["Preference accuracy"]
    assert frames[1].to_dict("records") == [{"line": "chance (0.5)", "value": 0.5}]
    assert spec["layer"][0]["encoding"]["y"]["scale"]["domain"] == [0, 1]
    # raw training points see-through under their smoothed twins
    assert spec["layer"][0]["encoding"]["opacity"]["value"] == 0.3
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(recs) if "rewards/accuracies" in r)
    last_eval = next(r for r in reversed(recs) if "eval_rewards/accuracies" in r)
    caption = f"last accuracy {last['rewards/accuracies']:.2f} · eval accuracy {last_eval['eval_rewards/accuracies']:.2f}"
    assert any(c.value.startswith(caption) for c in at.caption)
    assert not at.warning and not at.error  # a healthy run: no DPO warning


def test_dpo_run_that_does_not_learn_shows_the_warning_and_sft_shows_no_dpo_chart(workspace):
    from test_watch import write_dpo_run

    stuck = write_dpo_run(workspace / "runs" / "stuck", "chance", steps=100, state="running")
    at = _page(workspace, stuck)
    assert any(
        "accuracy is stuck at chance" in w.value and "training.learning_rate" in w.value for w in at.warning
    )
    sft = workspace / "runs" / "sft"
    sft.mkdir()
    (sft / "config.yaml").write_text("method: sft\nmodel: {path: m}\ndata: {path: d.jsonl}\n")
    (sft / "status.json").write_text(json.dumps({"state": "finished", "step": 30, "max_steps": 30}))
    (sft / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {"time": float(s), "step": s, "loss": 2.0 - s / 30, "learning_rate": 1e-4, "grad_norm": 1.0}
            )
            + "\n"
            for s in range(1, 31)
        )
    )
    at = _page(workspace, sft)
    titles = list(_titled_charts(at))
    assert titles[0] == "Loss" and "Learning rate" in titles
    assert not set(DPO_TITLES) & set(titles)
    assert not any(c.value.startswith(("last accuracy", "Rewards (DPO)", "Preference")) for c in at.caption)


def dpo_finished_run(workspace: Path, model: Path, name: str = "dpo-real") -> Path:
    """A real, short `method: dpo` LoRA run with eval (TRL's DPOTrainer through the trainer's own code path), on
    the demo's preference pairs."""
    from core.demo.prefs import write_pref_data

    train, _ = write_pref_data(workspace / "prefs")
    cfg = {
        "method": "dpo",
        "model": {"path": str(model)},
        "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": str(train), "format": "standard", "eval_split": 0.2},
        "training": {
            "max_length": 32,
            "per_device_train_batch_size": 8,
            "max_steps": 6,
            "learning_rate": 2e-3,
            "logging_steps": 1,
            "eval_steps": 3,
            "save_steps": 6,
            "gradient_checkpointing": False,
        },
    }
    run_dir = create_run(workspace, name, cfg)
    run_training(run_dir / "config.yaml", run_dir, stop=StopFlag())
    return run_dir


@pytest.mark.slow  # a real DPO run (~25 s on 2 CPU cores)
def test_real_dpo_run_shows_its_charts_here_and_its_figures_on_the_runs_page(workspace, tiny_llama):
    run = dpo_finished_run(workspace, tiny_llama)
    at = _page(workspace, run)
    assert _metric(at, "State") == "finished"
    charts = _titled_charts(at)
    assert set(charts[DPO_TITLES[0]][1][0]["series"]) >= {"chosen", "rejected", "margin", "eval margin"}
    assert set(charts["Preference accuracy"][1][0]["series"]) == {"train", "train (smoothed)", "eval"}
    assert set(charts[DPO_TITLES[2]][1][0]["series"]) >= {"chosen", "rejected"}
    runs = AppTest.from_file(str(Path(PAGE).with_name("runs.py")), default_timeout=60)
    runs.session_state["workspace"] = str(workspace)
    runs.run()
    assert not runs.exception, runs.exception
    row = runs.dataframe[0].value.set_index("run").loc[run.name]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_eval = [m for m in metrics if "eval_rewards/accuracies" in m][-1]
    assert row["method"] == "dpo"
    assert row["reward accuracy"] == f"{last_eval['eval_rewards/accuracies']:.2f} (eval)"


def test_a_run_trained_on_another_machine_is_followed_from_its_reports_and_never_signalled(workspace):
    """Issue #22 item 4: a run directory on shared storage, trained by a process on another host (its pid record
    says so). Here its pid names a real local process that a signal would kill: the Monitor reads the run as
    running while its status is fresh, Stop says where to stop it and signals nothing, a launch is refused, and a
    status gone quiet reads as failed naming the host."""
    import subprocess
    import sys
    import time

    from core import procs
    from core.runs import launcher

    run = workspace / "runs" / "cluster"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record = {
            "pid": bystander.pid,
            "start_time": procs.process_start_time(bystander.pid),
            "host": "node-7",
        }
        (run / "pid").write_text(json.dumps(record))
        (run / "lock").touch()
        now = time.time()
        status = {"state": "running", "step": 40, "max_steps": 100, "started": now - 600, "updated": now - 5}
        (run / "status.json").write_text(json.dumps({**status, "step_s": 1.0}))
        at = _page(workspace, run)
        assert _metric(at, "State") == "running"
        at.button(key="mon_stop").click().run()
        assert not at.exception, at.exception
        assert any("is running on node-7" in e.value and "stop it there" in e.value for e in at.error)
        with pytest.raises(launcher.RunError, match="running on node-7"):
            launcher.launch(run, resume=True)
        assert bystander.poll() is None  # no signal crossed to the local process the pid happens to name

        (run / "status.json").write_text(json.dumps({**status, "updated": now - 3600, "step_s": 1.0}))
        info = launcher.run_state(run)
        assert (info.state, info.alive) == ("failed", False)
        assert "on node-7 has not reported" in info.reason
    finally:
        bystander.kill()
        bystander.wait()
