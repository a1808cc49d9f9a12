"""The planner per GPU (core.estimate.shard_terms): DDP replicates, FSDP and ZeRO-3 divide the static terms by N
(not the 4-bit quantization constants) and add the gathered units, activations and logits are never divided, each
process pays NCCL, every rank loads a 4-bit model whole before it is sharded; auto picks DDP when one card holds
the plan; the levers offer more GPUs; the CLI and the run config reach it through the one mapping
(core.estimate.from_config)."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from core.estimate import cli, from_config
from core.estimate.bill import estimate
from core.estimate.from_config import plan_for_config, plan_to_config
from core.estimate.levers import what_would_fit
from core.estimate.plan import Plan, PlanError
from core.estimate.shard_terms import DIVIDED, NCCL_CONTEXT_BYTES
from core.recipe.config import validate_config
from tests.fake_gpu import BusyNvml

QLORA_7B = Plan(model="meta-llama/Llama-2-7b-hf", tuning="qlora", batch_size=2, seq_len=1024)
NOT_DIVIDED = ("activations", "logits_loss", "lm_head_loss", "autocast_weight_copies")


def at(phase: str, est, name: str) -> int:
    return est.phase_components[phase].get(name, 0)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_zero3"])
def test_sharding_divides_the_static_terms_and_not_the_activations(strategy, n):
    one = estimate(QLORA_7B)
    many = estimate(replace(QLORA_7B, gpus=n, strategy=strategy))
    assert many.distributed["strategy"] == strategy and many.distributed["gpus"] == n
    for name in DIVIDED:
        assert at("optimizer", many, name) == -(-at("optimizer", one, name) // n), name
    assert at("optimizer", many, "gradients") == -(-at("optimizer", one, "gradients") // n)
    # bitsandbytes keeps them in each weight's QuantState, not a parameter: no strategy shards them
    assert at("optimizer", many, "quant_constants") == at("optimizer", one, "quant_constants") > 0
    for name in NOT_DIVIDED:
        assert at("forward", many, name) == at("forward", one, name), name
    assert at("forward", many, "gathered_params") > 0  # the unsharded units in flight
    assert at("optimizer", many, "gathered_params") == 0  # resharded before the step
    assert many.components["nccl_context"] == NCCL_CONTEXT_BYTES
    assert many.device_total_bytes < one.device_total_bytes


def test_ddp_replicates_everything_and_adds_its_gradient_buckets():
    one = estimate(QLORA_7B)
    ddp = estimate(replace(QLORA_7B, gpus=2, strategy="ddp"))
    for phase in ("forward", "backward", "optimizer"):
        for name, value in one.phase_components[phase].items():
            assert at(phase, ddp, name) == value, (phase, name)
        assert at(phase, ddp, "comm_buffers") == at("optimizer", one, "gradients")
    assert ddp.device_total_bytes > one.device_total_bytes


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_zero3"])
def test_every_rank_loads_the_4bit_model_whole_before_it_is_sharded(strategy):
    plan = replace(QLORA_7B, gpus=8, strategy=strategy, batch_size=1, seq_len=256)
    est = estimate(plan)
    one = estimate(replace(plan, gpus=1))
    full = at("optimizer", one, "weights") + at("optimizer", one, "quant_constants")
    assert est.distributed["load_peak_bytes"] == est.phases["load"] == full
    assert est.peak_phase == "load"  # with 8 ranks the step is smaller than the load
    assert est.distributed["step_device_total_bytes"] < est.device_total_bytes
    assert any(w.startswith("Every GPU first loads the whole 4-bit model") for w in est.warnings)
    # a 16-bit base loads on the CPU (FSDP) or sharded as it loads (ZeRO-3's zero.Init): no such moment
    lora = estimate(replace(plan, tuning="lora"))
    assert lora.distributed["load_peak_bytes"] == 0 and "load" not in lora.phases
    assert lora.distributed["step_device_total_bytes"] == lora.device_total_bytes
    assert not any(w.startswith("Every GPU first loads") for w in lora.warnings)


def test_cpu_offload_moves_the_shards_off_the_card():
    plan = replace(QLORA_7B, gpus=2, strategy="fsdp")
    on, off = estimate(replace(plan, cpu_offload=True)), estimate(plan)
    for name in DIVIDED:
        assert at("forward", on, name) == 0
    moved = sum(at("optimizer", off, name) for name in DIVIDED) + at("optimizer", off, "gradients")
    assert on.distributed["cpu_offload_bytes"] == moved
    assert at("forward", on, "gathered_params") == at("forward", off, "gathered_params")
    with pytest.raises(PlanError, match="cpu_offload needs a sharding strategy"):
        estimate(replace(plan, strategy="ddp", cpu_offload=True))


def test_auto_is_ddp_when_one_card_holds_the_plan_else_fsdp():
    assert estimate(replace(QLORA_7B, gpus=2)).distributed["strategy"] == "ddp"
    big = Plan(model="meta-llama/Llama-2-13b-hf", tuning="lora", gpus=2, gpu_gb=24.0)
    assert estimate(replace(big, strategy="ddp")).verdict == "does not fit"  # 24 GiB of 16-bit weights each
    est = estimate(big)
    assert est.distributed["strategy"] == "fsdp" and est.verdict == "fits"
    assert est.plan["strategy"] == "auto"  # the estimate records the plan as asked


def test_one_gpu_plan_records_stay_as_they_were():
    assert "gpus" not in QLORA_7B.to_dict() and "distributed" not in estimate(QLORA_7B).to_dict()
    two = replace(QLORA_7B, gpus=2)
    assert Plan.from_dict(two.to_dict()) == two
    with pytest.raises(PlanError, match="gpus must be a whole number"):
        estimate(replace(QLORA_7B, gpus=0))


def test_what_would_fit_offers_more_gpus_with_fsdp_when_one_card_cannot():
    plan = Plan(model="meta-llama/Llama-2-70b-hf", tuning="lora", gpu_gb=80.0)
    advice = what_would_fit(plan)
    more = [a for a in advice if "gpus" in a["settings"]]
    assert len(more) == 1 and more[0]["verdict"] == "fits" and more[0]["settings"]["strategy"] == "fsdp"
    assert not any("gpus" in a["settings"] for a in advice if a["combined"])
    # on DDP the same GPUs sharded come first
    ddp = replace(plan, gpus=4, strategy="ddp")
    assert any(a["settings"] == {"strategy": "fsdp"} and a["verdict"] == "fits" for a in what_would_fit(ddp))


def test_the_run_config_reaches_the_plan_through_the_one_mapping():
    cfg = validate_config(
        {
            "model": {"path": "meta-llama/Llama-2-7b-hf"},
            "data": {"path": "d.jsonl"},
            "quantization": {"load_in_4bit": True},
            "distributed": {
                "gpus": [0, 1],
                "strategy": "fsdp",
                "cpu_offload": True,
                "num_machines": 2,
                "main_process_ip": "10.0.0.1",
            },
        }
    )
    plan = plan_for_config(cfg)
    assert (plan.gpus, plan.strategy, plan.cpu_offload) == (4, "fsdp", True)
    back = plan_to_config(plan, cfg)
    assert back["distributed"] == cfg["distributed"]  # ids kept: the same count per machine
    assert plan_to_config(replace(plan, gpus=8), cfg)["distributed"]["gpus"] == 4


def test_cli_plans_per_gpu(capsys):
    args = ["--model", "meta-llama/Llama-2-7b-hf", "--tuning", "qlora", "--gpus", "2", "--strategy", "fsdp"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "2 GPUs, strategy fsdp: every figure above is per GPU" in out and "verdict per GPU: fits" in out
    assert "gathered_params" in out and "nccl_context" in out
    assert cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["distributed"]["strategy"] == "fsdp" and data["plan"]["gpus"] == 2
    assert cli.main(args[:4] + ["--strategy", "zero9"]) == 2


def test_cli_plans_a_multi_gpu_config_on_a_named_card_and_refuses_the_missing_gpus(
    tmp_path, capsys, monkeypatch
):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {path: meta-llama/Llama-2-70b-hf}\ndata: {path: d.jsonl}\n"
        "training: {max_length: 2048, per_device_train_batch_size: 1}\ndistributed: {gpus: 8}\n"
    )
    assert cli.main(["--config", str(path), "--gpu-gb", "48", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["distributed"] == {
        **data["distributed"],
        "gpus": 8,
        "strategy": "fsdp",
    }  # auto: 70B in 16 bits needs FSDP
    assert data["verdict"] == "fits"
    assert cli.main(["--config", str(path), "--gpu-gb", "48", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "does not fit"  # the flag overrides the config
    # this machine's card (no GPU driver here, or mocked to none): eight GPUs are not there
    monkeypatch.setattr(from_config, "local_card", lambda: from_config.Card("cpu", 16.0, "this CPU", 0))
    assert cli.main(["--config", str(path)]) == 2
    assert "asks for 8 GPUs but this machine has 0 CUDA GPUs" in capsys.readouterr().err


def test_published_benchmark_plans_every_point_and_says_why_it_misses(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import multi_gpu_published as bench

    rc = bench.main(["--json", str(tmp_path / "rows.json")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("multi_gpu_published: median ") and "(goal median <=10%, worst <=20%)" in last
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows) == len(bench.POINTS) >= 15
    median = sorted(abs(r["error"]) for r in rows)[len(rows) // 2]
    assert rc == (
        0 if median <= bench.GOAL_MEDIAN and max(abs(r["error"]) for r in rows) <= bench.GOAL_WORST else 1
    )
    for r in rows:  # a point planned more than the median goal away from its published figure says why
        assert abs(r["error"]) <= bench.GOAL_MEDIAN or r["why"], r["point"]


def test_cli_names_a_gpu_of_this_machine_another_process_fills_mocked_gpu_driver(
    tmp_path, capsys, monkeypatch
):
    from core import gpu

    monkeypatch.setattr(gpu, "NvmlSource", BusyNvml)
    cards = tuple(BusyNvml().devices())
    monkeypatch.setattr(
        from_config, "local_card", lambda: from_config.Card("cuda", 24.0, "the RTX 4090", 2, cards)
    )
    path = tmp_path / "run.yaml"
    text = (
        "model: {path: meta-llama/Llama-2-7b-hf}\nquantization: {load_in_4bit: true}\ndata: {path: d.jsonl}\n"
    )
    path.write_text(text + "distributed: {gpus: [1]}\n")
    assert cli.main(["--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: GPU 1 already has 23.8 of 24 GiB in use (pid 4242: 23.5 GiB)" in err, err
    assert (
        cli.main(["--config", str(path), "--gpu-gb", "24"]) == 0
    )  # another card planned: this one is not read
    assert "already has" not in capsys.readouterr().err
    path.write_text(text + "distributed: {gpus: [0]}\n")
    assert cli.main(["--config", str(path)]) == 0
    assert "already has" not in capsys.readouterr().err


def test_more_gpus_do_not_fit_a_4bit_model_no_card_can_load():
    """70B QLoRA on 24 GiB cards: FSDP divides the step, but every GPU first holds the whole 4-bit model (34 GiB):
    no count of GPUs is offered as a fit, and the verdict names the load moment."""
    plan = Plan(model="meta-llama/Llama-2-70b-hf", tuning="qlora", gpu_gb=24.0)
    assert not [a for a in what_would_fit(plan) if "gpus" in a["settings"] and a["verdict"] == "fits"]
    est = estimate(replace(plan, gpus=8, strategy="fsdp"))
    assert est.verdict == "does not fit" and est.peak_phase == "load"
    assert est.distributed["step_device_total_bytes"] < 0.9 * est.gpu_bytes  # the step alone would fit
