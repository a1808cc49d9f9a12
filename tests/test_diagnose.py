"""Diagnosis rules on real stderr texts, real training curves and real run directories.

How each tests/data/stderr file was captured (python 3.11, torch 2.13 CPU, transformers 5.24, one subprocess
each, stderr saved verbatim):
- cpu_label_out_of_vocab.txt: tiny Llama (core.demo.toy, vocab 102) forward+backward with one label set to 150.
- cpu_embedding_index_out_of_range.txt: the same model with one input id set to 109.
- cpu_alloc_rlimit.txt: resource.setrlimit(RLIMIT_AS, 3 GiB), then torch.empty(8 GiB of uint8).
- missing_module.txt: `import flash_attn_cockpit_absent` after importing torch.
- model_folder_not_found.txt: AutoModelForCausalLM.from_pretrained on a folder that does not exist (offline).
- data_file_not_found.txt: datasets.load_dataset("json", data_files=<missing path>).
- dataloader_worker_killed.txt: a DataLoader (num_workers=1) whose worker SIGKILLs itself in __getitem__.
- healthy_lora_trainer_run.txt: a successful 4-step LoRA Trainer run on the tiny Llama (warnings, progress bars).
- transcribed_cuda_*.txt: NOT captured here (no GPU on this machine): transcribed in the exact format PyTorch
  prints, as seen in public GitHub issue reports (CUDA OOM allocator message; device-side assert with the
  Loss.cu `t >= 0 && t < n_classes` assertion), with figures of our own.
"""

import json
import time
from pathlib import Path

import pytest
import torch

from core.monitor.diagnose import RULES, Evidence, diagnose, diagnose_run, troubleshooting_markdown
from core.monitor.tail import RunSeries

DATA = Path(__file__).parent / "data" / "stderr"
GiB = 1024**3


def stderr(name: str) -> str:
    return (DATA / f"{name}.txt").read_text()


def failed(reason="exited with code 1"):
    return {"state": "failed", "reason": reason, "step": 3, "max_steps": 100, "started": 1.0, "ended": 2.0}


@pytest.mark.parametrize(
    "name, rule",
    [
        ("cpu_label_out_of_vocab", "index_out_of_range"),
        ("cpu_embedding_index_out_of_range", "index_out_of_range"),
        ("transcribed_cuda_device_assert", "index_out_of_range"),
        ("transcribed_cuda_oom_fragmentation", "cuda_oom"),
        ("transcribed_cuda_oom_other_process", "cuda_oom"),
        ("cpu_alloc_rlimit", "cpu_oom"),
        ("dataloader_worker_killed", "dataloader_worker_died"),
        ("missing_module", "missing_module"),
        ("model_folder_not_found", "file_not_found"),
        ("data_file_not_found", "file_not_found"),
    ],
)
def test_each_captured_stderr_gets_its_rule(name, rule):
    d = diagnose(Evidence(stderr=stderr(name), status=failed()))
    assert d.rule == rule
    assert d.evidence, "the matching stderr line is shown"
    assert all(line in stderr(name) for line in d.evidence)
    assert d.fixes and d.cause


def test_label_out_of_vocab_names_the_label_and_vocab(tiny_llama):
    config = {"model": {"path": str(tiny_llama)}}
    d = diagnose(Evidence(stderr=stderr("cpu_label_out_of_vocab"), status=failed(), config=config))
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    assert any("label 150" in x and f"vocab_size {vocab}" in x for x in d.details)
    assert any("preflight" in f for f in d.fixes)


def test_embedding_out_of_range_mentions_positions_and_vocab(tiny_llama):
    config = {"model": {"path": str(tiny_llama)}}
    d = diagnose(Evidence(stderr=stderr("cpu_embedding_index_out_of_range"), status=failed(), config=config))
    assert any("max_position_embeddings 256" in x for x in d.details)
    assert any("training.max_length" in f for f in d.fixes)


