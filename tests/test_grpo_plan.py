"""The GRPO memory bill: its generation phase and the rollouts' terms appear and behave (beta 0 or above with LoRA
or a full fine-tune, vLLM's pool and sleep mode, checkpointing), the run config maps to a plan and back, "What
would make it fit" offers GRPO's own changes, the CLIs print the bill, and a real GRPO smoke step on the CPU
lands within 5% of the plan, phase by phase (benchmarks/grpo_accuracy.py runs more shapes)."""

import json
from dataclasses import replace

import pytest

from core.estimate.bill import estimate
from core.estimate.fit import fit_search
from core.estimate.from_config import plan_for_draft, plan_to_config
from core.estimate.levers import what_would_fit
from core.estimate.plan import FRAGMENTATION, GiB, Plan, PlanError
from core.estimate.specs import load_spec

QWEN = "Qwen/Qwen2.5-1.5B"
TOLERANCE = 0.05


def grpo(**kw) -> Plan:
    base = dict(
        model=QWEN,
        method="grpo",
        tuning="lora",
        lora_dropout=0.0,
        batch_size=8,
        seq_len=1024,
        completion_len=768,
        num_generations=8,
    )
    return Plan(**{**base, **kw})


def rollout_terms(est) -> dict:
    return est.phase_components["generation"]


# -- the terms ----------------------------------------------------------------------------------------------------


def test_the_generation_phase_holds_the_kv_cache_of_every_completion_at_its_last_step():
    spec = load_spec(QWEN)
    plan = grpo()
    est = estimate(plan)
    assert set(est.phases) == {"generation", "forward", "backward", "optimizer"}
    assert est.peak_phase == max(est.phases, key=est.phases.get)
    gen = rollout_terms(est)
    kv = spec.kv_cache_bytes_per_token_per_byte * 2  # bf16
    assert est.generation["moment"] == "generate"
    # 8 sequences of 1023 cached tokens, one layer's K or V being concatenated one token longer
    assert gen["kv_cache"] == 8 * 1023 * kv + 8 * 1022 * kv // (2 * spec.num_layers)
    # the training step scores the completions through the fused head; the rollouts stay in every phase
    assert est.phase_components["forward"]["lm_head_loss"] > 0
    assert all(est.phase_components[p]["rollout_batch"] > 0 for p in ("forward", "backward", "optimizer"))
    # twice the completions generated at once: twice the cache; the training step (one batch) is the same
    two = estimate(replace(plan, generation_batch=16))
    assert rollout_terms(two)["kv_cache"] == pytest.approx(2 * gen["kv_cache"], rel=1e-3)
    assert two.phase_components["forward"]["activations"] == est.phase_components["forward"]["activations"]


def test_beta_zero_loads_no_reference_lora_disables_the_adapter_a_full_fine_tune_copies_the_model():
    lora0, lora1 = estimate(grpo()), estimate(grpo(kl_beta=0.04))
    full0, full1 = estimate(grpo(tuning="full")), estimate(grpo(tuning="full", kl_beta=0.04))
    assert lora0.reference is None and full0.reference is None
    for est in (lora0, lora1, full0):
        assert all(c.get("reference_model", 0) == 0 for c in est.phase_components.values())
    assert "adapter disabled" in lora1.reference
    weights = full1.components["weights"] + full1.components["quant_constants"]
    assert all(c["reference_model"] == weights for c in full1.phase_components.values())
    # the reference's log-probs: a no-grad forward in the generation phase, its result kept for the step
    assert rollout_terms(lora0)["logprob_forward"] == 0 and rollout_terms(lora1)["logprob_forward"] > 0
    kept = 4 * 8 * 768  # fp32 per completion token
    assert (
        lora1.phase_components["optimizer"]["rollout_batch"]
        == lora0.phase_components["optimizer"]["rollout_batch"] + kept
    )


