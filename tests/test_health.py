"""Health rules on real training curves of a tiny Llama (CPU) and on GPU samples from a fake NVML source.

Loss curves come from real optimisation steps (a healthy lr, lr ~ 0, a divergent lr, one broken batch).
GPU figures cannot be produced without a GPU: those tests feed core.gpu.take_samples a fake driver source
(the only mock, named in each test) and write the samples exactly as GpuSampler does.
"""

import time
from dataclasses import asdict

import pytest
import torch

from core.monitor.gpu import GpuInfo, take_samples
from core.monitor.health import HealthChecker, HealthSettings, check_health
from core.monitor.tail import RunSeries

GiB = 1024**3
FAST = HealthSettings(flat_steps=12)  # the 200-step rule, scaled to a 15-step CPU run


def train_tiny(
    model_dir, lr: float, steps: int, optimizer: str = "adamw", broken_batch_at: int | None = None
):
    """Real training steps on one repeated batch; returns metrics.jsonl records in the run-dir format."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(7, 100, (1, 12), generator=gen)
    records = []
    for step in range(1, steps + 1):
        ids = torch.randint(7, 100, (1, 12), generator=gen) if step == broken_batch_at else batch
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        opt.zero_grad()
        records.append(
            {
                "time": time.time(),
                "step": step,
                "epoch": step / steps,
                "loss": loss.item(),
                "grad_norm": grad_norm.item(),
                "learning_rate": lr,
            }
        )
    return records


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from core.demo.toy import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("small_llama"),
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
    )


@pytest.fixture(scope="module")
def healthy_records(small_llama):
    return train_tiny(small_llama, lr=1e-2, steps=15)


class FakeNvml:
    """Stands in for the GPU driver: returns the readings the test sets."""

    def __init__(self, total=24 * GiB):
        self.total = total
        self.reading = {}

    def init(self):
        return None

    def devices(self):
        return [GpuInfo(0, "Fake RTX 4090", self.total)]

    def read(self, index):
        return dict(self.reading)


def fake_gpu_records(t_start, seconds, used, util, process_memory=None, others=()):
    """1 Hz samples through core.gpu.take_samples with a fake driver, timestamps set to the run's clock."""
    src = FakeNvml()
    out = []
    for i in range(seconds):
        procs = list(others) + ([{"pid": 4242, "memory": process_memory}] if process_memory else [])
        src.reading = {
            "memory_used": used,
            "memory_total": src.total,
            "utilization": util,
            "temperature": 66,
            "power_w": 300.0,
            "processes": procs,
        }
        (sample,) = take_samples(src, src.devices(), watch_pid=4242 if process_memory else None)
        sample.time = t_start + i
        out.append(asdict(sample))
    return out


def codes(warnings):
    return {w.code for w in warnings}


def test_healthy_run_is_quiet_fake_gpu_samples(healthy_records):
    t0 = healthy_records[0]["time"]
    gpu = fake_gpu_records(t0 - 10, 200, used=int(17 * GiB), util=97, process_memory=int(16.5 * GiB))
    series = RunSeries.from_records(healthy_records, gpu)
    plan = {"device_total_bytes": int(16.0 * GiB), "gpu_bytes": 24 * GiB}
    assert healthy_records[-1]["loss"] < 0.5 * healthy_records[0]["loss"]  # it really learned
    assert HealthChecker(FAST).check(series, plan, {"state": "running"}) == []


def test_nan_loss_from_divergent_lr_is_an_error(small_llama):
    records = train_tiny(small_llama, lr=1e3, steps=6, optimizer="sgd")
    assert any(r["loss"] != r["loss"] for r in records)  # the real run did diverge
    warnings = check_health(RunSeries.from_records(records))
    assert warnings[0].code == "nonfinite_loss" and warnings[0].level == "error"
    first_bad = next(r["step"] for r in records if r["loss"] != r["loss"] or abs(r["loss"]) == float("inf"))
    assert f"at step {first_bad}" in warnings[0].detail
    assert "bf16" in warnings[0].fix and "learning_rate" in warnings[0].fix


def test_flat_loss_over_first_steps_warns(small_llama, healthy_records):
    flat = train_tiny(small_llama, lr=1e-9, steps=15)
    w = HealthChecker(FAST).check(RunSeries.from_records(flat))
    assert codes(w) == {"loss_flat"}
    assert "learning_rate" in w[0].fix
    assert "loss_flat" not in codes(HealthChecker(FAST).check(RunSeries.from_records(healthy_records)))
    # Before step 12 nothing can be said yet.
    assert HealthChecker(FAST).check(RunSeries.from_records(flat[:10])) == []


def test_broken_batch_makes_a_loss_spike(small_llama, healthy_records):
    records = train_tiny(small_llama, lr=1e-2, steps=16, broken_batch_at=14)
    checker = HealthChecker(FAST)
    series = RunSeries.from_records(records[:13])
    assert "loss_spike" not in codes(checker.check(series))
    series.add_metrics(records[13:])  # incremental: only the new points are examined
    spikes = [w for w in checker.check(series) if w.code == "loss_spike"]
    assert len(spikes) == 1 and "step 14" in spikes[0].detail


def test_starved_gpu_warns_about_data_loading_fake_gpu_samples(healthy_records):
    t0 = healthy_records[0]["time"]
    series = RunSeries.from_records(healthy_records, fake_gpu_records(t0, 180, used=int(12 * GiB), util=35))
    w = [x for x in check_health(series, status={"state": "running"}) if x.code == "low_utilization"]
    assert len(w) == 1
    assert "35%" in w[0].detail and "dataloader_num_workers" in w[0].fix
    # Same samples but the run has finished: an idle GPU is expected then.
    assert "low_utilization" not in codes(check_health(series, status={"state": "finished"}))
    # Too short a window is not "sustained".
    short = RunSeries.from_records(healthy_records, fake_gpu_records(t0, 60, used=int(12 * GiB), util=35))
    assert "low_utilization" not in codes(check_health(short, status={"state": "running"}))


def test_memory_over_90_percent_warns_fake_gpu_samples(healthy_records):
    t0 = healthy_records[0]["time"]
    series = RunSeries.from_records(healthy_records, fake_gpu_records(t0, 30, used=int(23 * GiB), util=99))
    w = [x for x in check_health(series) if x.code == "memory_high"]
    assert len(w) == 1 and "96%" in w[0].title and "24.0 GiB" in w[0].detail
    ok = RunSeries.from_records(healthy_records, fake_gpu_records(t0, 30, used=int(21 * GiB), util=99))
    assert "memory_high" not in codes(check_health(ok))


def test_measured_peak_against_plan_fake_gpu_samples(healthy_records):
    t0 = healthy_records[0]["time"]
    gpu = fake_gpu_records(t0, 30, used=int(20 * GiB), util=99, process_memory=int(19.5 * GiB))
    series = RunSeries.from_records(healthy_records, gpu)
    over = [w for w in check_health(series, {"device_total_bytes": 16 * GiB}) if w.code == "plan_mismatch"]
    assert len(over) == 1 and over[0].level == "warning" and "22% above" in over[0].title
    under = [w for w in check_health(series, {"device_total_bytes": 24 * GiB}) if w.code == "plan_mismatch"]
    assert len(under) == 1 and under[0].level == "info" and "below" in under[0].title
    assert "plan_mismatch" not in codes(check_health(series, {"device_total_bytes": 18.5 * GiB}))