def test_cuda_oom_fragmentation_recommends_expandable_segments():
    d = diagnose(Evidence(stderr=stderr("transcribed_cuda_oom_fragmentation"), status=failed()))
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in d.fixes[0]
    assert any("5.71 GiB was reserved by PyTorch but unallocated" in x for x in d.details)
    assert not any("Other processes" in x for x in d.details)


def test_cuda_oom_other_process_from_stderr_and_not_fragmentation():
    d = diagnose(Evidence(stderr=stderr("transcribed_cuda_oom_other_process"), status=failed()))
    assert "48811" in d.fixes[0]
    assert any("Other processes held 9.20 GiB" in x for x in d.details)
    assert not any("expandable_segments" in f for f in d.fixes[:2])  # 402 MiB unallocated is not the story


def test_cuda_oom_other_processes_from_nvml_samples_and_plan_fake_gpu_samples():
    """GPU samples as GpuSampler writes them, driver faked: NVML saw a 6 GiB process outside the run's tree."""
    gpu = [
        {
            "time": 100.0 + i,
            "index": 0,
            "memory_used": int(23 * GiB),
            "memory_total": 24 * GiB,
            "utilization": 90,
            "temperature": 60,
            "power_w": 200.0,
            "process_memory": int(17 * GiB),
            "other_processes": [{"pid": 777, "memory": 6 * GiB}],
        }
        for i in range(5)
    ]
    text = stderr("transcribed_cuda_oom_fragmentation")
    plan = {"device_total_bytes": int(26 * GiB), "gpu_bytes": 24 * GiB}
    d = diagnose(Evidence(stderr=text, status=failed(), series=RunSeries.from_records([], gpu), plan=plan))
    assert any("Other processes held 6.00 GiB" in x and "777" in x for x in d.details)
    assert any("does not fit" in x for x in d.details)
    assert any("Estimate page" in f for f in d.fixes)


def test_cpu_alloc_failure_figures():
    d = diagnose(Evidence(stderr=stderr("cpu_alloc_rlimit"), status=failed()))
    assert any("8.00 GiB failed" in x for x in d.details)


def test_sigkill_without_traceback_is_the_oom_killer():
    ev = Evidence(stderr=stderr("healthy_lora_trainer_run"), status=failed("killed by signal SIGKILL (9)"))
    assert diagnose(ev).rule == "cpu_oom"
    # How core.runs reports a trainer that vanished without writing its own status.
    silent = failed("the training process (pid 4242) ended without reporting and wrote nothing to stderr.log")
    assert diagnose(Evidence(stderr="", status=silent)).rule == "cpu_oom"
    # The same words after a real Python traceback are not the OOM killer.
    assert diagnose(Evidence(stderr=stderr("missing_module"), status=silent)).rule == "missing_module"
    # A user's Stop is not a failure.
    stopped = dict(failed("killed by signal SIGKILL (9)"), state="stopped")
    assert diagnose(Evidence(stderr="", status=stopped)).rule == "unknown"