def test_old_log_probs_follow_trls_rule():
    """_generate_and_score_completions keeps the old policy's log-probs when gradient_accumulation_steps is not a
    multiple of steps_per_generation x num_iterations, or when vLLM generates."""
    cfg = _config(gradient_accumulation_steps=4)
    assert plan_for_draft(cfg).old_logps is False  # 4 % (4 x 1)
    assert plan_for_draft(_config(gradient_accumulation_steps=4, num_iterations=3)).old_logps is True
    assert plan_for_draft(_config(steps_per_generation=3, gradient_accumulation_steps=2)).old_logps is True
    plan = plan_for_draft(_config(use_vllm=True), device="cuda")
    assert plan.old_logps is True and plan.vllm == "colocate"
    # the smoke step generates once for one update: no old log-probs, one batch generated
    smoke = plan_for_draft(_config(gradient_accumulation_steps=4, num_iterations=3), smoke=True)
    assert smoke.old_logps is False and smoke.generation_batch == smoke.batch_size == 8
    old = estimate(grpo(old_logps=True))
    assert rollout_terms(old)["logprob_forward"] > 0 and old.generation["moment"] in (
        "generate",
        "logprob forward",
    )


def test_vllm_colocated_holds_its_pool_released_outside_generation_with_sleep_mode():
    plan = grpo(vllm="colocate", vllm_fraction=0.3, old_logps=True)
    pool = int(0.3 * plan.gpu_bytes)
    awake, asleep = estimate(plan), estimate(replace(plan, vllm_sleep=True))
    assert rollout_terms(awake)["vllm_pool"] == pool and rollout_terms(awake)["kv_cache"] == 0
    assert set(awake.generation["moments"]) == {"vllm", "logprob forward"}  # no transformers generate
    # vLLM generating (its importance-sampling correction off: no old log-probs): the adapter merged into the
    # weights to sync them, one Linear at a time
    generating = estimate(replace(plan, old_logps=False))
    assert generating.generation["moment"] == "vllm" and rollout_terms(generating)["vllm_weight_sync"] > 0
    for phase in ("forward", "backward", "optimizer"):
        assert awake.phase_components[phase]["vllm_pool"] == pool
        assert asleep.phase_components[phase]["vllm_pool"] == 0
    assert asleep.generation["components"]["vllm_pool"] == pool
    # the pool is allocated whole: the allocator's fragmentation share is taken on what comes and goes only
    c = awake.components
    static = sum(
        c[k] for k in ("weights", "quant_constants", "reference_model", "lora_params", "optimizer_states")
    )
    assert c["allocator_overhead"] == int(FRAGMENTATION * (awake.tensor_peak_bytes - static - pool))
    server = estimate(replace(plan, vllm="server"))
    assert all(c.get("vllm_pool", 0) == 0 for c in server.phase_components.values())
    with pytest.raises(PlanError, match="CUDA GPU"):
        estimate(replace(plan, device="cpu"))
    small = estimate(grpo(model="Qwen/Qwen2.5-7B", vllm="colocate", vllm_fraction=0.3))
    assert any("vLLM refuses to start" in w for w in small.warnings)


def test_checkpointing_shrinks_the_training_step_not_the_generation():
    on, off = estimate(grpo(gradient_checkpointing=True)), estimate(grpo(gradient_checkpointing=False))
    assert on.phase_components["forward"]["activations"] < off.phase_components["forward"]["activations"] / 4
    assert on.phases["generation"] == off.phases["generation"]


def test_trls_rules_are_sentences():
    with pytest.raises(PlanError, match="must divide by num_generations 8"):
        estimate(grpo(batch_size=4))
    with pytest.raises(PlanError, match="at least 2"):
        estimate(grpo(num_generations=1))
    with pytest.raises(PlanError, match="below seq_len"):
        estimate(grpo(completion_len=1024))
    with pytest.raises(PlanError, match="multiple of batch_size"):
        estimate(grpo(generation_batch=12))


# -- the run config, both ways -----------------------------------------------------------------------------------


