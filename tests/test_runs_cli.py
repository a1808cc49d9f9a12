"""`python -m core.runs` as a terminal user reads it (issue #21 item 20): a list with a header, a `show` that shows
the whole run, and sentences that point at the command line, not at a page."""

import json
import os
import subprocess
import sys

from core import procs, stopping
from tests.cli import REPO, runs


def _ended_run(workspace, name="demo-1"):
    run = workspace / "runs" / name
    (run / "checkpoints" / "checkpoint-10").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint-20").mkdir()
    (run / "config.yaml").write_text(
        "method: sft\nmodel: {path: /models/base}\ndata: {path: /data/train.jsonl}\n"
        "training: {max_length: 256, per_device_train_batch_size: 2, gradient_accumulation_steps: 4, "
        "learning_rate: 0.0002}\n"
    )
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 2.0 / s, "time": 1000.0 + s}) + "\n" for s in (10, 20))
    )
    (run / "status.json").write_text(
        json.dumps(
            {"state": "stopped", "step": 20, "max_steps": 100, "reason": "stopped by SIGTERM at step 20"}
        )
    )
    (run / "plan.json").write_text(
        json.dumps(
            {
                "device_total_bytes": 3 * 2**30,
                "tensor_peak_bytes": 2**30,
                "verdict": "fits",
                "plan": {"device": "cpu"},
            }
        )
    )
    return run


def test_list_has_a_header_and_show_shows_the_whole_run(tmp_path):
    ws = tmp_path / "ws"
    run = _ended_run(ws)
    listed = runs(ws, "list")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "METH", "STATE", "STEP", "LOSS"] and row.startswith("demo-1")
    shown = runs(ws, "show", "demo-1")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert out != listed.stdout and out.startswith("demo-1: sft run, stopped (no live process)")
    for expected in (
        f"folder       {run}",
        "step         20 of 100, loss 0.1",
        "reason       Stopped by SIGTERM at step 20",
        "model        /models/base (LoRA r16)",
        "data         /data/train.jsonl",
        "max_length 256, batch 2 x 4 accumulation",
        "plan         3.00 GiB on cpu (fits)",
        "checkpoints  checkpoint-20, checkpoint-10 (newest first)",
    ):
        assert expected in out, (expected, out)


