"""core.train end to end on the CPU with tiny real models: metrics, adapter, QLoRA, 8-bit paged AdamW, NaN, smoke."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.rundir import read_metrics, read_status
from core.train.run import StopFlag, run_training

REPO = Path(__file__).resolve().parent.parent
WORDS = ["cat", "dog", "emu", "fox", "gnu", "hen", "ibis", "jay"]


def write_run(tmp_path, model_path, name="run.yaml", **sections) -> Path:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        rows = [{"instruction": f"Say {w}", "output": w} for w in WORDS * 8]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "model": {"path": str(model_path)},
        "data": {"path": str(data), "max_length": 48},
        "lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "training": {
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "max_steps": 30,
            "logging_steps": 5,
            "save_steps": 1000,
            "learning_rate": 1e-2,
            "lr_scheduler_type": "constant",
            "warmup_steps": 0,
        },
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_cli_run_learns_and_saves_a_loadable_adapter(tmp_path, tiny_llama):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "core.train", str(write_run(tmp_path, tiny_llama)), "--run-dir", str(run_dir)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # tiny model on 2 shared cores: one thread is fastest
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = read_status(run_dir)
    assert status["state"] == "finished" and status["step"] == 30 and status["device"] == "cpu"
    metrics = read_metrics(run_dir)
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert [m["step"] for m in metrics] == [5, 10, 15, 20, 25, 30]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(m["tokens_per_s"] > 0 and m["samples_per_s"] > 0 for m in metrics)
    assert (run_dir / "config.yaml").exists() and "gpu.jsonl: not written" in proc.stdout  # no NVML here

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model = PeftModel.from_pretrained(base, run_dir / "adapter")
    tok = AutoTokenizer.from_pretrained(run_dir / "adapter")
    assert sum("lora_" in n for n, _ in model.named_parameters()) > 0
    out = model(**tok("### Instruction:\nSay cat", return_tensors="pt"))
    assert out.logits.shape[-1] == base.config.vocab_size


@pytest.mark.slow
def test_qlora_nf4_with_paged_adamw_8bit_trains_on_cpu(tmp_path, tiny_llama):
    """QLoRA's usual pairing: a 4-bit NF4 base (bitsandbytes) and the paged 8-bit AdamW, both on the CPU."""
    cfg = write_run(
        tmp_path,
        tiny_llama,
        quantization={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        training={"optim": "paged_adamw_8bit", "max_steps": 10, "logging_steps": 2, "learning_rate": 5e-3},
    )
    summary = run_training(cfg, tmp_path / "run", stop=StopFlag())
    assert summary["state"] == "finished" and summary["step"] == 10
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 5 and all(loss == loss for loss in losses)  # five finite log lines

    from core.recipe.config import load_config
    from core.train.model import choose_precision, load_model

    c = load_config(cfg)
    names = {type(m).__name__ for m in load_model(c, choose_precision(c)).modules()}
    assert "Linear4bit" in names  # the base really was quantized by bitsandbytes
    from core.merge.discover import is_qlora

    assert is_qlora(tmp_path / "run" / "adapter")  # the Merge page tells it from the run's own config.yaml


def test_nan_loss_fails_the_run_with_the_step(tmp_path, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    broken = tmp_path / "nan_model"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    for f in Path(tiny_llama).glob("tokenizer*"):
        (broken / f.name).write_bytes(f.read_bytes())
    cfg = write_run(tmp_path, broken, training={"max_steps": 6, "logging_steps": 2, "save_steps": 2})
    from core.train.run import TrainError

    with pytest.raises(TrainError, match="loss became NaN at step 2"):
        run_training(cfg, tmp_path / "run", stop=StopFlag())
    assert not (tmp_path / "run" / "checkpoints" / "checkpoint-2").exists()  # no NaN checkpoint
    assert not (tmp_path / "run" / "adapter").exists()


def test_smoke_mode_measures_one_step_without_checkpoint(tmp_path, tiny_llama):
    run_dir = tmp_path / "smoke"
    run_dir.mkdir()
    (run_dir / "plan.json").write_text(json.dumps({"tensor_peak_bytes": 12345, "reserved_peak_bytes": 23456}))
    summary = run_training(write_run(tmp_path, tiny_llama), run_dir, smoke=True, stop=StopFlag())
    smoke = json.loads((run_dir / "smoke.json").read_text())
    assert summary["step"] == 1 and smoke["state"] == "finished"
    assert read_status(run_dir)["state"] == "finished" and read_metrics(run_dir) == []  # one step is no curve
    weights = (Path(tiny_llama) / "model.safetensors").stat().st_size
    assert smoke["peak_bytes"] > weights  # weights + LoRA + activations + grads live at the peak
    assert smoke["seconds_per_step"] > 0 and smoke["device"] == "cpu"
    # plan.json is the trainer's own (a stale one is replaced): the plan of this smoke step on this machine
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["plan"]["batch_size"] == 1 and plan["plan"]["device"] == "cpu"
    assert smoke["estimate_bytes"] == plan["tensor_peak_bytes"] != 12345
    assert smoke["measured_by"] in ("tracker", "rss")
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "adapter").exists()


def test_cli_bad_config_names_the_key_without_traceback(tmp_path, tiny_llama, capsys):
    import signal

    from core.train.cli import main

    cfg = write_run(tmp_path, tiny_llama, training={"learning_rate": 5})
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:  # main() installs its stop handlers; give pytest its own back afterwards
        code = main([str(cfg), "--run-dir", str(tmp_path / "run")])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert code == 2
    assert "training.learning_rate must be in (0, 1]" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # #21 item 7: checked before the folder is made: no ghost run left


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint folder with the files a Trainer checkpoint of a LoRA run has, written as the Trainer does."""
    import torch
    from safetensors.torch import save_file

    ckpt = run_dir / "checkpoints" / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    save_file({"a": torch.zeros(4, 8), "b": torch.ones(8, 4)}, str(ckpt / "adapter_model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.zeros(64)}}, "param_groups": []}, ckpt / "optimizer.pt")
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    torch.save({"python": 1}, ckpt / "rng_state.pth")
    return ckpt


def test_resume_helpers_keep_metrics_continuous(tmp_path):
    from core.checkpoints import latest_checkpoint
    from core.rundir import truncate_metrics

    lines = [{"time": 0.0, "step": s, "epoch": 0.0, "loss": 1.0} for s in range(2, 12, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 12, "lo')
    for step, complete in ((4, True), (6, True), (8, False)):  # checkpoint-8 was cut off while saving
        ckpt = fake_checkpoint(tmp_path, step)
        if not complete:
            (ckpt / "trainer_state.json").unlink()
    assert latest_checkpoint(tmp_path).name == "checkpoint-6"
    truncate_metrics(tmp_path, 6)
    assert [m["step"] for m in read_metrics(tmp_path)] == [2, 4, 6]


@pytest.mark.slow
def test_smoke_cli_prints_what_it_measured(tmp_path, tiny_llama):
    """core.train --smoke says in the terminal what the Train page shows: the peak, the estimate, s/step."""
    run_dir = tmp_path / "smoke-cli"
    run_dir.mkdir()
    (run_dir / "plan.json").write_text(json.dumps({"tensor_peak_bytes": 4 * 2**20}))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "core.train",
            str(write_run(tmp_path, tiny_llama)),
            "--run-dir",
            str(run_dir),
            "--smoke",
        ],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    smoke = json.loads((run_dir / "smoke.json").read_text())
    assert line.startswith(f"smoke test: measured peak {smoke['peak_bytes'] / 2**20:,.1f} MiB (")
    plan = json.loads(
        (run_dir / "plan.json").read_text()
    )  # the trainer's own plan of this step (the stale one replaced)
    assert (
        f"vs the estimate {plan['tensor_peak_bytes'] / 2**20:,.1f} MiB" in line
        and "s per step on cpu" in line
    )