def _config(**training) -> dict:
    return {
        "method": "grpo",
        "model": {"path": QWEN},
        "data": {"path": "prompts.jsonl"},
        "rewards": [{"type": "match", "column": "answer"}],
        "training": {
            "per_device_train_batch_size": 8,
            "num_generations": 8,
            "max_prompt_length": 256,
            "max_completion_length": 768,
            **training,
        },
    }


def test_a_plan_becomes_a_run_config_and_back():
    cfg = _config(beta=0.04, steps_per_generation=2)
    plan = plan_for_draft(cfg, device="cuda")
    assert (plan.seq_len, plan.completion_len, plan.generation_batch, plan.kl_beta) == (1024, 768, 16, 0.04)
    edited = replace(
        plan,
        batch_size=4,
        num_generations=4,
        generation_batch=4,
        completion_len=64,
        seq_len=320,
        vllm="colocate",
        vllm_fraction=0.4,
        vllm_sleep=True,
        old_logps=True,
    )
    back = plan_to_config(
        edited, {**cfg, "data": {}}
    )  # no data path: unvalidated (vLLM is not installed here)
    t = back["training"]
    assert (t["max_prompt_length"], t["max_completion_length"], t["num_generations"]) == (256, 64, 4)
    assert "max_length" not in t and "steps_per_generation" not in t  # 4 per generation: the default
    assert t["use_vllm"] and t["vllm_gpu_memory_utilization"] == 0.4 and t["vllm_enable_sleep_mode"]
    assert plan_for_draft(back, gpu_gb=plan.gpu_gb, device="cuda") == edited
    # old log-probs without vLLM: a second update per generation is what makes TRL keep them
    plain = replace(edited, vllm="off", vllm_sleep=False)
    again = plan_to_config(plain, back)
    assert again["training"]["num_iterations"] == 2
    assert plan_for_draft(again, gpu_gb=plan.gpu_gb, device="cuda") == plain


# -- what would make it fit ----------------------------------------------------------------------------------------


def test_what_would_fit_offers_grpos_own_changes_each_re_estimated():
    plan = grpo(
        model="meta-llama/Llama-3.1-8B",
        tuning="qlora",
        seq_len=8192,
        completion_len=7680,
        vllm="colocate",
        vllm_fraction=0.5,
        gpu_gb=48.0,
    )
    spec = load_spec(plan.model)
    base = estimate(plan, spec)
    assert base.verdict == "does not fit"
    advice = what_would_fit(plan, spec)
    keys = {k for a in advice for k in a["settings"]}
    assert {"num_generations", "completion_len", "vllm_fraction", "vllm_sleep", "batch_size"} <= keys
    for a in advice:
        changed = replace(plan, **a["settings"])
        assert estimate(changed, spec).device_total_bytes == a["device_total_bytes"]
        assert base.device_total_bytes - a["device_total_bytes"] == a["saves_bytes"]
    fewer = next(a for a in advice if "num_generations" in a["settings"] and not a["combined"])
    s = fewer["settings"]  # the same prompts per generation, fewer completions each
    assert s["generation_batch"] // s["num_generations"] == 8 // 8 and s["num_generations"] < 8
    batch = next(
        a for a in advice if set(a["settings"]) >= {"batch_size"} and "num_generations" not in a["settings"]
    )
    assert batch["settings"]["generation_batch"] == 8 and batch["keeps_training"]
    fraction = next(a for a in advice if "vllm_fraction" in a["settings"])
    assert fraction["settings"]["vllm_fraction"] < 0.5 and "KV cache" in fraction["costs"]


def test_the_fit_search_keeps_whole_groups_and_searches_the_completion():
    plan = grpo(generation_batch=16)  # two steps per generation
    fit = fit_search(plan)
    assert fit["max_batch_size"] % 4 == 0  # batch x 2 steps must divide by 8
    assert fit["max_seq_len"] == 256 + fit["max_completion_len"] and fit["max_completion_len"] > 768
    longest = estimate(replace(plan, completion_len=fit["max_completion_len"], seq_len=fit["max_seq_len"]))
    assert longest.verdict == "fits"


