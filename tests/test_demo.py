"""Demo assets: deterministic build, and a real launched demo run that learns the held-out task."""

import hashlib

import pytest

from core.demo.build import build_demo, demo_config, heldout_accuracy, read_manifest, task_rows
from core.rundir import read_metrics
from core.runs.launcher import create_run, launch, wait_for


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_task_rows_hold_out_unseen_words():
    train, heldout = task_rows()
    train_words = {r["messages"][0]["content"] for r in train}
    assert len(heldout) == 100 and not train_words & {r["question"] for r in heldout}
    assert all(r["answer"] == r["question"].split(": ")[1].upper() for r in heldout)


def test_fast_pretraining_encoding_matches_the_chat_format():
    from core.demo.build import encode_chat_pairs
    from core.demo.toy import build_tokenizer
    from core.recipe.data import tokenize_row

    tok = build_tokenizer()
    row = task_rows()[0][0]
    fast = encode_chat_pairs(tok, [(row["messages"][0]["content"], row["messages"][1]["content"])])[0]
    slow = tokenize_row(row, "chat", tok, 64)
    assert (fast["input_ids"], fast["labels"]) == (slow["input_ids"], slow["labels"])


def test_build_is_deterministic_and_never_clobbers_other_folders(tmp_path):
    a = build_demo(tmp_path / "a", pretrain_steps=3, log=lambda _m: None)
    b = build_demo(tmp_path / "b", pretrain_steps=3, log=lambda _m: None)
    for name in ("base/model.safetensors", "train.jsonl", "heldout.jsonl"):
        assert digest(a / name) == digest(b / name), name
    assert read_manifest(a)["pretrain_steps"] == 3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user data")
    with pytest.raises(Exception, match="not a demo folder"):
        build_demo(tmp_path / "mine", pretrain_steps=3, log=lambda _m: None)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "user data"


@pytest.mark.slow
def test_demo_cli_builds_the_base_and_its_run_learns_the_heldout_task(demo_trained):
    """`python -m core.demo --out DIR --run` (the session's shared demo, conftest.py): the pretrained base has its
    skills, the demo's own SFT run finished, and the CLI's held-out figures say it learned what the base could
    not do, the same figures heldout_accuracy gives on its adapter."""
    import re

    demo = demo_trained.folder
    skills = read_manifest(demo)["base_skills"]
    assert skills["repeat"] > 0.9 and skills["shout"] > 0.9  # the pretrained base really has its skills
    before = int(re.search(r"held-out accuracy before training: (\d+)%", demo_trained.stdout).group(1))
    after = int(re.search(r"held-out accuracy after training: (\d+)%", demo_trained.stdout).group(1))
    assert before < 10 and after > 80, demo_trained.stdout
    assert round(100 * heldout_accuracy(demo, demo_trained.adapter)) == after
    assert (demo / "run.yaml").is_file() and (demo_trained.run_dir / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_demo_run_learns_the_heldout_task(workspace, monkeypatch, demo_built):
    monkeypatch.setenv(
        "OMP_NUM_THREADS", "1"
    )  # the launched trainer: tiny model, 1 thread is fastest on 2 shared cores
    demo = demo_built.copy(
        workspace / "demo"
    )  # the session's 200-step demo build (conftest.py), our own copy
    cfg = demo_config(workspace)
    assert cfg["model"]["path"] == str((workspace / "demo" / "base").resolve())
    cfg["training"].update(max_steps=40, eval_steps=20, save_steps=20)
    run_dir = create_run(workspace, "demo-test", cfg)
    launch(run_dir)
    info = wait_for(run_dir, timeout=400)
    assert info.state == "finished", (info.reason, (run_dir / "stderr.log").read_text()[-2000:])
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    assert len(losses) == 9 and losses[-1] < losses[0] / 10, (
        losses
    )  # step 1 (logging_first_step), 5, 10, ... 40
    assert any("eval_loss" in m for m in read_metrics(run_dir))
    before = heldout_accuracy(demo)
    after = heldout_accuracy(demo, run_dir / "adapter")  # PeftModel.from_pretrained on the saved adapter
    assert before < 0.1 and after > 0.8, (before, after)
