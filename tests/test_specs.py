"""Model specs: exact counts from the real module tree, checked against real tiny models and real peft/bnb."""

import json

import pytest
import torch

from core.estimate.bill import Plan, kv_cache_bytes_per_token, weight_bytes
from core.estimate.specs import (
    SpecError,
    load_spec,
    lora_param_count,
    lora_targets,
    normalize_targets,
    preset_ids,
)


def _real_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


def test_at_least_twelve_presets_and_each_builds_on_meta():
    ids = preset_ids()
    assert len(ids) >= 12
    for model_id in (
        "meta-llama/Llama-2-7b-hf",
        "Qwen/Qwen2.5-7B",
        "google/gemma-2-9b",
        "mistralai/Mistral-7B-v0.1",
    ):
        assert model_id in ids
    # published parameter counts of well-known models (from their model cards, not from this code)
    assert load_spec("meta-llama/Llama-2-7b-hf").total_params == 6_738_415_616
    assert load_spec("TinyLlama/TinyLlama-1.1B-Chat-v1.0").total_params == 1_100_048_384
    assert round(load_spec("Qwen/Qwen2.5-7B").total_params / 1e9, 2) == 7.62


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama_tied", "tiny_gpt2"])
def test_total_params_equal_a_real_instantiation(fixture, request):
    path = request.getfixturevalue(fixture)
    real = _real_model(path)
    spec = load_spec(str(path))
    assert spec.total_params == sum(p.numel() for p in real.parameters())
    tied = real.get_output_embeddings().weight is real.get_input_embeddings().weight
    assert spec.tie_word_embeddings == tied


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "gate_proj,up_proj,down_proj", "o_proj"])
@pytest.mark.parametrize("r", [1, 8, 32])
def test_lora_trainable_params_equal_peft_count(tiny_llama, targets, r):
    from peft import LoraConfig, get_peft_model

    model = _real_model(tiny_llama)
    wanted = targets if targets == "all-linear" else targets.split(",")
    peft_model = get_peft_model(model, LoraConfig(r=r, target_modules=wanted))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert lora_param_count(str(tiny_llama), targets, r) == trainable


def test_lora_targets_carry_layer_shapes(tiny_llama):
    shapes = lora_targets(str(tiny_llama), normalize_targets("q_proj,k_proj"))
    cfg = json.loads((tiny_llama / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    k = [s for s in shapes if s.name.endswith("k_proj")]
    assert len(k) == cfg["num_hidden_layers"]
    assert (k[0].in_features, k[0].out_features) == (
        cfg["hidden_size"],
        cfg["num_key_value_heads"] * head_dim,
    )


def _bnb_storage_bytes(model) -> int:
    """Bytes of every distinct storage held by parameters and 4-bit quant states."""
    seen = {}

    def add(t):
        if torch.is_tensor(t):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            for t in (qs.absmax, qs.code, qs.offset):
                add(t)
            if qs.state2 is not None:
                add(qs.state2.absmax)
                add(qs.state2.code)
    return sum(seen.values())


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_bytes_equal_bitsandbytes_real_storage(tmp_path, double_quant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from core.demo.toy import build_tiny_model

    # widths with blocks that do not divide evenly into 256-block groups, to exercise the rounding
    path = build_tiny_model(tmp_path / "m", "llama", hidden_size=192, intermediate_size=520, tokenizer=False)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=quant, dtype=torch.bfloat16)
    real = _bnb_storage_bytes(model)
    plan = Plan(
        model=str(path), method="qlora", load_dtype="bf16", double_quant=double_quant, prepare_kbit=False
    )
    weights, constants = weight_bytes(load_spec(str(path)), plan)
    assert weights + constants == real


def test_kv_cache_per_token_llama2_7b_bf16():
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    assert kv_cache_bytes_per_token(spec, Plan(compute_dtype="bf16")) == 524288


def test_unknown_model_id_says_how_to_fix():
    with pytest.raises(SpecError, match="preset id"):
        load_spec("nobody/no-such-model-xyz")


def test_folder_without_config_json(tmp_path):
    with pytest.raises(SpecError, match="no config.json"):
        load_spec(str(tmp_path))


def test_config_that_is_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    with pytest.raises(SpecError, match="not a causal language model"):
        load_spec(str(tmp_path))


def test_target_modules_that_match_nothing(tiny_llama):
    with pytest.raises(SpecError, match="match no layer"):
        lora_targets(str(tiny_llama), normalize_targets("no_such_proj"))