# -- the CLIs ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """A tiny model with the character tokenizer, prompts of exactly 16 tokens, and a GRPO config of it."""
    from core.demo.toy import build_tiny_model

    out = tmp_path_factory.mktemp("grpo")
    model = build_tiny_model(out / "model", "llama", hidden_size=128, intermediate_size=256)
    rows = [{"prompt": ("abcdefghij" * 3)[i % 7 : i % 7 + 16], "answer": "x"} for i in range(12)]
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data, out


def _write(folder, model, data, name, lora=True, **training):
    import yaml

    cfg = {
        "method": "grpo",
        "model": {"path": str(model), "dtype": "float32"},
        "lora": {
            "enabled": lora,
            "r": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "target_modules": "all-linear",
        },
        "data": {"path": str(data), "format": "standard", "eval_split": 0.0},
        "rewards": [{"type": "match", "column": "answer"}],
        "training": {
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_prompt_length": 16,
            "max_steps": 1,
            **training,
        },
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dry_run_and_estimate_print_the_grpo_bill(grpo_run, capsys):
    from core.estimate.cli import main
    from core.train.cli import dry_run

    model, data, out = grpo_run
    path = _write(out, model, data, "dry", max_completion_length=64, beta=0.04)
    assert dry_run(str(path), gpu_gb=24.0) == 0
    record = json.loads(capsys.readouterr().out)
    gen = record["generation"]
    assert record["peak_phase"] in record["phases"] and "generation" in record["phases"]
    assert gen["moment"] == "logprob forward" and gen["components"]["logprob_forward"] > 0
    assert record["components"]["lm_head_loss"] > 0 and record["plan"]["completion_len"] == 64
    assert main(["--config", str(path), "--gpu-gb", "24"]) == 0
    table = capsys.readouterr().out
    assert "generation phase:" in table and "logprob_forward" in table and "lm_head_loss" in table
    assert f"peak phase: {record['peak_phase']}" in table and "longest completion" in table
    assert main(["--model", QWEN, "--method", "grpo", "--batch-size", "8", "--seq-len", "1024"]) == 0
    assert "kv_cache" in capsys.readouterr().out  # TRL's defaults: 8 completions of 256 tokens
    # the data's real lengths are SFT rows' (a prompt's completion is generated, its length unknown before)
    assert main(["--config", str(path), "--gpu-gb", "24", "--data-lengths"]) == 2
    assert "prompt + completion bound" in capsys.readouterr().err


# -- measured: a real GRPO step on the CPU -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "lora", "training", "moment"),
    [
        ("lora-generate", True, {"max_completion_length": 128}, "generate"),  # the KV cache of 4 x 143 tokens
        ("full-reference", False, {"max_completion_length": 16, "beta": 0.04}, "logprob forward"),
    ],
)
def test_a_real_grpo_smoke_step_is_within_five_percent_of_the_plan_phase_by_phase(
    grpo_run, name, lora, training, moment
):
    """The smoke test's own measurement (the tracker over trl.GRPOTrainer's step, its generation marked by the
    method) against the plan.json the trainer wrote for that step: the peak, the generation phase, its name."""
    from core import rundir
    from core.train.run import run_training

    model, data, out = grpo_run
    path = _write(out, model, data, name, lora=lora, **training)
    run_training(str(path), str(out / f"run-{name}"), smoke=True)
    smoke, plan = rundir.read_smoke(out / f"run-{name}"), rundir.read_plan(out / f"run-{name}")
    assert smoke["measured_by"] == "tracker" and "generation" in smoke["phase_peaks"]
    assert abs(plan["tensor_peak_bytes"] / smoke["peak_bytes"] - 1) <= TOLERANCE
    assert abs(plan["phases"]["generation"] / smoke["phase_peaks"]["generation"] - 1) <= TOLERANCE
    assert plan["peak_phase"] == smoke["peak_phase"] and plan["generation"]["moment"] == moment
    if not lora:  # the frozen reference copy a full fine-tune with beta > 0 loads
        assert plan["components"]["reference_model"] > 0
    assert plan["tensor_peak_bytes"] < GiB