def test_texts_for_a_live_run_point_at_the_command_line(tmp_path):
    """A run whose trainer still lives: delete says how to stop it from here; core.train into its folder says it
    is being trained now (not "continue it with --resume")."""
    ws = tmp_path / "ws"
    run = _ended_run(ws, "live-1")
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 20, "max_steps": 100}))
    fd = procs.claim(run)  # the trainer of record: another process that runs and holds the run's lock
    try:
        pid = procs.spawn(run, [sys.executable, "-c", "import time; time.sleep(120)"], fd)
    finally:
        os.close(fd)
    try:
        deleted = runs(ws, "delete", "live-1")
        assert deleted.returncode == 2 and "`python -m core.runs stop live-1`" in deleted.stderr, (
            deleted.stderr
        )
        trained = subprocess.run(
            [sys.executable, "-m", "core.train", str(run / "config.yaml"), "--run-dir", str(run)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert trained.returncode == 2, trained.stderr[-2000:]
        assert (
            f"is being trained right now (pid {pid})" in trained.stderr and "--resume" not in trained.stderr
        )
    finally:
        stopping.kill_tree(pid)
        stopping.wait_gone(run, 30)


def test_a_run_folder_with_a_space_or_accents_is_shown_stopped_and_deleted_by_its_name(tmp_path):
    """Issue #21 item 14: `core.train --run-dir "runs/my run"` makes such folders; list showed them, show, stop and
    delete refused their names. A name is still never a path."""
    ws = tmp_path / "ws"
    for name in ("my run", "café-1"):
        _ended_run(ws, name)
        shown = runs(ws, "show", name)
        assert shown.returncode == 0 and shown.stdout.startswith(f"{name}: sft run, stopped"), shown.stderr
        stopped = runs(ws, "stop", name)
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
        deleted = runs(ws, "delete", name)
        assert deleted.returncode == 0 and not (ws / "runs" / name).exists(), deleted.stderr
    for bad in ("../ws", "runs/x", ".hidden", "nope nope"):
        out = runs(ws, "show", bad)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr


def test_list_keeps_going_past_a_status_of_the_wrong_type_and_a_number_too_long_to_read(tmp_path):
    """One run's broken files are that run's row, never the end of the list: a state that is not a string, and a
    config with a 5,000-digit integer (Python refuses to convert it)."""
    ws = tmp_path / "ws"
    _ended_run(ws)
    odd = _ended_run(ws, "odd-state")
    (odd / "status.json").write_text(json.dumps({"state": {"a": 1}, "step": 3}))
    long = _ended_run(ws, "long-number")
    (long / "config.yaml").write_text("model: {path: m}\ntraining: {max_steps: 1" + "0" * 4999 + "}\n")
    listed = runs(ws, "list")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()[1:] if line and not line.startswith(" ")]
    assert sorted(names) == ["demo-1", "long-number", "odd-state"], listed.stdout
    assert runs(ws, "list", "--json").returncode == 0


def test_a_run_whose_config_is_not_a_file_is_shown_and_deleted_as_it_is_listed(tmp_path):
    ws = tmp_path / "ws"
    run = _ended_run(ws, "odd-config")
    (run / "config.yaml").unlink()
    (run / "config.yaml").mkdir()  # a folder where the config was
    assert "odd-config" in runs(ws, "list").stdout
    shown = runs(ws, "show", "odd-config")
    assert shown.returncode == 0 and shown.stdout.startswith("odd-config:"), shown.stderr
    deleted = runs(ws, "delete", "odd-config")
    assert deleted.returncode == 0 and not run.exists(), deleted.stderr


def test_list_json_is_strict_json_when_a_loss_diverged(tmp_path):
    ws = tmp_path / "ws"
    run = _ended_run(ws, "diverged")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 21, "loss": Infinity, "time": 1021.0}\n')
    for args in (("list", "--json"), ("show", "diverged", "--json")):
        out = runs(ws, *args)
        assert out.returncode == 0, out.stderr

        def refuse(token):
            raise ValueError(token)

        data = json.loads(out.stdout, parse_constant=refuse)  # Infinity / NaN are not JSON
        row = data[0] if isinstance(data, list) else data
        assert row["loss"] is None


def test_list_into_a_pipe_its_reader_closes_early_ends_without_a_trace(tmp_path):
    """`core.runs list | head -1` with more runs than a pipe buffers: no BrokenPipeError trace on stderr."""
    import os

    ws = tmp_path / "ws"
    for i in range(1200):
        run = ws / "runs" / f"run-{i:04d}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("model: {path: m}\n")
    env = dict(os.environ, LORA_COCKPIT_WORKSPACE=str(ws))
    piped = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m core.runs list 2>{tmp_path / 'err'} | head -1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert piped.stdout.startswith("NAME"), piped.stdout
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_reports_into_a_pipe_closed_at_once_exit_0_without_a_trace(tmp_path):
    """#42 §5: `core.diagnose RUN | head` printed a BrokenPipeError trace and `core.runs show NAME | head` exited 1.
    A reader that has had enough is normal: quiet, exit 0 (so `set -o pipefail` scripts go on). `| true` closes the
    pipe before the program writes (a deterministic `| head`)."""
    import os

    ws = tmp_path / "ws"
    run = ws / "runs" / "failed-run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
    (run / "status.json").write_text(json.dumps({"state": "failed", "reason": "CUDA out of memory."}))
    (run / "stderr.log").write_text(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n" * 50
    )
    env = dict(os.environ, LORA_COCKPIT_WORKSPACE=str(ws))
    for command in (f"-m core.diagnose {run}", "-m core.runs show failed-run", "-m core.runs list"):
        piped = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {sys.executable} {command} 2>{tmp_path / 'err'} | true"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        err = (tmp_path / "err").read_text()
        assert piped.returncode == 0 and "Traceback" not in err, (command, piped.returncode, err)