def test_nan_loss_from_real_divergent_training(tiny_llama):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    opt = torch.optim.SGD(model.parameters(), lr=1e5)
    ids = torch.randint(7, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    records = []
    for step in range(1, 7):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        records.append({"time": time.time(), "step": step, "loss": loss.item(), "learning_rate": 1e5})
    assert any(r["loss"] != r["loss"] for r in records)
    config = {"training": {"learning_rate": 1e5, "fp16": True}}
    d = diagnose(Evidence(stderr="", status=failed(), series=RunSeries.from_records(records), config=config))
    assert d.rule == "nan_loss"
    assert any("Loss became nan" in x for x in d.details)
    assert any("bf16" in f for f in d.fixes) and any("learning_rate to 10000" in f for f in d.fixes)
    # The trainer's own failure reason alone is enough when metrics are not at hand.
    by_reason = diagnose(Evidence(status=failed("loss became NaN at step 4")))
    assert by_reason.rule == "nan_loss"


def test_dataloader_hang_from_idle_gpu_fake_gpu_samples():
    metrics = [{"time": 1000.0 + s, "step": s, "loss": 2.0} for s in range(1, 4)]
    gpu = [
        {"time": 1003.0 + i, "index": 0, "utilization": 0, "memory_used": GiB, "memory_total": 24 * GiB}
        for i in range(200)
    ]
    series = RunSeries.from_records(metrics, gpu)
    status = dict(failed("stopped after no progress"), state="stopped")
    d = diagnose(
        Evidence(stderr="", status=status, series=series, config={"training": {"dataloader_num_workers": 8}})
    )
    assert d.rule == "dataloader_hang"
    assert any("No progress for 199 s" in x and "0.0%" in x for x in d.details)
    assert any("dataloader_num_workers is 8" in x for x in d.details)
    busy = [dict(g, utilization=95) for g in gpu]
    assert diagnose(Evidence(status=status, series=RunSeries.from_records(metrics, busy))).rule == "unknown"


def test_healthy_run_matches_no_rule():
    """A real successful LoRA run's stderr (with its 'No module named kernels' notice) triggers nothing."""
    healthy = [{"time": 1000.0 + s, "step": s, "loss": 3.0 - s / 100} for s in range(1, 50)]
    ev = Evidence(
        stderr=stderr("healthy_lora_trainer_run"),
        status={"state": "finished", "reason": None, "step": 49, "max_steps": 49},
        series=RunSeries.from_records(healthy),
    )
    matched = [r.name for r in RULES if r.name != "unknown" and r.match(ev) is not None]
    assert matched == []


def test_unknown_shows_the_last_error_line():
    text = "Traceback (most recent call last):\n  File x\nValueError: something odd happened\n"
    d = diagnose(Evidence(stderr=text, status=failed()))
    assert d.rule == "unknown" and "ValueError: something odd happened" in d.details[0]


def test_diagnose_run_reads_a_run_directory(tmp_path):
    (tmp_path / "stderr.log").write_text(stderr("cpu_alloc_rlimit"))
    (tmp_path / "status.json").write_text(json.dumps(failed()))
    (tmp_path / "metrics.jsonl").write_text('{"time": 1, "step": 1, "loss": 2.0}\n')
    (tmp_path / "config.yaml").write_text("training:\n  learning_rate: 0.0002\n")
    d = diagnose_run(tmp_path)
    assert d.rule == "cpu_oom"
    assert "**What to change**" in d.markdown()


def test_troubleshooting_markdown_lists_every_rule():
    md = troubleshooting_markdown()
    for rule in RULES:
        assert f"### {rule.title}" in md
        assert rule.cause in md
        assert all(f in md for f in rule.fix)
    assert "expandable_segments:True" in md


def test_nan_advice_fits_the_run_state_and_device():
    """Issue #16: the NaN diagnosis gave two overlapping learning-rate fixes and fp16 advice on a CPU run, and
    the health box said 'Stop the run' after it had ended."""
    from core.monitor.health import HealthChecker

    series = RunSeries.from_records(
        [
            {"time": 1.0, "step": 1, "loss": 2.0, "learning_rate": 3e-3},
            {"time": 2.0, "step": 2, "loss": float("nan")},
        ]
    )
    cpu_status = {**failed("loss became NaN at step 2"), "device": "cpu"}
    d = diagnose(Evidence(status=cpu_status, series=series, config={"training": {"learning_rate": 3e-3}}))
    assert d.rule == "nan_loss"
    assert sum("training.learning_rate" in f for f in d.fixes) == 1  # one learning-rate fix, with its figure
    assert not any("fp16" in f or "bf16" in f for f in d.fixes)  # nothing about GPU precision on a CPU
    gpu = diagnose(Evidence(status={**cpu_status, "device": "cuda:0"}, series=series))
    assert any("bf16" in f for f in gpu.fixes)  # on a GPU the precision advice stays
    ended = [w for w in HealthChecker().check(series, None, cpu_status) if w.code == "nonfinite_loss"][0]
    live = [
        w for w in HealthChecker().check(series, None, {"state": "running"}) if w.code == "nonfinite_loss"
    ][0]
    assert ended.fix.startswith("Restart from") and "fp16" not in ended.fix
    assert live.fix.startswith("Stop the run and restart")
