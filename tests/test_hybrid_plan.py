"""Models the planner used to misread, planned from their config.json alone (`python -m core.estimate --model DIR`,
in this process): a hybrid decoder's Gated DeltaNet layers are planned as themselves (their measured figures:
tests/test_layer_plan.py), recurrences it does not model yet (RecurrentGemma's RG-LRU) with a warning; a LoRA rank above a narrow layer's width (Qwen3.5's in_proj_a/b under
all-linear) is planned, as peft trains it, not refused; 3-D parameters that are not experts (RecurrentGemma's
recurrent block) do not make a model a mixture of experts; per-layer widths (Gemma 3n) are refused in one sentence."""

import json

import pytest

from tests.test_estimate_cli import estimate_main

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)
CONFIGS = {
    # three Gated DeltaNet layers, then full attention (Qwen3.5's pattern); in_proj_a/b: hidden -> 4 value heads
    "qwen3_5_text": dict(
        TINY,
        num_hidden_layers=4,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "llama": dict(TINY, num_hidden_layers=2),
    # its recurrent block holds 3-D parameters of its own (the RG-LRU's per-head gates): no experts
    "recurrent_gemma": dict(
        TINY,
        num_hidden_layers=3,
        head_dim=16,
        lru_width=64,
        block_types=["recurrent", "recurrent", "attention"],
    ),
    # Gemma 3n gives its MLP widths per layer: refused in one sentence (it ended in a TypeError traceback)
    "gemma3n_text": dict(
        TINY,
        num_hidden_layers=2,
        intermediate_size=[128, 128],
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16,
    ),
}


def model_folder(tmp_path, model_type: str):
    from transformers import AutoConfig

    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **CONFIGS[model_type]).save_pretrained(folder)
    return folder


def plan(folder, *args) -> dict:
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", *args)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def test_a_hybrids_gated_deltanet_layers_are_planned_as_themselves_and_the_plan_names_their_path(tmp_path):
    folder = model_folder(tmp_path, "qwen3_5_text")
    out = plan(folder, "--lora-r", "4", "--no-gradient-checkpointing")
    assert not [w for w in out["warnings"] if "counts as attention" in w], out["warnings"]
    # on this machine (no CUDA, no flash-linear-attention) the torch path, said with its reason
    assert "Recurrent layers planned: gated deltanet on the torch path" in " ".join(out["warnings"])
    kernels = plan(folder, "--lora-r", "4", "--no-gradient-checkpointing", "--recurrent-kernels", "kernels")
    # a CUDA target with flash-linear-attention keeps less than transformers' torch code (CPU tests: no fla here)
    assert kernels["tensor_peak_bytes"] < out["tensor_peak_bytes"]
    assert "on its CUDA kernels (recurrent_kernels kernels)" in " ".join(kernels["warnings"])
    # a CPU run takes the torch path whatever the target machine's packages
    cpu = plan(folder, "--lora-r", "4", "--no-gradient-checkpointing", "--device", "cpu")
    cpu_kernels = plan(
        folder,
        "--lora-r",
        "4",
        "--no-gradient-checkpointing",
        "--device",
        "cpu",
        "--recurrent-kernels",
        "kernels",
    )
    assert cpu_kernels["tensor_peak_bytes"] == cpu["tensor_peak_bytes"]


def test_an_attention_only_model_gets_no_recurrence_warning(tmp_path):
    out = plan(model_folder(tmp_path, "llama"), "--lora-r", "4")
    assert not [w for w in out["warnings"] if "recurrence" in w or "full rank" in w], out["warnings"]


def test_a_rank_above_a_narrow_layers_width_is_planned_with_a_warning_as_peft_trains_it(tmp_path):
    folder = model_folder(tmp_path, "qwen3_5_text")
    out = plan(folder, "--lora-r", "8", "--target-modules", "all-linear")
    narrow = [w for w in out["warnings"] if "full rank" in w]
    assert len(narrow) == 1 and "linear_attn.in_proj_" in narrow[0] and "-> 4)" in narrow[0], out["warnings"]
    assert (
        out["trainable_params"]
        > plan(folder, "--lora-r", "4", "--target-modules", "all-linear")["trainable_params"]
    )


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "llama"])
def test_a_rank_no_layer_can_use_is_refused_in_one_sentence(tmp_path, model_type):
    proc = estimate_main("--model", str(model_folder(tmp_path, model_type)), "--lora-r", "4096")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "larger than every layer it adapts" in proc.stderr and "use r <=" in proc.stderr


def test_three_dimensional_parameters_that_are_not_experts_plan_as_a_dense_model(tmp_path):
    out = plan(model_folder(tmp_path, "recurrent_gemma"), "--lora-r", "4")
    assert out.get("moe") is None and out["trainable_params"] > 0
    # its RG-LRU layers are billed as themselves (core.estimate.rg_lru_terms), no longer as attention with a warning
    assert not any("mix tokens by a recurrence" in w for w in out["warnings"]), out["warnings"]
