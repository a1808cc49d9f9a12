"""The world outside breaks things (issue #21): a read-only or full workspace, FIFOs and /dev/zero where run files
should be, a trainer killed from outside. Reads never write, never hang, never fill memory; a dead run reads as
failed with a reason that is a sentence. Real processes, real files, a real tmpfs (root only)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_dead_run(run_dir: Path, model_path: str = "/nonexistent/model", stderr: str = "", rss=None) -> Path:
    """A run folder as a trainer SIGKILLed mid-run leaves it: status "running", a pid record of a process that is
    gone, metrics, the tail of its stderr."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"model: {{path: {model_path}}}\ntraining: {{max_steps: 50}}\n")
    now = time.time()
    (run_dir / "status.json").write_text(
        json.dumps(
            {
                "state": "running",
                "reason": None,
                "step": 7,
                "max_steps": 50,
                "started": now - 60,
                "updated": now - 5,
            }
        )
    )
    (run_dir / "pid").write_text(json.dumps({"pid": _dead_pid(), "start_time": 1.0, "session_leader": True}))
    (run_dir / "lock").write_text("")
    lines = []
    for step in range(1, 8):
        rec = {"time": now - 60 + step, "step": step, "loss": 2.0 - step / 10}
        if rss is not None:
            rec["rss_bytes"] = rss
        lines.append(json.dumps(rec) + "\n")
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    (run_dir / "stderr.log").write_text(stderr)
    return run_dir


@pytest.fixture()
def tmpfs(tmp_path):
    """A 20 MiB tmpfs at tmp_path/mnt (unmounted at teardown); skipped where mounting is not allowed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)]).returncode
    ):
        pytest.skip("needs root to mount a tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _main(module: str, *args) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` as its main(argv) in this process (tests/cli.py: in_process), for refusals that need
    no process of their own; the hang, memory-cap and read-only-mount checks keep real subprocesses (_cli)."""
    import importlib

    from tests.cli import in_process

    mains = {
        "core.gguf": "core.gguf.__main__",
        "core.train": "core.train.cli",
        "core.runs": "core.runs.__main__",
    }
    return in_process(importlib.import_module(mains[module]).main, *args)


def _cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


# ---- item 8: reads never write ------------------------------------------------------------------------------


