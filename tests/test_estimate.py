"""The estimator: activation terms against autograd's real saved tensors, totals, verdicts, fit search, advice."""

import dataclasses

import pytest
import torch

from core.demo.toy import tiny_config
from core.estimate.activation_terms import layer_activation_bytes
from core.estimate.bill import COMPONENT_ORDER, OUTSIDE_TORCH, estimate
from core.estimate.fit import fit_search, memory_curve
from core.estimate.levers import what_would_fit
from core.estimate.plan import OPTIMIZERS, Estimate, Plan, PlanError
from core.estimate.specs import load_spec, lora_targets, normalize_targets
from tests.saved import saved_storage_bytes

WIDE = dict(
    vocab_size=500, hidden_size=128, intermediate_size=352, num_attention_heads=8, num_key_value_heads=2
)


def _saved_bytes(layers, method, dtype, attn, dropout, batch=2, seq=32):
    """Bytes of distinct non-parameter storages autograd saves in one forward of a real model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("llama", num_hidden_layers=layers, **WIDE)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=dropout))
    model.train()
    ids = torch.randint(0, WIDE["vocab_size"], (batch, seq))
    return saved_storage_bytes(model, lambda: model(input_ids=ids)), cfg


@pytest.mark.parametrize(
    "method,dtype,attn,dropout",
    [
        ("full", "fp32", "sdpa", 0.0),
        ("full", "bf16", "eager", 0.0),
        ("lora", "fp32", "sdpa", 0.1),
        ("lora", "bf16", "sdpa", 0.0),
        ("lora", "bf16", "eager", 0.1),
    ],
)
def test_layer_activations_equal_autograd_saved_tensors(tmp_path, method, dtype, attn, dropout):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    batch, seq = 2, 32
    three, cfg = _saved_bytes(3, method, torch_dtype, attn, dropout, batch, seq)
    two, _ = _saved_bytes(2, method, torch_dtype, attn, dropout, batch, seq)
    measured_per_token = (three - two) / (batch * seq)  # one middle layer, per token

    cfg.save_pretrained(tmp_path)
    plan = Plan(
        model=str(tmp_path),
        tuning=method,
        load_dtype=dtype,
        compute_dtype=dtype,
        lora_r=8,
        lora_dropout=dropout,
        attn=attn,
        seq_len=seq,
        device="cpu",
        autocast=False,
    )
    targets = lora_targets(str(tmp_path), normalize_targets("all-linear")) if method == "lora" else ()
    assert layer_activation_bytes(load_spec(str(tmp_path)), plan, targets) == measured_per_token


def _plan(**kw) -> Plan:
    """A Llama-2-7B plan; without checkpointing unless asked (the tests compare terms it would hide)."""
    return Plan(model="meta-llama/Llama-2-7b-hf", **{"gradient_checkpointing": False, **kw})


def test_components_add_up_to_the_three_totals():
    est = estimate(_plan(batch_size=2, seq_len=1024, gradient_checkpointing=True))
    assert list(est.components) == list(COMPONENT_ORDER)
    inside = sum(v for k, v in est.components.items() if k not in OUTSIDE_TORCH and k != "allocator_overhead")
    assert inside == est.tensor_peak_bytes == est.phases[est.peak_phase]
    assert est.reserved_peak_bytes == est.tensor_peak_bytes + est.components["allocator_overhead"]
    assert est.device_total_bytes == sum(est.components.values())
    assert est.tensor_peak_bytes <= est.reserved_peak_bytes <= est.device_total_bytes
    assert est.peak_phase in ("forward", "backward", "optimizer")


def test_lora_weight_and_adapter_terms_on_llama2_7b():
    est = estimate(_plan(tuning="lora", load_dtype="bf16", lora_r=16, target_modules="q_proj,v_proj"))
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    assert est.components["weights"] == spec.total_params * 2
    # q_proj and v_proj are 4096x4096 in 32 layers: 16 * (4096 + 4096) * 2 * 32
    assert est.trainable_params == 16 * 8192 * 2 * 32
    assert est.components["lora_params"] == est.trainable_params * 4  # fp32 adapters
    assert est.components["optimizer_states"] == est.trainable_params * 8  # AdamW: two fp32 states


def test_settings_move_the_estimate_the_right_way():
    base = estimate(_plan(batch_size=4, seq_len=2048))
    assert estimate(_plan(batch_size=4, seq_len=2048, gradient_checkpointing=True)).device_total_bytes < (
        base.device_total_bytes
    )
    qlora = estimate(_plan(tuning="qlora", batch_size=4, seq_len=2048))
    assert qlora.components["weights"] < base.components["weights"] / 2
    dq_on = estimate(_plan(tuning="qlora", double_quant=True))
    dq_off = estimate(_plan(tuning="qlora", double_quant=False))
    assert dq_on.components["quant_constants"] < dq_off.components["quant_constants"]
    eager = estimate(_plan(attn="eager", seq_len=2048))
    sdpa = estimate(_plan(attn="sdpa", seq_len=2048))
    assert eager.components["activations"] > sdpa.components["activations"]
    full = estimate(_plan(tuning="full", load_dtype="fp32", optim="adamw_8bit", batch_size=1, seq_len=256))
    assert full.trainable_params == full.total_params
    assert full.components["optimizer_states"] < full.total_params * 3


def test_paged_optimizer_states_sit_outside_torch():
    est = estimate(_plan(optim="paged_adamw_32bit", lora_r=64))
    assert est.components["paged_optimizer_states"] > 0
    assert est.device_total_bytes - est.reserved_peak_bytes == (
        est.components["paged_optimizer_states"] + est.components["cuda_context"]
    )


def test_verdict_follows_the_card():
    plan = _plan(tuning="qlora", batch_size=1, seq_len=512, gradient_checkpointing=True)
    small, big = estimate(dataclasses.replace(plan, gpu_gb=4)), estimate(dataclasses.replace(plan, gpu_gb=80))
    assert small.verdict == "does not fit" and not small.fits
    assert big.verdict == "fits" and big.fits


def test_reference_model_cases():
    lora = estimate(_plan(method="dpo", batch_size=1, seq_len=512))
    assert "adapter disabled" in lora.reference
    assert lora.components["reference_model"] == 0
    single = estimate(_plan(batch_size=1, seq_len=512))
    doubled = estimate(_plan(batch_size=2, seq_len=512))
    assert lora.components["activations"] == doubled.components["activations"]  # chosen + rejected
    assert lora.components["activations"] > single.components["activations"]
    full = estimate(_plan(tuning="full", method="dpo", batch_size=1, seq_len=256))
    assert "second" in full.reference
    assert full.components["reference_model"] == full.components["weights"]


def test_fit_search_lands_at_the_edge():
    plan = _plan(tuning="qlora", gradient_checkpointing=True, batch_size=1, seq_len=1024, gpu_gb=24)
    fit = fit_search(plan)
    b, s = fit["max_batch_size"], fit["max_seq_len"]
    assert b >= 1 and s >= 64
    limit = 0.90 * plan.gpu_bytes
    assert estimate(dataclasses.replace(plan, batch_size=b)).device_total_bytes <= limit
    assert estimate(dataclasses.replace(plan, batch_size=b + 1)).device_total_bytes > limit
    assert estimate(dataclasses.replace(plan, seq_len=s)).device_total_bytes <= limit
    if s < fit["seq_len_cap"]:
        assert estimate(dataclasses.replace(plan, seq_len=s + 64)).device_total_bytes > limit


def test_what_would_fit_is_ranked_and_each_saving_is_a_real_re_estimate():
    plan = _plan(batch_size=4, seq_len=2048)
    base = estimate(plan)
    advice = what_would_fit(plan)
    assert len(advice) >= 5
    # what this card can do first, more GPUs last (issue #51): each group ranked by what it saves
    more = [a for a in advice if "gpus" in a["settings"]]
    assert more and advice[-len(more) :] == more
    for group in (advice[: -len(more)], more):
        assert [a["saves_bytes"] for a in group] == sorted((a["saves_bytes"] for a in group), reverse=True)
    for a in advice:
        changed = estimate(dataclasses.replace(plan, **a["settings"]))
        assert a["saves_bytes"] == base.device_total_bytes - changed.device_total_bytes > 0
    labels = " ".join(a["change"] for a in advice)
    for word in (
        "checkpointing",
        "QLoRA",
        "8-bit",
        "shorter",
        "gradient_accumulation",
        "expandable_segments",
    ):
        assert word in labels


def test_memory_curve_rises_with_sequence_length():
    rows = memory_curve(_plan(), "seq_len", [256, 512, 1024])
    totals = [r["device_total_bytes"] for r in rows]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_plan_round_trips_through_a_dict():
    plan = _plan(tuning="qlora", lora_r=32, optim="paged_adamw_8bit")
    again = Plan.from_dict(dataclasses.asdict(plan))
    assert again == plan
    assert isinstance(estimate(again), Estimate)
    with pytest.raises(PlanError, match="Unknown plan setting"):
        Plan.from_dict({"model": "x", "bogus": 1})


def test_a_plan_dict_in_the_older_names_still_reads():
    """Issue #48: plan.json files and saved plan dicts said full / lora / qlora as `method` and the run config's
    method as `objective`; they read into tuning and method (the value sets are disjoint)."""
    from core.estimate.from_config import plan_to_config

    plan = _plan(tuning="qlora", method="dpo", lora_r=8)
    new = plan.to_dict()
    old = {
        **{k: v for k, v in new.items() if k not in ("tuning", "method")},
        "method": "qlora",
        "objective": "dpo",
    }
    assert Plan.from_dict(old) == plan
    assert plan_to_config(old) == plan_to_config(new)
    assert Plan.from_dict({"method": "full"}) == Plan(tuning="full")
    assert Plan.from_dict({"objective": "kto"}) == Plan(method="kto")
    with pytest.raises(PlanError, match="objective is the older name of method"):
        Plan.from_dict({"method": "sft", "objective": "dpo"})
    with pytest.raises(PlanError, match="method 'lora' is a tuning"):
        estimate(Plan(method="lora"))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"optim": "adamw_magic"}, "Unknown optimizer 'adamw_magic'.*paged_adamw_8bit"),
        ({"batch_size": 0}, "batch_size must be a whole number above zero"),
        ({"seq_len": -5}, "seq_len must be"),
        ({"gpu_gb": 0}, "gpu_gb must be a positive"),
        ({"lora_r": 8192}, "larger than every layer it adapts"),
        ({"tuning": "prefix"}, "tuning 'prefix' is not one of"),
        ({"lora_dropout": 1.5}, "lora_dropout"),
    ],
)
def test_bad_plans_raise_a_clear_error(change, match):
    with pytest.raises(PlanError, match=match):
        estimate(_plan(**change))


def test_sequence_longer_than_the_model_is_a_warning():
    est = estimate(_plan(seq_len=8192, gradient_checkpointing=True))
    assert any("max_position_embeddings" in w for w in est.warnings)


def test_every_listed_optimizer_estimates():
    for name in OPTIMIZERS:
        assert estimate(_plan(optim=name, seq_len=256)).device_total_bytes > 0
