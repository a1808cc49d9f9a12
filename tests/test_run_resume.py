"""Issue #21 items 3, 5, 7 and 9 with real trainers and real files: a resume with a changed config (refused in one
sentence when the checkpoint cannot take it, recorded when it can), a run folder deleted under its trainer, a
config error that must leave no folder, a damaged newest checkpoint. Nothing is timed; timeouts are generous."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_runs import run_config, wait_until
from test_train import fake_checkpoint

from core import checkpoints, rundir
from core.recipe.config import dump_config, validate_config
from core.runs.launcher import RunError, create_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread_per_trainer(monkeypatch, workspace):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    import psutil  # a failed test leaves no trainer behind

    for proc in psutil.process_iter(["cmdline"]):
        if any(str(workspace) in part for part in proc.info["cmdline"] or ()):
            proc.kill()


def _cli(module, workspace, *args, timeout=600):
    env = dict(os.environ, LORA_COCKPIT_WORKSPACE=str(workspace))
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _config(workspace, model, name, lora=None, **training) -> Path:
    cfg = run_config(workspace, model, **{"logging_steps": 1, **training})
    cfg["lora"].update(lora or {})
    return dump_config(validate_config(cfg), workspace / f"{name}.yaml")


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


# ---- item 7: a config error leaves no folder; what an older trainer left is deletable -------------------------


def test_a_config_error_creates_nothing(workspace, tiny_llama):
    run_dir = workspace / "runs" / "typo"
    bad = workspace / "bad.yaml"
    bad.write_text(yaml.safe_dump({**run_config(workspace, tiny_llama), "training": {"learning_rat": 1e-3}}))
    out = _cli("core.train", workspace, bad, "--run-dir", run_dir)
    assert out.returncode == 2 and "training.learning_rat" in _one_error_line(out)
    assert not run_dir.exists()  # no lock, pid, status: the name stays free

    gone_model = run_config(workspace, workspace / "no-such-model")
    (workspace / "nomodel.yaml").write_text(yaml.safe_dump(gone_model))
    out = _cli("core.train", workspace, workspace / "nomodel.yaml", "--run-dir", run_dir)
    assert out.returncode == 2 and "model.path" in _one_error_line(out) and not run_dir.exists()
    out = _cli("core.runs", workspace, "launch", workspace / "nomodel.yaml", "--name", "typo")
    assert out.returncode == 2 and "model.path" in out.stderr and not run_dir.exists()
    with pytest.raises(RunError, match="model.path"):
        create_run(workspace, "typo", gone_model)
    assert not run_dir.exists()


def test_a_failed_starts_leftovers_are_deletable_and_do_not_block_the_name(workspace):
    """What a trainer that checked its config only after taking the folder left: lock, pid, status failed."""
    ghost = workspace / "runs" / "ghost"
    ghost.mkdir(parents=True)
    (ghost / "lock").write_text("")
    (ghost / "pid").write_text(json.dumps({"pid": 999999, "start_time": 1.0, "session_leader": False}))
    rundir.write_status(ghost, state="failed", reason="training.learning_rat: unknown key")
    rundir.check_run_dir(ghost, resume=False)  # not "already holds a run": a new run may start there
    out = _cli("core.runs", workspace, "delete", "ghost")
    assert out.returncode == 0 and out.stdout.strip() == "deleted ghost", out.stderr
    assert not ghost.exists()


# ---- item 9: a damaged checkpoint is named and skipped -------------------------------------------------------


def test_damaged_checkpoints_are_named_and_skipped(tmp_path):
    for step in (2, 4, 6, 8, 10):
        fake_checkpoint(tmp_path, step)
    ckpts = tmp_path / "checkpoints"
    weights = ckpts / "checkpoint-10" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-20])  # cut off
    opt = ckpts / "checkpoint-8" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    (ckpts / "checkpoint-6" / "trainer_state.json").write_text('{"global_step": 6, "log_hist')
    (ckpts / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 40}')
    assert "truncated" in checkpoints.checkpoint_problem(ckpts / "checkpoint-10")
    assert checkpoints.checkpoint_problem(ckpts / "checkpoint-8").startswith(
        "optimizer.pt is damaged or truncated"
    )
    assert "trainer_state.json" in checkpoints.checkpoint_problem(ckpts / "checkpoint-6")
    assert "step 40" in checkpoints.checkpoint_problem(ckpts / "checkpoint-4")
    before = _digest(tmp_path)
    assert checkpoints.latest_checkpoint(tmp_path) == ckpts / "checkpoint-2"
    assert _digest(tmp_path) == before  # reading writes nothing


@pytest.mark.slow
def test_resume_skips_a_damaged_newest_checkpoint(workspace, tiny_llama):
    run_dir = workspace / "runs" / "damaged"
    out = _cli(
        "core.train",
        workspace,
        _config(workspace, tiny_llama, "a", max_steps=6, save_steps=3),
        "--run-dir",
        run_dir,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    newest = run_dir / "checkpoints" / "checkpoint-6" / "optimizer.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a save cut off by a full disk

    cfg = _config(workspace, tiny_llama, "b", max_steps=8, save_steps=3)
    out = _cli("core.train", workspace, cfg, "--run-dir", run_dir, "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint-6 cannot be resumed from (optimizer.pt is damaged or truncated" in out.stdout
    assert "resume: from checkpoint-3" in out.stdout
    assert (run_dir / "checkpoints" / "unusable-checkpoint-6" / "optimizer.pt").is_file()  # kept, set aside
    status = rundir.read_status(run_dir)
    assert (status["state"], status["step"]) == ("finished", 8)
    steps = [m["step"] for m in rundir.read_metrics(run_dir) if "loss" in m]
    assert steps == list(range(1, 9))  # steps 4-6 of the first run were dropped, then trained again


# ---- item 3: a resume with a changed config ------------------------------------------------------------------


@pytest.mark.slow
def test_resume_refuses_what_the_checkpoint_cannot_take_and_records_what_it_can(
    workspace, tiny_llama, tiny_llama_tied
):
    run_dir = workspace / "runs" / "changed"
    first = _config(workspace, tiny_llama, "first", max_steps=4, save_steps=2, lr_scheduler_type="constant")
    out = _cli("core.train", workspace, first, "--run-dir", run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert yaml.safe_load(
        (run_dir / "checkpoints" / "checkpoint-4" / "run_config.yaml").read_text()
    ) == yaml.safe_load(first.read_text())
    before = _digest(run_dir)

    for name, changed, key in (
        ("r", _config(workspace, tiny_llama, "r", lora={"r": 8}, max_steps=8), "lora.r"),
        (
            "modules",
            _config(workspace, tiny_llama, "m", lora={"target_modules": ["q_proj"]}, max_steps=8),
            "lora.target_modules",
        ),
        ("model", _config(workspace, tiny_llama_tied, "model", max_steps=8), "model.path"),
        ("optim", _config(workspace, tiny_llama, "o", max_steps=8, optim="sgd"), "training.optim"),
    ):
        out = _cli("core.train", workspace, changed, "--run-dir", run_dir, "--resume")
        line = _one_error_line(out)
        assert out.returncode == 2 and f"--resume: {key} changed from" in line and "checkpoint-4" in line, (
            name,
            line,
        )
        assert _digest(run_dir) == before  # touched nothing

    # the same refusal from core.runs resume, after config.yaml was edited in place
    shutil.move(run_dir, workspace / "runs" / "edited")
    edited = workspace / "runs" / "edited"
    cfg = yaml.safe_load((edited / "config.yaml").read_text())
    cfg["lora"]["r"] = 16
    (edited / "config.yaml").write_text(yaml.safe_dump(cfg))
    rundir.write_status(edited, state="stopped", reason="test")
    out = _cli("core.runs", workspace, "resume", "edited")
    assert out.returncode == 2 and "lora.r changed from 4 to 16" in out.stderr, out.stderr
    cfg["lora"]["r"] = 4
    (edited / "config.yaml").write_text(yaml.safe_dump(cfg))

    # what it can take: trains with it (the new learning rate really is used) and says so in the folder
    later = _config(
        workspace,
        tiny_llama,
        "later",
        max_steps=8,
        save_steps=2,
        lr_scheduler_type="constant",
        learning_rate=1e-4,
    )
    out = _cli("core.train", workspace, later, "--run-dir", edited, "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    said = next(
        ln for ln in out.stdout.splitlines() if ln.startswith("resume: from checkpoint-4 with changed")
    )
    assert "training.max_steps" in said and "training.learning_rate" in said and "lora" not in said, said
    now = yaml.safe_load((edited / "config.yaml").read_text())
    assert (now["training"]["learning_rate"], now["training"]["max_steps"]) == (1e-4, 8)
    history = edited / "config.history" / "until-step-4.yaml"
    text = history.read_text()
    old = yaml.safe_load(text)
    assert (old["training"]["learning_rate"], old["training"]["max_steps"]) == (5e-3, 4)
    assert "training.learning_rate: 0.005 -> 0.0001" in text
    lrs = {m["step"]: m["learning_rate"] for m in rundir.read_metrics(edited) if "learning_rate" in m}
    assert set(lrs) == set(range(1, 9))
    assert all(lrs[s] == pytest.approx(5e-3) for s in range(1, 5))
    assert all(lrs[s] == pytest.approx(1e-4) for s in range(5, 9)), lrs
    assert rundir.read_status(edited)["state"] == "finished"


# ---- item 5: the run folder deleted under a live trainer -----------------------------------------------------


@pytest.mark.slow
def test_a_trainer_whose_folder_is_deleted_stops_and_recreates_nothing(workspace, tiny_llama):
    cfg = _config(workspace, tiny_llama, "rm", max_steps=5000, save_steps=2)
    run_dir = workspace / "runs" / "rm"
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.train", str(cfg), "--run-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert wait_until(lambda: checkpoints.latest_checkpoint(run_dir) is not None, 300)
        for _ in range(50):  # as `rm -rf` again: a file the trainer writes while rmtree runs fails the rmdir
            try:
                shutil.rmtree(run_dir)
                break
            except OSError:
                time.sleep(0.1)
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    # rmtree is not atomic: a checkpoint being written as it runs can leave the path briefly re-made, and the
    # trainer then reads a folder that is not its own ("replaced"): either way one sentence, the run stopped
    said = ("was deleted while the run trained", "was replaced by another folder while the run trained")
    assert len(lines) == 1 and any(s in lines[0] for s in said) and "Traceback" not in err, err[-3000:]
    time.sleep(1)
    assert not run_dir.exists(), sorted(map(str, run_dir.rglob("*")))  # no status.json, no checkpoint re-made
