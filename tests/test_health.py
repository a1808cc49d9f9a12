"""Health rules on real training curves of a tiny Llama (CPU) and on GPU samples from a fake NVML source.

Loss curves come from real optimisation steps (a healthy lr, lr ~ 0, a divergent lr, one broken batch).
GPU figures cannot be produced without a GPU: those tests feed core.gpu.take_samples a fake driver source
(the only mock, named in each test) and write the samples exactly as GpuSampler does.
"""

import json
import time
from dataclasses import asdict

import pytest
import torch

from core.gpu import GpuInfo, take_samples
from core.monitor.health import HealthChecker, HealthSettings
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
    warnings = HealthChecker().check(RunSeries.from_records(records))
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
    w = [x for x in HealthChecker().check(series, status={"state": "running"}) if x.code == "low_utilization"]
    assert len(w) == 1
    assert "35%" in w[0].detail and "dataloader_num_workers" in w[0].fix
    # Same samples but the run has finished: an idle GPU is expected then.
    assert "low_utilization" not in codes(HealthChecker().check(series, status={"state": "finished"}))
    # Too short a window is not "sustained".
    short = RunSeries.from_records(healthy_records, fake_gpu_records(t0, 60, used=int(12 * GiB), util=35))
    assert "low_utilization" not in codes(HealthChecker().check(short, status={"state": "running"}))


def test_memory_over_90_percent_warns_fake_gpu_samples(healthy_records):
    t0 = healthy_records[0]["time"]
    series = RunSeries.from_records(healthy_records, fake_gpu_records(t0, 30, used=int(23 * GiB), util=99))
    w = [x for x in HealthChecker().check(series) if x.code == "memory_high"]
    assert len(w) == 1 and "96%" in w[0].title and "24.0 GiB" in w[0].detail
    ok = RunSeries.from_records(healthy_records, fake_gpu_records(t0, 30, used=int(21 * GiB), util=99))
    assert "memory_high" not in codes(HealthChecker().check(ok))


def test_measured_peak_against_plan_fake_gpu_samples(healthy_records):
    t0 = healthy_records[0]["time"]
    gpu = fake_gpu_records(t0, 30, used=int(20 * GiB), util=99, process_memory=int(19.5 * GiB))
    series = RunSeries.from_records(healthy_records, gpu)
    over = [
        w
        for w in HealthChecker().check(series, {"device_total_bytes": 16 * GiB})
        if w.code == "plan_mismatch"
    ]
    assert len(over) == 1 and over[0].level == "warning" and "22% above" in over[0].title
    under = [
        w
        for w in HealthChecker().check(series, {"device_total_bytes": 24 * GiB})
        if w.code == "plan_mismatch"
    ]
    assert len(under) == 1 and under[0].level == "info" and "below" in under[0].title
    assert "plan_mismatch" not in codes(HealthChecker().check(series, {"device_total_bytes": 18.5 * GiB}))


# --- DPO runs: synthetic metrics.jsonl in the trainer's format for DPOTrainer (tests/test_watch.write_dpo_run) ---

DPO_CODES = {"preference_chance_accuracy", "preference_margin_flat", "preference_chosen_collapse"}


def dpo_warnings(run_dir):
    """The warnings the Monitor shows for a run directory (status, config and metrics read from its files)."""
    from core.monitor.watch import RunWatcher

    return RunWatcher(run_dir).refresh().warnings


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_dpo_run_is_quiet(tmp_path, seed):
    from test_watch import dpo_records, write_dpo_run

    run = write_dpo_run(tmp_path / "dpo", "healthy", steps=100)
    recs = dpo_records("healthy", 100, seed=seed)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert dpo_warnings(run) == []


def test_dpo_accuracy_stuck_at_chance_warns_once_enough_points_are_in(tmp_path):
    from test_watch import dpo_records, write_dpo_run

    from core.monitor.watch import RunWatcher

    run = write_dpo_run(tmp_path / "dpo", "chance", steps=29, max_steps=100)
    watcher = RunWatcher(run)
    # warm-up: 10% of 100 steps; steps 11-29 are 19 logged points, one short of a verdict
    assert watcher.refresh().warnings == []
    recs = dpo_records("chance", 30, max_steps=100)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(recs[-1]) + "\n")
    warnings = watcher.refresh().warnings
    assert codes(warnings) == {
        "preference_chance_accuracy"
    }  # the flat margin says the same: one warning, not two
    w = warnings[0]
    train = [r["rewards/accuracies"] for r in recs if "rewards/accuracies" in r]
    mean = sum(train[10:30]) / 20
    assert f"rewards/accuracies averaged {mean:.2f} over the last 20 logged points (steps 11-30)" in w.detail
    assert w.fix.startswith("Stop the run and relaunch") and "training.learning_rate" in w.fix
    assert "training.loss_type" in w.fix
    # the whole run at chance, finished: not told to stop
    done = write_dpo_run(tmp_path / "done", "chance", steps=100, state="finished")
    (w,) = dpo_warnings(done)
    assert w.code == "preference_chance_accuracy" and w.fix.startswith("Relaunch") and "Stop" not in w.fix
    assert "eval accuracy 0.5" in w.detail
    # 100 steps at chance, but max steps is 2000: still in the warm-up, no verdict
    assert dpo_warnings(write_dpo_run(tmp_path / "warming", "chance", steps=100, max_steps=2000)) == []