def test_reads_of_a_dead_run_on_a_read_only_workspace_write_nothing(tmpfs):
    from core.monitor.diagnose import diagnose_run
    from core.monitor.summary import summarize_runs
    from core.monitor.watch import RunWatcher
    from core.runs.launcher import list_runs, run_state

    ws = tmpfs / "ws"
    run_dir = make_dead_run(ws / "runs" / "killed", stderr="loading\nstep 7 done\n")
    before = (run_dir / "status.json").read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)

    info = run_state(run_dir)
    assert info.state == "failed" and not info.alive
    assert info.reason.splitlines()[0].startswith("The training process (pid ")
    assert info.reason.splitlines()[-1] == "step 7 done"
    assert [r.state for r in list_runs(ws)] == ["failed"]
    assert [r.state for r in summarize_runs(ws / "runs")] == ["failed"]
    snap = RunWatcher(run_dir).refresh()
    assert snap.state == "failed" and snap.diagnosis is not None
    assert diagnose_run(run_dir).rule != "unknown"
    env = dict(os.environ, LORA_COCKPIT_WORKSPACE=str(ws))
    for args in (("core.runs", "list"), ("core.runs", "show", "killed"), ("core.diagnose", str(run_dir))):
        proc = _cli(*args, env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
    assert "failed" in _cli("core.runs", "list", env=env).stdout
    assert (
        run_dir / "status.json"
    ).read_bytes() == before  # nothing written: the file says what the trainer wrote


# ---- item 12: a FIFO or /dev/zero where a run file should be --------------------------------------------------

READ_ALL = textwrap.dedent(
    """
    import resource, sys
    sys.path.insert(0, sys.argv[2])
    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))  # /dev/zero read whole would pass this at once
    from pathlib import Path
    ws = Path(sys.argv[1]); run = ws / "runs" / "r"
    def step(name, fn):
        print("reading:", name, flush=True)
        fn()
    from core import rundir
    from core.runs.launcher import list_runs, run_state
    from core.monitor.summary import summarize_runs
    from core.monitor.watch import RunWatcher
    from core.monitor.diagnose import diagnose_run
    from core.merge.discover import list_adapters
    step("rundir.read_status", lambda: rundir.read_status(run))
    step("rundir.read_plan", lambda: rundir.read_plan(run))
    step("rundir.read_smoke", lambda: rundir.read_smoke(run))
    step("rundir.read_metrics", lambda: rundir.read_metrics(run))
    step("run_state", lambda: run_state(run))
    step("list_runs", lambda: list_runs(ws))
    step("summarize_runs", lambda: summarize_runs(ws / "runs"))
    step("RunWatcher.refresh", lambda: RunWatcher(run).refresh())
    step("diagnose_run", lambda: diagnose_run(run))
    step("list_adapters", lambda: list_adapters(ws))
    print("all read", flush=True)
    """
)

RUN_FILES = (
    "status.json",
    "plan.json",
    "smoke.json",
    "metrics.jsonl",
    "gpu.jsonl",
    "stderr.log",
    "stdout.log",
)


def _hostile(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
@pytest.mark.parametrize("which", ["run files", "config.yaml"])
def test_no_reader_of_a_run_hangs_on_a_fifo_or_dev_zero(tmp_path, kind, which):
    ws = tmp_path / "ws"
    model = tmp_path / "model"
    model.mkdir()
    run = make_dead_run(ws / "runs" / "r", model_path=str(model), stderr="boom\n")
    (run / "adapter").mkdir()
    if which == "run files":
        for name in RUN_FILES:
            _hostile(run / name, kind)
        _hostile(run / "adapter" / "adapter_config.json", kind)
        _hostile(model / "config.json", kind)  # the diagnosis reads the model's limits
    else:
        _hostile(run / "config.yaml", kind)
        (run / "adapter" / "adapter_config.json").write_text("{}")
    script = tmp_path / "read_all.py"
    script.write_text(READ_ALL)
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(ws), str(REPO)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=150,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"hung at {out.strip().splitlines()[-1:]}")
    last = proc.stdout.strip().splitlines()[-1:]
    assert proc.returncode == 0 and last == ["all read"], (last, proc.stderr[-3000:])
    for env_ws, args in (
        (ws, ("core.runs", "list")),
        (ws, ("core.runs", "show", "r")),
        (ws, ("core.diagnose", str(run))),
    ):
        try:
            cli = _cli(*args, env=dict(os.environ, LORA_COCKPIT_WORKSPACE=str(env_ws)), timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(args)} hung")
        assert "Traceback" not in cli.stderr, (args, cli.stderr[-2000:])


# ---- item 16: a kill from outside is not "out of CPU memory"; reasons are sentences ---------------------------


def test_a_kill_from_outside_is_told_from_the_oom_killer_by_the_runs_last_memory(tmp_path):
    from core.monitor.diagnose import diagnose_run
    from core.monitor.explain import memory_limit

    limit = memory_limit()
    small = make_dead_run(tmp_path / "small", stderr="step 7 done\n", rss=200 * 2**20)
    diag = diagnose_run(small)
    assert diag.rule == "killed" and diag.title == "Killed from outside (SIGKILL)", diag
    assert any("At its last sample (step 7) the run held 0.20 GiB" in d for d in diag.details), diag.details
    assert not any("available now" in d for d in diag.details)
    big = make_dead_run(tmp_path / "big", stderr="step 7 done\n", rss=int(0.9 * limit))
    assert diagnose_run(big).rule == "cpu_oom"
    unsampled = make_dead_run(tmp_path / "unsampled", stderr="loading the model\n")  # no rss: cannot tell
    assert diagnose_run(unsampled).rule == "cpu_oom"


def test_a_vanished_trainers_reason_is_a_sentence_and_never_ends_on_a_colon(tmp_path):
    from core.fmt import first_sentence
    from core.runs.launcher import run_state

    for stderr, tail in (("", None), ("\n\n  \n", None), ("loading\nstep 7 done\n", "step 7 done")):
        run = make_dead_run(tmp_path / f"r{len(stderr)}", stderr=stderr)
        reason = run_state(run).reason
        first = reason.splitlines()[0]
        assert first.startswith("The training process (pid ") and first.endswith("."), reason
        assert not reason.rstrip().endswith(":"), reason
        if tail is None:
            assert reason == first and "wrote nothing to stderr.log" in first
        else:
            assert reason.splitlines()[-2:] == ["Last lines of stderr.log:", tail] or reason.endswith(tail)
    assert first_sentence("loss became NaN at step 9\nmore") == "Loss became NaN at step 9"
    assert first_sentence(None) == "No reason recorded."


def test_the_monitor_says_the_run_failed_in_a_sentence_and_names_a_kill_from_outside(tmp_path):
    from streamlit.testing.v1 import AppTest

    ws = tmp_path / "ws"
    run = make_dead_run(ws / "runs" / "killed", stderr="step 7 done\n", rss=200 * 2**20)
    at = AppTest.from_file(str(REPO / "pages" / "monitor.py"), default_timeout=60)
    at.session_state["workspace"] = str(ws)
    at.session_state["monitor_run"] = str(run)
    at.run()
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    assert any(e.startswith("**The run failed.** The training process (pid ") for e in errors), errors
    assert any("Killed from outside (SIGKILL)" in m.value for m in at.markdown)
    assert not any("available now" in m.value for m in at.markdown)


# ---- item 8: a full disk is recorded and diagnosed as "disk full" ---------------------------------------------

WORDS = ["cat", "dog", "emu", "fox", "gnu", "hen", "ibis", "jay"]


def _train_config(tmp_path, model, lora=True, **training) -> Path:
    import yaml

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {w}", "output": w}) + "\n" for w in WORDS * 8))
    t = {"per_device_train_batch_size": 4, "max_steps": 5000, "logging_steps": 1, "save_steps": 1000}
    t.update(training, report_to="none", learning_rate=1e-3)
    cfg = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "max_length": 48},
        "lora": {"enabled": lora, "r": 4, "target_modules": ["q_proj", "v_proj"]},
        "training": t,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fill(folder: Path, leave: int = 0) -> None:
    """Fill the file system that holds `folder` until `leave` bytes are free (0: until a write fails)."""
    import shutil

    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                room = shutil.disk_usage(folder).free - leave
                if leave and room <= 0:
                    break
                fh.write(bytes(min(1 << 20, room) if leave else 1 << 16))
                fh.flush()
        except OSError:
            pass


