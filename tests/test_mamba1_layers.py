"""Mamba-1 layers (Mamba, FalconMamba, Jamba, Zamba) and Zamba 2's nested hybrid layers planned as themselves
(core.estimate.mamba1_terms, core.estimate.layer_kinds): each layer read as the kind it is from the module tree, one
mixer's saved tensors equal to what autograd saves (saved_tensors_hooks on the real mixer under LoRA), a tiny
twin's real training step within 5% of its plan with gradient checkpointing on and off, and no plan warning that
a recurrence is not modelled."""

import json
import sys

import pytest
import torch

from core.estimate.layer_kinds import kinds_of, mlp_linear_names
from core.estimate.specs import load_spec
from tests.cli import REPO
from tests.test_estimate_cli import estimate_main

sys.path.insert(0, str(REPO / "benchmarks"))
from families_accuracy import FAMILIES, TINY, measure  # noqa: E402  (the benchmark's own twins and measurement)

TOLERANCE = 0.05
# Zamba 1: Mamba-1 mixers of two heads; its hybrid layers share one attention + MLP block (two hybrid layers: with
# one, transformers' weight tying of the shared block finds nothing to tie and refuses the model)
ZAMBA = dict(
    TINY,
    num_key_value_heads=4,
    num_hidden_layers=3,
    mamba_d_state=16,
    mamba_dt_rank=8,
    n_mamba_heads=2,
    layers_block_type=["linear_attention", "hybrid", "hybrid"],
)
TWINS = {**{k: FAMILIES[k][0] for k in ("mamba", "falcon_mamba", "jamba", "zamba2")}, "zamba": ZAMBA}


def saved_folder(tmp_path, model_type: str):
    from transformers import AutoConfig

    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **TWINS[model_type]).save_pretrained(folder)
    return folder


HYBRID_MAMBA1 = (("attention", "mamba"), "mlp")  # Zamba's shared block, then its Mamba layer


@pytest.mark.parametrize(
    "model_type, expected",
    [
        ("mamba", [(("mamba",), "none")] * 2),
        ("falcon_mamba", [(("mamba",), "none")] * 2),
        (
            "jamba",
            [(("mamba",), "mlp"), (("attention",), "mlp"), (("mamba",), "moe"), (("attention",), "mlp")],
        ),
        ("zamba", [(("mamba",), "none"), HYBRID_MAMBA1, HYBRID_MAMBA1]),
        ("zamba2", [(("mamba2",), "none")] + [(("attention", "mamba2"), "mlp")] * 2),
    ],
)
def test_each_layer_is_read_as_the_kind_it_is(tmp_path, model_type, expected):
    spec = load_spec(str(saved_folder(tmp_path, model_type)))
    assert list(kinds_of(spec)) == expected
    if model_type == "jamba":  # the MLP is the feed-forward's Linears, not the mixer's in_proj / out_proj
        names = mlp_linear_names(spec.decoder_linears, spec.hidden_size)
        assert names == ("gate_proj", "up_proj", "down_proj")


def _mixer_saved_bytes(model_type: str, dtype, autocast: bool, seq: int) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward of the first Mamba-1 mixer of the
    real model, LoRA r 8 on all-linear as the engine puts it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.recipe.peft_targets import all_linear

    cfg = AutoConfig.for_model(model_type, **TWINS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=all_linear(model)[0])
    model = get_peft_model(model, lora).train()
    mixer = next(m for m in model.modules() if type(m).__name__.endswith("MambaMixer"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, keep = {}, []

    def pack(t):
        keep.append(t)  # every saved tensor stays alive while counting: no address is reused
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(1, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        mixer(x)
    return sum(seen.values())


def _planned_mixer_bytes(folder, load: str, autocast: bool, seq: int) -> float:
    from core.estimate.activation_terms import LayerTerms, mixer_saved
    from core.estimate.plan import Plan
    from core.estimate.specs import lora_targets

    plan = Plan(
        model=str(folder),
        load_dtype=load,
        compute_dtype="fp32" if load == "fp32" else "bf16",
        autocast=autocast,
        device="cpu",
        seq_len=seq,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
    )
    t = LayerTerms(load_spec(str(folder)), plan, lora_targets(str(folder), "all-linear"))
    mixer_saved(t, "mamba")
    return sum(t.saved.values()) * seq


@pytest.mark.parametrize("mode", ["bf16", "fp32", "bf16-autocast"])
@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba", "zamba"])
def test_a_mamba1_mixer_saves_what_autograd_saves(tmp_path, model_type, mode):
    """The whole loop over time included (one saved state per step). Under autocast the matmuls also save 16-bit
    copies of the fp32 LoRA weights, once per layer (core.estimate.autocast_terms bills them): the mixer's saved
    bytes are compared between two sequence lengths, where the copies cancel and every per-token term stays."""
    folder = saved_folder(tmp_path, model_type)
    load, dtype = ("fp32", torch.float32) if mode == "fp32" else ("bf16", torch.bfloat16)
    autocast = mode.endswith("autocast")
    if not autocast:
        for seq in (12, 20):
            assert _mixer_saved_bytes(model_type, dtype, False, seq) == _planned_mixer_bytes(
                folder, load, False, seq
            )
        return
    measured = _mixer_saved_bytes(model_type, dtype, True, 20) - _mixer_saved_bytes(
        model_type, dtype, True, 12
    )
    planned = _planned_mixer_bytes(folder, load, True, 20) - _planned_mixer_bytes(folder, load, True, 12)
    assert measured == pytest.approx(planned, abs=1e-6)


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba", "zamba", "zamba2"])
def test_the_plan_models_the_recurrence_and_names_its_path(tmp_path, model_type):
    folder = saved_folder(tmp_path, model_type)
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", "--lora-r", "4")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    warnings = json.loads(proc.stdout)["warnings"]
    assert not [w for w in warnings if "not model yet" in w], warnings
    kind = "mamba2" if model_type == "zamba2" else "mamba"
    assert f"Recurrent layers planned: {kind} on the torch path" in " ".join(warnings), warnings


def test_the_kernel_path_keeps_less_than_the_torch_loop(tmp_path):
    """mamba_ssm's scan keeps one state per 2048 tokens where the torch loop keeps one per token (modelled from
    the Functions' ctx.save_for_backward, not measured: no CUDA here)."""
    folder = saved_folder(tmp_path, "falcon_mamba")
    args = ("--model", str(folder), "--json", "--lora-r", "4", "--no-gradient-checkpointing")
    torch_path = json.loads(estimate_main(*args, "--recurrent-kernels", "torch").stdout)
    kernels = json.loads(estimate_main(*args, "--recurrent-kernels", "kernels").stdout)
    assert kernels["tensor_peak_bytes"] < 0.75 * torch_path["tensor_peak_bytes"]
    assert "mamba on its CUDA kernels" in " ".join(kernels["warnings"])


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba", "zamba2"])
def test_a_mamba1_twins_real_step_measures_within_5pct_of_its_plan(model_type, checkpointing):
    planned, measured = measure(model_type, FAMILIES[model_type][0], 300, checkpointing)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)
