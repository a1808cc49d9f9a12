"""Linear attention and the other recurrences planned as themselves (core.estimate.kda_terms, lightning_terms,
rg_lru_terms, rwkv_terms, mlstm_terms): Kimi Linear's and Bailing hybrid's Kimi Delta Attention, MiniMax's lightning
attention, RecurrentGemma's RG-LRU block, RWKV's time and channel mix, xLSTM's mLSTM layer. Each family's layers are
read as the kinds they are (RWKV's used to read as attention + MLP and xLSTM's as an MLP alone, both silently); each
mixer's saved tensors equal autograd's, byte for byte, on a tiny real model under bf16 autocast and in fp32, at a
length of several chunks with a remainder and at one shorter than a chunk; a tiny twin's real training step
measures within 5% of its plan with gradient checkpointing on and off; and the plans no longer warn that a
recurrence is not modelled."""

import gc
import json
import sys
import weakref

import pytest

from core.estimate.layer_kinds import kinds_of
from core.estimate.specs import load_spec
from tests.cli import REPO
from tests.test_estimate_cli import estimate_main

sys.path.insert(0, str(REPO / "benchmarks"))
from families_accuracy import FAMILIES, measure  # noqa: E402  (the benchmark's own twins and measurement)

TOLERANCE = 0.05
TYPES = ("kimi_linear", "bailing_hybrid", "minimax", "recurrent_gemma", "rwkv", "xlstm")


def saved_folder(tmp_path, model_type: str, fields: dict):
    from transformers import AutoConfig

    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "model_type, expected",
    [
        ("kimi_linear", [(("kda",), "mlp"), (("attention",), "mlp")]),
        ("bailing_hybrid", [(("kda",), "mlp"), (("attention",), "mlp")]),
        ("minimax", [(("lightning_attention",), "moe"), (("attention",), "moe")]),
        ("recurrent_gemma", [(("rg_lru",), "mlp"), (("attention",), "mlp")]),
        # its channel mix shifts in the previous token too, and is no SwiGLU: a mixer of its own, no MLP
        ("rwkv", [(("rwkv", "rwkv_channel_mix"), "none")] * 2),
        ("xlstm", [(("mlstm",), "mlp")] * 2),
    ],
)
def test_each_layer_is_read_as_the_kind_it_is(tmp_path, model_type, expected):
    spec = load_spec(str(saved_folder(tmp_path, model_type, FAMILIES[model_type][0])))
    assert list(kinds_of(spec)) == expected


def test_a_block_whose_mixer_is_not_read_is_an_unmodelled_kind_not_an_mlp_layer(monkeypatch):
    """xLSTM's block before its mLSTM layer was read: an unread mixer beside the FFN (planned as attention, with
    the warning), where it used to be an MLP-only layer that mixes nothing; Nemotron-H's MLP blocks stay MLPs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.estimate import layer_kinds

    models = {
        t: AutoModelForCausalLM.from_config(AutoConfig.for_model(t, **FAMILIES[t][0]))
        for t in ("xlstm", "nemotron_h")
    }
    reading = tuple(row for row in layer_kinds._MIXER_CLASSES if row[1] != "mlstm")
    monkeypatch.setattr(layer_kinds, "_MIXER_CLASSES", reading)
    assert layer_kinds.layer_kind(models["xlstm"].backbone.blocks[0]) == (("unread_mixer",), "mlp")
    nemotron = [layer_kinds.layer_kind(layer) for layer in models["nemotron_h"].model.layers]
    assert nemotron[3] == ((), "mlp"), nemotron  # "M*M-": its fourth block is an MLP alone


# ---- each mixer's saved tensors against autograd's -------------------------------------------------------------

# type -> (the modules whose forward makes the mixer's saved tensors, the kinds planned for them, the layer)
MIXER_MODULES = {
    "kimi_linear": (("self_attn",), ("kda",), 0),
    "bailing_hybrid": (("self_attn",), ("kda",), 0),
    "minimax": (("self_attn",), ("lightning_attention",), 0),
    "recurrent_gemma": (("temporal_block",), ("rg_lru",), 0),
    "rwkv": (("ln1", "attention", "ln2", "feed_forward"), ("rwkv", "rwkv_channel_mix"), 1),
    "xlstm": (("mlstm_layer",), ("mlstm",), 1),
}


def _autocast_weight_copy(x) -> bool:
    """autocast's cached 16-bit copy of a trainable weight (the planner counts it with the weights)."""
    fn = (x._base if x._base is not None else x).grad_fn
    return (
        fn is not None
        and type(fn).__name__ == "ToCopyBackward0"
        and any(n is not None and type(n).__name__ == "AccumulateGrad" for n, _ in fn.next_functions)
    )