def _trainer(config: Path, run_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "core.train", str(config), "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_the_disk_full_rule_names_a_full_disk():
    from core.monitor.diagnose import Evidence, diagnose

    reason = Evidence(
        status={"state": "failed", "reason": "disk full: no space left on the disk that holds /r."}
    )
    assert diagnose(reason).rule == "disk_full"
    vanished = Evidence(
        stderr="Traceback (most recent call last):\nOSError: [Errno 28] No space left on device\n",
        status={"state": "failed", "reason": "The training process (pid 1) ended without reporting."},
    )
    assert diagnose(vanished).rule == "disk_full"


@pytest.mark.slow
def test_a_checkpoint_that_cannot_fit_is_not_started_and_the_run_says_disk_full(tmpfs, tmp_path, tiny_llama):
    from core.monitor.diagnose import diagnose_run
    from core.rundir import read_status

    config = _train_config(
        tmp_path, tiny_llama, lora=False, save_steps=3
    )  # a full fine-tune: MiBs per checkpoint
    run_dir = tmpfs / "run"
    run_dir.mkdir()
    _fill(tmpfs, leave=1 << 20)
    proc = _trainer(config, run_dir)
    assert proc.wait(timeout=400) == 1
    status = read_status(run_dir)
    assert status["state"] == "failed" and status["reason"].startswith(
        "disk full: checkpoint-3 needs about"
    ), status
    assert "free" in status["reason"] and "resume" in status["reason"]
    assert not (run_dir / "checkpoints" / "checkpoint-3").exists()  # never half-written
    assert diagnose_run(run_dir).rule == "disk_full"


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_is_recorded_as_disk_full(tmpfs, tmp_path, tiny_llama):
    from core.monitor.diagnose import diagnose_run
    from core.rundir import read_metrics, read_status
    from core.runs.launcher import run_state

    config = _train_config(tmp_path, tiny_llama)
    run_dir = tmpfs / "run"
    proc = _trainer(config, run_dir)
    deadline = time.time() + 300
    while time.time() < deadline and not read_metrics(run_dir) and proc.poll() is None:
        time.sleep(0.2)
    assert read_metrics(run_dir), "the trainer never logged a step"
    _fill(tmpfs)  # the disk is full from here on: the next metrics line or status write fails
    assert proc.wait(timeout=300) == 1
    status = read_status(run_dir)
    assert status["state"] == "failed" and status["reason"].startswith(
        "disk full: no space left on the disk"
    ), status
    assert run_state(run_dir).state == "failed"
    assert diagnose_run(run_dir).rule == "disk_full"


# ---- item 11: a lying config.json is refused before anything is built from it ---------------------------------


def _limited(*args, timeout=240):
    """A CLI run with its data segment capped at 3 GiB: what used to grow to 7 GiB fails fast instead."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))

    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "lie, key",
    [
        ({"vocab_size": 10**9}, "vocab_size"),
        ({"hidden_size": 10**6, "num_hidden_layers": 10**4}, "hidden_size"),
    ],
)
def test_a_lying_config_json_is_one_sentence_before_anything_is_built(tmp_path, tiny_llama, lie, key):
    import shutil

    import yaml

    model = tmp_path / "liar"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(lie, architectures=["LlamaForCausalLM"])
    (model / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({"model": {"path": str(model)}, "data": {"path": str(data)}}))
    value = f"{lie[key]:,}"
    for args in (
        ("core.estimate", "--model", str(model)),
        ("core.train", str(run_yaml), "--dry-run"),
        ("core.train", str(run_yaml), "--run-dir", str(tmp_path / "run")),
        ("core.gguf", "--model", str(model), "--out", str(tmp_path / "x.gguf")),
    ):
        proc = _limited(*args)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-1500:])
        assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, (
            args,
            proc.stderr[-1500:],
        )
        assert f"{key} is {value}" in proc.stderr and "plausible" in proc.stderr, (args, proc.stderr[-800:])
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- item 13: bad input is exit 2 and one sentence, and creates nothing ---------------------------------------


@pytest.mark.parametrize(
    "content, says",
    [
        (b"\x01\x02", "shorter than its 8-byte header length"),
        ((10**12).to_bytes(8, "little") + b"{}", "header length"),
        ((11).to_bytes(8, "little") + b"\xff\xfe not json", "header is not JSON"),
        ((16).to_bytes(8, "little") + b'{"w": [1, 2, 3]}', "does not describe tensors"),
    ],
)
def test_gguf_on_a_bad_safetensors_header_is_one_sentence(tmp_path, tiny_llama, content, says):
    import shutil

    model = tmp_path / "bad"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors").write_bytes(content)
    out = tmp_path / "x.gguf"
    proc = _main("core.gguf", "--model", str(model), "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert says in proc.stderr and "model.safetensors" in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_run_dir_too_long_or_a_dangling_link_is_refused_and_nothing_is_created(tmp_path, tiny_llama):
    config = _train_config(tmp_path, tiny_llama)
    long_dir = tmp_path / ("r" * 300)
    proc = _main("core.train", str(config), "--run-dir", str(long_dir))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "300 bytes long" in proc.stderr and "at most 255" in proc.stderr, proc.stderr
    target = tmp_path / "nonexistent" / "target"
    link = tmp_path / "link"
    link.symlink_to(target)
    proc = _main("core.train", str(config), "--run-dir", str(link))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "symbolic link" in proc.stderr and "does not exist" in proc.stderr, proc.stderr
    assert not target.exists() and not target.parent.exists()  # it made /nonexistent/target before


# ---- issue #42 item 3: a read-only workspace is one sentence per command --------------------------------------


@pytest.fixture()
def read_only_workspace(tmp_path, tiny_llama):
    """A workspace holding a stopped run (a checkpoint to resume from) and an ended one, then made read-only: as
    root a tmpfs remounted read-only (root writes through permission bits), else folders without write permission.
    Yields (workspace, a run config file outside it)."""
    from core.runs.launcher import create_run

    root = os.geteuid() == 0
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if root and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("root, but no tmpfs can be mounted here, and permission bits do not stop root's writes")
    ws = mnt / "ws"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {w}", "output": w}) + "\n" for w in WORDS))
    cfg = {
        "model": {"path": str(tiny_llama)},
        "data": {"path": str(data)},
        "training": {"max_steps": 2, "max_length": 128},
    }
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(cfg))  # JSON is YAML
    now = time.time()
    for name in ("stopped", "ended"):
        run = create_run(ws, name, cfg)
        status = {
            "state": "stopped",
            "reason": None,
            "step": 1,
            "max_steps": 2,
            "started": now,
            "updated": now,
        }
        (run / "status.json").write_text(json.dumps(status))
        (run / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    folders = [ws, ws / "runs", ws / "runs" / "stopped", ws / "runs" / "ended"]
    if root:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    else:
        for folder in folders:
            folder.chmod(0o555)
    yield ws, config
    if root:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    else:
        for folder in folders:
            folder.chmod(0o755)


def test_launch_resume_and_delete_on_a_read_only_workspace_are_one_sentence_each(
    read_only_workspace, monkeypatch
):
    """Issue #42 item 3: each ended in an `OSError: [Errno 30]` traceback (reading worked)."""
    ws, config = read_only_workspace
    runs = ws / "runs"
    before = sorted(p.name for p in runs.iterdir())
    monkeypatch.setenv("LORA_COCKPIT_WORKSPACE", str(ws))
    for args, folder, fix in (
        (("launch", str(config), "--name", "new"), runs, "choose a workspace you can write to"),
        (("resume", "stopped"), runs / "stopped", "and resume again"),
        (("delete", "ended"), runs, "so nothing was deleted"),
    ):
        proc = _main("core.runs", *args)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: Cannot "), (args, proc.stderr)
        said = lines[0]
        assert f"{folder} is read-only" in said or f"{folder} is not writable by this user" in said, said
        assert "make it writable" in said and fix in said, said
    assert sorted(p.name for p in runs.iterdir()) == before


# ---- issue #42 item 4: an export and a full disk ----------------------------------------------------------------


def test_a_gguf_export_that_cannot_fit_is_refused_before_it_writes(tmpfs, tmp_path, tiny_llama):
    """Issue #42 item 4: there was no free-space check (the merge had one): the export started and failed."""
    _fill(tmpfs, leave=200 << 10)  # the tiny model's GGUF is ~250 KB
    proc = _cli("core.gguf", "--model", str(tiny_llama), "--out", str(tmpfs / "g.gguf"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: Not enough free disk at {tmpfs}: the export needs"
    )
    assert "is free" in lines[0], lines[0]
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]  # not even its progress record


def _fill_while_stopped(proc: subprocess.Popen, tmpfs: Path) -> None:
    """Fill the disk while `proc` is stopped (SIGSTOP), so it resumes on a full disk whatever the machine's load."""
    import signal

    proc.send_signal(signal.SIGSTOP)
    try:
        _fill(tmpfs)
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_a_gguf_export_on_a_disk_that_fills_midway_leaves_no_file_and_says_failed(tmpfs, tiny_llama):
    """Issue #42 item 4: the CLI said "Nothing was written" while the .gguf was there without its report, a rerun
    was refused because the file existed, progress.json still said "writing" beside a 0-byte temporary."""
    from core.gguf import read_progress

    out = tmpfs / "g2.gguf"
    env = dict(os.environ, LORA_COCKPIT_TEST_GGUF_PAUSE_AFTER_FIRST_TENSOR="5")
    cmd = [sys.executable, "-m", "core.gguf", "--model", str(tiny_llama), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (read_progress(out) or {}).get("tensors_done"):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    _fill_while_stopped(proc, tmpfs)
    _, stderr = proc.communicate(timeout=300)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert len(lines) == 1 and f"The disk holding {tmpfs} filled up" in lines[0], stderr
    assert "it needs 1.3 MB free there" in lines[0] and f"Nothing was written to {out}" in lines[0], lines[0]
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler", "g2.gguf.progress.json"]
    progress = read_progress(out)
    assert progress["phase"] == "failed" and "filled up" in progress["error"], progress
    (tmpfs / "filler").unlink()
    again = _cli("core.gguf", "--model", str(tiny_llama), "--out", str(out), "--verify", "quick")
    assert again.returncode == 0, again.stderr[-2000:]  # nothing of the failed export stands in its way
    assert read_progress(out)["phase"] == "done" and (tmpfs / "g2.gguf.verify.json").is_file()


@pytest.mark.slow
def test_a_merge_on_a_disk_that_fills_midway_names_the_file_and_the_space_it_needs(
    tmpfs, tmp_path, tiny_llama
):
    """Issue #42 item 4: it said only "a file: No space left on device"."""
    from core import merge
    from tests.test_merge_safety import make_adapter

    adapter = make_adapter(tiny_llama, tmp_path / "adapter")
    target = tmpfs / "merged"
    env = dict(os.environ, **{merge.PAUSE_ENV: "5"})
    cmd = [sys.executable, "-m", "core.merge", "--base", str(tiny_llama), "--adapter", str(adapter)]
    cmd += ["--out", str(target), "--shard-size", "100KB"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not list(tmpfs.glob(".merged.merging-*/.paused")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    _fill_while_stopped(proc, tmpfs)
    _, stderr = proc.communicate(timeout=300)
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert len(lines) == 1 and f"The disk holding {tmpfs} filled up while writing model-00002-of-" in lines[0]
    assert "the merge needs" in lines[0] and "free there" in lines[0] and "is free now" in lines[0], lines[0]
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]  # no target, no temporary folder