def test_dpo_margin_not_rising_warns(tmp_path):
    from test_watch import write_dpo_run

    run = write_dpo_run(tmp_path / "flat", "flat", steps=100)
    warnings = dpo_warnings(run)
    # the accuracy is above chance (0.7): only the margin says it
    assert codes(warnings) == {"preference_margin_flat"}
    w = warnings[0]
    assert "rewards/margins" in w.detail and "to step 100" in w.detail
    assert "training.beta" in w.fix and "training.learning_rate" in w.fix and w.fix.startswith("Stop the run")
    stopped = write_dpo_run(tmp_path / "stopped", "flat", steps=100, state="stopped")
    (w,) = dpo_warnings(stopped)
    assert w.code == "preference_margin_flat" and "Stop" not in w.fix
    # 21 steps: the warm-up is 2.1 of them, so 19 points (steps 3-21) to judge, one short of a verdict
    assert dpo_warnings(write_dpo_run(tmp_path / "short", "flat", steps=21)) == []
    assert codes(dpo_warnings(write_dpo_run(tmp_path / "enough", "flat", steps=22))) == {
        "preference_margin_flat"
    }


def test_dpo_chosen_reward_collapsing_while_the_margin_rises_warns(tmp_path):
    from test_watch import write_dpo_run

    run = write_dpo_run(tmp_path / "collapse", "collapse", steps=100)
    warnings = dpo_warnings(run)
    assert codes(warnings) == {"preference_chosen_collapse"}
    w = warnings[0]
    assert "rewards/chosen fell steadily" in w.detail and "logps/chosen went from" in w.detail
    assert "lower training.learning_rate" in w.fix and "higher training.beta" in w.fix
    assert w.fix.startswith("Stop the run")
    done = write_dpo_run(tmp_path / "done", "collapse", steps=100, state="finished")
    (w,) = dpo_warnings(done)
    assert (
        w.code == "preference_chosen_collapse" and "Stop" not in w.fix and "checkpoint from before" in w.fix
    )
    # a healthy run's chosen reward dips too, but by a small share of the margin's rise: no warning
    assert "preference_chosen_collapse" not in codes(dpo_warnings(write_dpo_run(tmp_path / "ok", "healthy")))
    # too few points after the warm-up
    assert dpo_warnings(write_dpo_run(tmp_path / "early", "collapse", steps=100, max_steps=1000)) == []


def test_dpo_rules_never_fire_on_sft_runs(small_llama, healthy_records, tmp_path):
    flat = train_tiny(small_llama, lr=1e-9, steps=40)
    for records in (healthy_records, flat):
        warnings = HealthChecker(FAST).check(RunSeries.from_records(records), status={"state": "running"})
        assert not codes(warnings) & DPO_CODES
    # an SFT run directory whose loss does not move: the SFT rule speaks, never a DPO one
    run = tmp_path / "sft"
    run.mkdir()
    (run / "config.yaml").write_text("method: sft\nmodel: {path: m}\ndata: {path: d.jsonl}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in flat))
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 40, "max_steps": 40}))
    assert not codes(dpo_warnings(run)) & DPO_CODES


def test_sft_loss_flat_rule_leaves_dpo_runs_to_their_own_rules():
    from test_watch import dpo_records

    series = RunSeries.from_records(dpo_records("chance", 100))
    warnings = HealthChecker(FAST).check(series, status={"state": "running", "max_steps": 100})
    assert codes(warnings) == {"preference_chance_accuracy"}  # not loss_flat with SFT's learning-rate advice


def test_a_kto_run_is_judged_by_its_own_rules_in_its_own_words(tmp_path):
    """Issue #20: the preference rules come from the run's method (core.recipe.methods: `health`). A KTO run logs
    no preference accuracy (its rows are not pairs) and calls its preferred answers desirable."""
    from test_watch import write_dpo_run

    run = write_dpo_run(tmp_path / "flat", "flat", steps=100, method="kto")
    kto_lines = []
    for line in (run / "metrics.jsonl").read_text().splitlines():  # what KTOTrainer logs: no accuracies, a KL
        rec = json.loads(line)
        rec.pop("rewards/accuracies", None)
        rec.pop("eval_rewards/accuracies", None)
        kto_lines.append(json.dumps({**rec, "kl": 0.01}))
    (run / "metrics.jsonl").write_text("\n".join(kto_lines) + "\n")
    (w,) = dpo_warnings(run)
    assert w.code == "preference_margin_flat" and w.title == "KTO reward margin is not rising"
    assert "the desirable answers are not gaining on the undesirable ones" in w.detail
    assert "DPO" not in w.title + w.detail + w.fix and "LoRA KTO usually trains at" in w.fix
    # the same figures of a DPO run: DPO's words
    (d,) = dpo_warnings(write_dpo_run(tmp_path / "dpo", "flat", steps=100))
    assert d.title == "DPO reward margin is not rising" and "chosen answers are not gaining" in d.detail
    # no config: the figures tell (a KL and no accuracy is KTO's)
    (run / "config.yaml").unlink()
    assert [w.title for w in dpo_warnings(run)] == ["KTO reward margin is not rising"]
