"""Gemma 4's mixture of experts and Gemma 3n's text decoder, planned layer by layer (core.estimate.layer_shapes,
core.estimate.gemma_moe_terms, core.estimate.gemma3n_terms): each layer's shape is read from the meta model's
modules, the plan is no longer refused, a tiny twin's real step measures within 5% of its plan with and without
gradient checkpointing (benchmarks/families_accuracy.py's twins and measurement); tests/test_hybrid_train.py trains,
merges and evaluates them."""

import json
import sys

import pytest

from core.estimate.layer_kinds import kinds_of
from core.estimate.layer_shapes import shapes_of
from core.estimate.moe import moe_of
from core.estimate.specs import load_spec
from tests.cli import REPO
from tests.test_estimate_cli import estimate_main

sys.path.insert(0, str(REPO / "benchmarks"))
from families_accuracy import FAMILIES, MODEL_TYPES, measure  # noqa: E402  (the benchmark's own twins)

TOLERANCE = 0.05


def saved_folder(tmp_path, family: str, **changes):
    from transformers import AutoConfig

    folder = tmp_path / family
    fields = {**FAMILIES[family][0], **changes}
    AutoConfig.for_model(MODEL_TYPES.get(family, family), **fields).save_pretrained(folder)
    return folder


def plan(folder, *args) -> dict:
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", "--lora-r", "4", *args)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def test_gemma3ns_layers_are_each_read_with_their_own_mlp_width_altup_and_laurel(tmp_path):
    """The MLP widths transformers gives per layer (it was refused: "gives intermediate_size per layer"), AltUp's 4
    copies, Laurel's rank 8, activation sparsity in the first two layers, the last two layers reusing K/V."""
    spec = load_spec(str(saved_folder(tmp_path, "gemma3n_text")))
    got = [(s.inter, s.kv_heads, s.window, s.altup, s.laurel, s.sparse, s.store) for s in shapes_of(spec)]
    assert got == [
        (128, 2, 128, 4, 8, True, True),
        (96, 2, 0, 4, 8, True, True),
        (160, 0, 128, 4, 8, False, False),
        (128, 0, 0, 4, 8, False, False),
    ]
    out = plan(saved_folder(tmp_path, "gemma3n_text"))
    assert out["trainable_params"] > 0 and out["tensor_peak_bytes"] > 0


def test_the_per_layer_widths_and_altups_copies_reach_the_bill(tmp_path):
    """The per-layer width and AltUp's copies reach the bill: one layer's MLP four times wider plans more
    activations, two copies of the hidden stream rather than four fewer (same everything else)."""
    base = plan(saved_folder(tmp_path / "a", "gemma3n_text"), "--no-gradient-checkpointing")
    wider = plan(
        saved_folder(tmp_path / "b", "gemma3n_text", intermediate_size=[128, 384, 160, 128]),
        "--no-gradient-checkpointing",
    )
    copies = plan(
        saved_folder(tmp_path / "c", "gemma3n_text", altup_num_inputs=2), "--no-gradient-checkpointing"
    )
    activations = base["components"]["activations"]
    assert wider["components"]["activations"] > activations
    assert copies["components"]["activations"] < activations


def test_gemma4_moe_runs_its_dense_mlp_and_the_experts_side_by_side(tmp_path):
    """enable_moe_block: every layer keeps its dense MLP (a shared expert, 128 wide) next to 4 routed experts 32 wide,
    top_k_experts (Gemma 4's name for num_experts_per_tok) of them per token, the router's weights renormalised;
    router.proj is the layer's Linear router and every layer is a MoE layer."""
    folder = saved_folder(tmp_path, "gemma4_text_moe")
    spec = load_spec(str(folder))
    facts = moe_of(spec)
    assert (facts.experts, facts.top_k, facts.width, facts.shared_width) == (4, 2, 32, 128)
    assert (facts.experts_path, facts.router_path, facts.renormalise, facts.unsupported) == (
        "experts",
        "router",
        True,
        "",
    )
    assert [s.router for s in shapes_of(spec)] == [4, 4]
    assert [block for _, block in kinds_of(spec)] == ["moe", "moe"]
    out = plan(folder)
    assert out["moe"]["shared_width"] == 128 and out["moe"]["top_k"] == 2


def test_gemma4_moe_without_top_k_experts_is_refused_in_one_sentence_naming_the_key(tmp_path):
    folder = saved_folder(tmp_path, "gemma4_text_moe", top_k_experts=None)
    proc = estimate_main("--model", str(folder))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "leaves top_k_experts unset" in proc.stderr and "set top_k_experts" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
@pytest.mark.parametrize("family", ["gemma4_text_moe", "gemma3n_text"])
def test_a_gemma_twins_real_step_measures_within_5pct_of_its_plan(family, checkpointing):
    planned, measured = measure(family, FAMILIES[family][0], 300, checkpointing)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_gemma4_moe_with_lora_on_its_experts_measures_within_5pct_of_its_plan(checkpointing):
    """LoRA on the experts too (peft's target_parameters: experts.gate_up_proj / down_proj, folded into a merged
    copy of each stack every forward), next to all-linear (router.proj included)."""
    from transformers import AutoConfig

    from core.estimate.plan import Plan
    from core.measure.step import measure_config

    plan = Plan(
        model="twin",
        device="cpu",
        seq_len=300,
        batch_size=1,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        gradient_checkpointing=checkpointing,
        target_parameters="experts.gate_up_proj,experts.down_proj",
    )
    config = AutoConfig.for_model("gemma4_text", **FAMILIES["gemma4_text_moe"][0])
    result = measure_config(config, plan)
    planned, measured = result["estimated"]["tensor_peak_bytes"], result["measured"]["steady_peak_bytes"]
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


@pytest.mark.slow
def test_a_softcapped_heads_fused_loss_keeps_its_tanh_through_backward():
    """TRL's fused head on the CPU keeps t = tanh(y / cap) through each tile's backward (Gemma 2 / 3 / 3n): with a
    vocabulary wide enough for the tile to matter, the softcapped twin's step is a tile of fp32 above the uncapped
    one's, and the plan counts it (without the term the capped plan read 11% under)."""
    wide = dict(FAMILIES["llama"][0], vocab_size=32768, head_dim=16, num_key_value_heads=2)
    capped = measure("gemma2", wide, 300, False)
    uncapped = measure("gemma2", dict(wide, final_logit_softcapping=None), 300, False)
    for planned, measured in (capped, uncapped):
        assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)
    tile = 299 * 32768
    assert capped[1] - uncapped[1] >= 3 * tile  # the measured step holds the kept tanh tile
