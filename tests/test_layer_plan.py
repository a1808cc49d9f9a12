"""A model is a list of layers, each planned as itself (core.estimate.layer_kinds): hybrids' Gated DeltaNet, Mamba-2
and short-convolution layers are read from the module tree, billed from what their torch code saves, and a real
training step of a tiny twin of each family measures within 5% of its plan with and without gradient
checkpointing (the same measurement as benchmarks/families_accuracy.py, whose real-width twins RESULTS.md records).
`all-linear` means the Linear layers peft can train on the family: Mamba's out_proj and Llama 4's router left
out, said in the plan, and the trainer makes exactly those adapters."""

import json
import sys

import pytest

from core.estimate.layer_kinds import kinds_of
from core.estimate.specs import load_spec
from tests.cli import REPO
from tests.test_estimate_cli import estimate_main

sys.path.insert(0, str(REPO / "benchmarks"))
from families_accuracy import FAMILIES, measure  # noqa: E402  (the benchmark's own twins and measurement)

TOLERANCE = 0.05


def saved_folder(tmp_path, model_type: str, fields: dict):
    from transformers import AutoConfig

    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "model_type, expected",
    [
        ("qwen3_5_text", [(("gated_deltanet",), "mlp")] * 3 + [(("attention",), "mlp")]),
        (
            "nemotron_h",  # "M*M-": Mamba, attention, Mamba, MLP: one module per block, no MLP beside a mixer
            [(("mamba2",), "none"), (("attention",), "none"), (("mamba2",), "none"), ((), "mlp")],
        ),
        ("lfm2", [(("short_conv",), "mlp"), (("attention",), "mlp")]),
        (
            "granitemoehybrid",
            [(("mamba2",), "mlp"), (("attention",), "mlp")],
        ),  # dense, as Granite 4.0-H Micro
    ],
)
def test_each_layer_is_read_as_the_kind_it_is(tmp_path, model_type, expected):
    spec = load_spec(str(saved_folder(tmp_path, model_type, FAMILIES[model_type][0])))
    assert list(kinds_of(spec)) == expected


def test_gemma4s_layers_are_each_read_with_their_own_shape(tmp_path):
    """Sliding layers (head_dim 16, 2 KV heads) and full ones (head_dim 32, 1 KV head, K = V: no v_proj); the last
    two reuse the K/V of the last sliding and full layer below them and cache none; every layer has a per-layer
    input block. transformers refuses the per-layer head_dim as a global: the plan reads the modules."""
    from core.estimate.layer_shapes import shapes_of

    folder = saved_folder(tmp_path, "gemma4_text", FAMILIES["gemma4_text"][0])
    spec = load_spec(str(folder))
    got = [(s.head_dim, s.kv_heads, s.v_proj, s.window, s.ple, s.store) for s in shapes_of(spec)]
    assert got == [
        (16, 2, True, 128, 16, True),
        (32, 1, False, 0, 16, True),
        (16, 0, False, 128, 16, False),
        (32, 0, False, 0, 16, False),
    ]
    assert spec.kv_cache_bytes_per_token_per_byte == 2 * (2 * 16 + 1 * 32)
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", "--lora-r", "4")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_a_pure_mamba2_model_plans_without_attention_heads(tmp_path):
    fields = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16
    )
    folder = saved_folder(tmp_path, "mamba2", fields)
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", "--lora-r", "4")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert out["kv_cache_bytes_per_token"] == 0  # no attention layer keeps a KV cache
    assert any("leaves out the Mamba mixers' out_proj" in w for w in out["warnings"]), out["warnings"]
    # the checkpointed recompute's SSD temporaries are planned (mamba_terms), so no headroom warning is said for them
    assert not any("recomputed backward builds" in w for w in out["warnings"]), out["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3_5_text",
        "qwen3_next",
        "granitemoehybrid",
        "nemotron_h",
        "bamba",
        "falcon_h1",
        "lfm2",
        "gemma4_text",
    ],
)
def test_a_hybrid_twins_real_step_measures_within_5pct_of_its_plan(model_type, checkpointing):
    planned, measured = measure(model_type, FAMILIES[model_type][0], 300, checkpointing)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


def test_all_linear_on_nemotron_h_leaves_the_mamba_out_proj_out_and_says_so(tmp_path):
    folder = saved_folder(tmp_path, "nemotron_h", FAMILIES["nemotron_h"][0])
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", "--lora-r", "4")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    said = [w for w in json.loads(proc.stdout)["warnings"] if "all-linear leaves out" in w]
    assert len(said) == 1 and "out_proj" in said[0] and "nemotron_h" in said[0], said


def test_an_explicit_target_peft_refuses_is_refused_up_front_in_one_sentence(tmp_path):
    folder = saved_folder(tmp_path, "nemotron_h", FAMILIES["nemotron_h"][0])
    proc = estimate_main("--model", str(folder), "--target-modules", "in_proj,out_proj")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "names out_proj, which peft cannot put LoRA on in a nemotron_h model" in proc.stderr


LLAMA4 = FAMILIES["llama4_text"][0]


def test_all_linear_leaves_llama4s_router_out_and_the_adapted_model_trains():
    """peft's own all-linear wraps Llama 4's router (a Linear returning scores and indices) and the first forward
    fails ("'tuple' object has no attribute 'dtype'"); the engine's LoraConfig leaves it out and trains."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.recipe.config import validate_config
    from core.recipe.engine_args import lora_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama4_text", **LLAMA4))
    ids = torch.randint(0, LLAMA4["vocab_size"], (1, 8))
    plain = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(AttributeError):  # what a user of peft's all-linear meets
        plain(input_ids=ids, labels=ids)
    cfg = validate_config({"model": {"path": "unused"}, "data": {"path": "unused.jsonl"}})
    peft_model = get_peft_model(model, lora_config(cfg, model=model))
    adapted = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert "router" not in adapted and {"q_proj", "k_proj", "v_proj", "o_proj"} <= adapted, adapted
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_a_granite_moe_twins_real_step_measures_within_5pct_of_its_plan(checkpointing):
    """Granite 4.0-H's MoE sizes (the family's twin with 4 experts): its router, the grouped experts and the shared
    MLP beside them in every layer (core.estimate.granite_moe_terms)."""
    fields = dict(FAMILIES["granitemoehybrid"][0], num_local_experts=4)
    planned, measured = measure("granitemoehybrid", fields, 300, checkpointing)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


def test_all_linear_keeps_a_linear_subclass_whose_forward_returns_a_tensor_and_it_trains():
    """Falcon's FalconLinear (a matmul plus bias with a forward of its own) is a Linear peft trains: all-linear
    keeps every one of them (leaving them out left Falcon with no target at all), while Llama 4's router, whose
    forward returns scores and indices, stays out."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.recipe.peft_targets import all_linear

    torch.manual_seed(0)
    fields = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon", **fields))
    targets, notes = all_linear(model)
    assert targets == "all-linear" and notes == []
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    adapted = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"} <= adapted, adapted
    ids = torch.randint(0, 128, (1, 8))
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    llama4 = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama4_text", **LLAMA4))
    assert any("router (Llama4Router)" in note for note in all_linear(llama4)[1])