def _autograd_saved(model_type: str, fields: dict, seq: int, mode: str) -> int:
    """Bytes of the distinct non-parameter storages that autograd saved inside the mixer's modules and still holds
    once forward returns (what a discarded state update saved is freed), on the real tiny model with LoRA on
    all-linear (r 8, fp32 adapters)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    names, _, index = MIXER_MODULES[model_type]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **fields)
    model = AutoModelForCausalLM.from_config(cfg)
    if mode != "fp32":
        model = model.to(torch.bfloat16)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    )
    model.train()
    layers = next(
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == cfg.num_hidden_layers
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    refs, inside = [], [False]

    def pack(x):
        if inside[0] and x.untyped_storage().data_ptr() not in params and not _autocast_weight_copy(x):
            x = x.detach()  # held by the graph alone (a saved output would otherwise keep itself alive)
            refs.append(weakref.ref(x))
        return x

    for name in names:
        module = getattr(layers[index], name)
        module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        module.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(3, cfg.vocab_size, (1, seq))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"),
    ):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    gc.collect()
    alive = {
        x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for r in refs if (x := r()) is not None
    }
    del out
    return sum(alive.values())


def _planned_saved(tmp_path, model_type: str, fields: dict, seq: int, mode: str) -> float:
    from core.estimate.activation_terms import LayerTerms, mixer_facts
    from core.estimate.mixer_terms import MIXERS
    from core.estimate.plan import Plan
    from core.estimate.specs import lora_targets, normalize_targets

    folder = saved_folder(tmp_path, model_type, fields)
    dtype = "fp32" if mode == "fp32" else "bf16"
    plan = Plan(
        model=str(folder),
        device="cpu",
        seq_len=seq,
        batch_size=1,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        load_dtype=dtype,
        compute_dtype=dtype,
        autocast=mode == "bf16",
    )
    spec = load_spec(str(folder))
    t = LayerTerms(spec, plan, lora_targets(str(folder), normalize_targets("all-linear"), ""))
    for kind in MIXER_MODULES[model_type][1]:
        MIXERS[kind].saved(t, mixer_facts(spec, kind), False)
    return sum(t.saved.values()) * seq


@pytest.mark.parametrize("mode", ["bf16", "fp32"], ids=["bf16-autocast", "fp32"])
@pytest.mark.parametrize("seq", [300, 40], ids=["chunks-and-rest", "short"])
@pytest.mark.parametrize("model_type", TYPES)
def test_a_mixers_saved_tensors_equal_autograds(tmp_path, model_type, seq, mode):
    """300 tokens: KDA's 5 chunks (the last padded), MiniMax's 5 blocks, xLSTM's 4 chunks and 44 one-token
    steps; 40: one padded chunk, one block, steps alone."""
    fields = FAMILIES[model_type][0]
    measured = _autograd_saved(model_type, fields, seq, mode)
    planned = _planned_saved(tmp_path, model_type, fields, seq, mode)
    assert abs(planned - measured) < 1, (planned, measured)


# ---- the whole step ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
@pytest.mark.parametrize("model_type", TYPES)
def test_a_twins_real_step_measures_within_5pct_of_its_plan(model_type, checkpointing):
    planned, measured = measure(model_type, FAMILIES[model_type][0], 300, checkpointing)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


@pytest.mark.parametrize("model_type", TYPES)
def test_the_plan_no_longer_says_a_recurrence_is_not_modelled(tmp_path, model_type):
    folder = saved_folder(tmp_path, model_type, FAMILIES[model_type][0])
    proc = estimate_main("--model", str(folder), "--json", "--lora-r", "4", "--no-gradient-checkpointing")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    warnings = json.loads(proc.stdout)["warnings"]
    assert not [w for w in warnings if "does not model yet" in w], warnings


@pytest.mark.parametrize(
    "model_type, kernels", [("kimi_linear", "kda"), ("rwkv", "rwkv"), ("minimax", None), ("xlstm", None)]
)
def test_a_cuda_target_plans_the_kernels_only_where_transformers_has_them(tmp_path, model_type, kernels):
    """fla's chunk_kda and RWKV's compiled WKV kernel keep less than the torch loops (modelled, not measured);
    lightning attention, the RG-LRU and the mLSTM have one path in transformers: a kernel target changes nothing
    and the plan claims no kernel for them."""
    folder = saved_folder(tmp_path, model_type, FAMILIES[model_type][0])
    args = (
        "--model",
        str(folder),
        "--json",
        "--lora-r",
        "4",
        "--no-gradient-checkpointing",
        "--device",
        "cuda",
    )
    torch_path = json.loads(estimate_main(*args, "--recurrent-kernels", "torch").stdout)
    kernel_path = json.loads(estimate_main(*args, "--recurrent-kernels", "kernels").stdout)
    said = " ".join(kernel_path["warnings"])
    if kernels:
        assert kernel_path["tensor_peak_bytes"] < torch_path["tensor_peak_bytes"]
        assert f"{kernels} on its CUDA kernels" in said, said
    else:
        assert kernel_path["tensor_peak_bytes"] == torch_path["tensor_peak_bytes"]
        assert "CUDA kernels" not in said, said
