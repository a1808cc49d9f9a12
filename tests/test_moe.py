"""Mixture-of-experts planning (issue #36) against the real libraries on tiny models built from configs: the saved
activations of a MoE layer against autograd's, LoRA on the experts against peft's own count, the experts' dtype
under bitsandbytes 4-bit against the real storage, every MoE family transformers builds planned (or refused in
one sentence), and the MoE levers re-estimated."""

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from core.demo.toy import tiny_config
from core.estimate.bill import estimate
from core.estimate.moe import moe_of
from core.estimate.moe_terms import layer_kinds, moe_layer
from core.estimate.plan import Plan
from core.estimate.specs import SpecError, load_spec, lora_targets, normalize_targets
from tests.saved import saved_storage_bytes

ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = {
    "attention": dict(target_modules=ATTENTION),
    "experts": dict(target_modules=ATTENTION, target_parameters=EXPERTS),
    "all-linear": dict(
        target_modules="all-linear"
    ),  # peft adds the experts and the router itself (Qwen, Mixtral)
}


def _config_folder(tmp_path, arch: str, layers: int = 2, **overrides):
    cfg = tiny_config(arch, num_hidden_layers=layers, **overrides)
    folder = tmp_path / f"{arch}-{layers}"
    cfg.save_pretrained(folder)
    return cfg, folder


def _plan(folder, lora: dict, dtype: str = "bf16", **kw) -> Plan:
    modules = lora["target_modules"]
    kw = {"seq_len": 32, **kw}
    return Plan(
        model=str(folder),
        load_dtype=dtype,
        compute_dtype=dtype,
        autocast=False,
        device="cpu",
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=modules if isinstance(modules, str) else ",".join(modules),
        target_parameters=",".join(lora.get("target_parameters", [])),
        **kw,
    )


def _saved_bytes(cfg, dtype, lora: dict) -> int:
    """Bytes of distinct non-parameter storages autograd saves in one forward (router logits asked, as TRL asks)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **lora))
    model.train()
    ids = torch.randint(3, 100, (2, 32))
    return saved_storage_bytes(model, lambda: model(input_ids=ids, output_router_logits=True))


@pytest.mark.parametrize("mode", list(LORA))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_moe_layer_saves_what_autograd_saves(tmp_path, arch, dtype, mode):
    """One middle layer (3 layers minus 2) of the real model against the plan's MoE layer: the router, the routed
    pairs through the grouped experts, peft's merged expert copies, the load-balancing loss's softmax."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    cfg3, _ = _config_folder(tmp_path, arch, 3)
    cfg2, folder = _config_folder(tmp_path, arch, 2)
    measured = _saved_bytes(cfg3, torch_dtype, LORA[mode]) - _saved_bytes(cfg2, torch_dtype, LORA[mode])
    spec = load_spec(str(folder))
    plan = _plan(folder, LORA[mode], dtype, attn="sdpa" if spec.sdpa else "eager")  # gpt-oss: no sdpa
    targets = lora_targets(str(folder), normalize_targets(plan.target_modules), plan.target_parameters)
    facts = moe_of(spec)
    tokens = 2 * 32
    planned = (
        layer_kinds(spec, facts, plan, targets, tokens)["moe"]
        + moe_layer(spec, facts, plan, targets, tokens).outside
    )
    assert planned == measured


# Llama 4: every token through every expert (one bmm per projection over the repeated hidden states), a sigmoid
# router, a shared expert; all-linear leaves its router out (peft cannot wrap it: the engine's LoraConfig excludes it)
LLAMA4 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    intermediate_size_mlp=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
)
LLAMA4_EXPERTS = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
LLAMA4_LORA = {
    "attention": dict(target_modules=ATTENTION),
    "experts": dict(target_modules=ATTENTION, target_parameters=LLAMA4_EXPERTS),
    "all-linear": dict(target_modules="all-linear", exclude_modules=["router"]),
}


@pytest.mark.parametrize("mode", list(LLAMA4_LORA))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_llama4_moe_layer_saves_what_autograd_saves(tmp_path, dtype, mode):
    """Llama 4's own experts forward (core.estimate.llama4_moe_terms), one middle layer against autograd. Its model
    computes no load-balancing loss (TRL's fused head does, from the router logits): no `outside` here."""
    from transformers import AutoConfig

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    lora = LLAMA4_LORA[mode]
    cfgs = {n: AutoConfig.for_model("llama4_text", **LLAMA4, num_hidden_layers=n) for n in (2, 3)}
    measured = _saved_bytes(cfgs[3], torch_dtype, lora) - _saved_bytes(cfgs[2], torch_dtype, lora)
    cfgs[2].save_pretrained(tmp_path)
    spec, plan = load_spec(str(tmp_path)), _plan(tmp_path, lora, dtype)
    targets = lora_targets(str(tmp_path), normalize_targets(plan.target_modules), plan.target_parameters)
    facts = moe_of(spec)
    assert facts.implementation == "repeat_bmm" and facts.router == "sigmoid_topk" and facts.shared_width
    assert layer_kinds(spec, facts, plan, targets, 64)["moe"] == measured


# shared experts (Qwen2-MoE: with its sigmoid gate), sigmoid routing over expert groups (GLM-4 MoE); GLM's fp32
# attention keeps one more copy of its output than LLaMA-style attention (a dense-attention term, not planned yet)
SHARED = {
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96
    ),
    "glm4_moe": dict(
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        head_dim=16,
    ),
}


@pytest.mark.parametrize("mode", list(LORA))
@pytest.mark.parametrize("arch,dtype", [("qwen2_moe", "fp32"), ("qwen2_moe", "bf16"), ("glm4_moe", "bf16")])
def test_shared_experts_and_group_routing_save_what_autograd_saves(tmp_path, arch, dtype, mode):
    from transformers import AutoConfig

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    fields = dict(
        vocab_size=102, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    cfgs = {n: AutoConfig.for_model(arch, **fields, num_hidden_layers=n, **SHARED[arch]) for n in (2, 3)}
    measured = _saved_bytes(cfgs[3], torch_dtype, LORA[mode]) - _saved_bytes(cfgs[2], torch_dtype, LORA[mode])
    cfgs[2].save_pretrained(tmp_path)
    spec, plan = load_spec(str(tmp_path)), _plan(tmp_path, LORA[mode], dtype)
    targets = lora_targets(str(tmp_path), normalize_targets(plan.target_modules), plan.target_parameters)
    facts = moe_of(spec)
    assert facts.shared_width and (facts.router == "sigmoid_group") == (arch == "glm4_moe")
    planned = (
        layer_kinds(spec, facts, plan, targets, 64)["moe"] + moe_layer(spec, facts, plan, targets, 64).outside
    )
    assert planned == measured


@pytest.mark.parametrize(
    "arch,mode",
    [
        ("qwen3_moe", "all-linear"),
        ("qwen3_moe", "experts"),
        ("mixtral", "all-linear"),
        ("gpt_oss", "experts"),
    ],
)
def test_lora_on_the_experts_counts_what_peft_counts(tmp_path, arch, mode):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg, folder = _config_folder(tmp_path, arch)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, lora_alpha=8, **LORA[mode]))
    trainable, _ = model.get_nb_trainable_parameters()
    est = estimate(_plan(folder, LORA[mode]))
    assert est.trainable_params == trainable
    assert est.moe["expert_trainable_params"] > 0  # the experts are among them (peft's conversion or asked)


def test_all_linear_on_gpt_oss_leaves_the_experts_and_the_plan_says_how_to_target_them(tmp_path):
    _, folder = _config_folder(tmp_path, "gpt_oss")
    est = estimate(_plan(folder, LORA["all-linear"], attn="eager"))
    assert est.moe["lora_on"] == [] and est.moe["expert_trainable_params"] == 0
    from core.estimate.moe_terms import moe_lines

    assert "target_parameters" in "\n".join(moe_lines(est))


def _storage_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        qs = getattr(p, "quant_state", None)
        for t in (getattr(qs, "absmax", None), getattr(qs, "code", None), getattr(qs, "offset", None)):
            if torch.is_tensor(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        state2 = getattr(qs, "state2", None)
        for t in (getattr(state2, "absmax", None), getattr(state2, "code", None)):
            if torch.is_tensor(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_qlora_leaves_the_fused_experts_in_bf16_as_planned(tmp_path):
    """bitsandbytes 4-bit on the real tiny Qwen3-MoE: the attention Linears are packed 4-bit, the fused experts and
    the router stay bf16, and the bytes are the plan's weights + quantization constants."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from core.demo.toy import build_tiny_model

    path = build_tiny_model(
        tmp_path / "m", "qwen3_moe", tokenizer=False, hidden_size=128, moe_intermediate_size=96
    )
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=quant, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.down_proj.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.uint8  # packed 4-bit
    plan = Plan(
        model=str(path), tuning="qlora", load_dtype="bf16", double_quant=False, seq_len=16, device="cpu"
    )
    est = estimate(plan)
    assert est.components["weights"] + est.components["quant_constants"] == _storage_bytes(model)
    assert est.moe["expert_dtype"] == "bf16" and "nn.Linear" in est.moe["expert_dtype_reason"]


# the families the issue names, two layers each (the first dense where the family has dense layers), and two the
# planner cannot model: a family whose experts run their own forward, and a default config transformers itself
# cannot build
FAMILIES = {
    "qwen2_moe": {},
    "qwen3_moe": {},
    "mixtral": {},
    "gpt_oss": {"layer_types": ["sliding_attention", "full_attention"]},
    "olmoe": {},
    "deepseek_v2": {"num_experts_per_tok": 6, "first_k_dense_replace": 1},
    "deepseek_v3": {"first_k_dense_replace": 1},
    "glm4_moe": {"first_k_dense_replace": 1},
    "glm4_moe_lite": {"first_k_dense_replace": 1},
    "llama4_text": {},  # its own experts forward (core.estimate.llama4_moe_terms)
    "granitemoehybrid": {},  # its router and shared MLP (core.estimate.granite_moe_terms)
}


def _cli(args) -> tuple[int, str]:
    from core.estimate.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue() + err.getvalue()


def _default_config_folder(tmp_path, model_type: str, **fields):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = CONFIG_MAPPING[model_type]().to_dict()
    data.update(model_type=model_type, num_hidden_layers=2, **fields)
    if isinstance(data.get("layer_types"), list):  # per-layer lists follow the depth
        data["layer_types"] = data["layer_types"][:2]
    for key in ("transformers_version", "architectures"):
        data.pop(key, None)
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_moe_family_prints_a_plan_naming_its_experts_and_their_dtype(tmp_path, model_type):
    folder = _default_config_folder(tmp_path, model_type, **FAMILIES[model_type])
    rc, out = _cli(["--model", str(folder), "--tuning", "qlora", "--seq-len", "512"])
    assert rc == 0, out
    assert "Traceback" not in out
    assert "mixture of experts:" in out and "routed tokens:" in out
    # the experts' dtype and why: bitsandbytes leaves the fused experts out of 4-bit
    assert "expert weights:" in out and "in bf16: bitsandbytes 4-bit quantizes nn.Linear layers only" in out
    if FAMILIES[model_type].get("first_k_dense_replace"):
        assert "(+1 dense)" in out


@pytest.mark.parametrize(
    "model_type,fields,why",
    [
        ("hunyuan_v1_moe", {}, "transformers cannot build"),  # its default config leaves head_dim None
        ("deepseek_v2", {}, "num_experts_per_tok"),  # the default config leaves it None
    ],
)
def test_a_moe_family_the_planner_cannot_model_gets_one_sentence(tmp_path, model_type, fields, why):
    folder = _default_config_folder(tmp_path, model_type, **fields)
    rc, out = _cli(["--model", str(folder)])
    assert rc == 2 and why in out and "Traceback" not in out
    assert len([line for line in out.splitlines() if line.startswith("error:")]) == 1
    with pytest.raises(SpecError, match=why):
        load_spec(str(folder))


def test_the_moe_levers_are_real_re_estimates_with_their_costs(tmp_path):
    from core.estimate.levers import lever_savings, what_would_fit

    _, folder = _config_folder(tmp_path, "qwen3_moe", hidden_size=128, moe_intermediate_size=256)
    plan = _plan(folder, LORA["experts"], tuning="qlora", gpu_gb=0.001, seq_len=64)
    base = estimate(plan)
    advice = {a["change"]: a for a in what_would_fit(plan)}
    frozen = next(a for label, a in advice.items() if label.startswith("LoRA without the experts"))
    quantized = next(a for label, a in advice.items() if "quantized" in label)
    for a in (frozen, quantized):
        again = estimate(dataclasses.replace(plan, **a["settings"]))
        assert a["saves_bytes"] == base.device_total_bytes - again.device_total_bytes > 0
        assert not a["keeps_training"] and not a["combined"]
    assert "not in this engine" in quantized["costs"] and "Train form cannot set it" in quantized["costs"]
    assert frozen["settings"]["target_parameters"] == ""
    rows = {r["lever"]: r for r in lever_savings(plan)}
    assert rows["experts_frozen"]["saves_bytes"] == frozen["saves_bytes"] and not rows["experts_frozen"]["on"]
    assert rows["quantize_experts"]["saves_bytes"] == quantized["saves_bytes"]
    # quantized on load, the experts are 4-bit: less than a third of their bf16 bytes
    q = estimate(dataclasses.replace(plan, quantize_experts=True))
    assert (
        q.moe["expert_dtype"] == "nf4" and q.moe["expert_weight_bytes"] < base.moe["expert_weight_bytes"] / 3
    )


def test_lora_dropout_on_the_experts_is_refused_before_loading(tmp_path):
    """peft's ParamWrapper refuses dropout; "all-linear" brings the experts in on the Qwen-MoE family."""
    from core.recipe.engine_args import lora_dropout_problem

    cfg = {"lora": {"enabled": True, "lora_dropout": 0.05, "target_modules": "all-linear"}}
    assert "lora.lora_dropout must be 0" in lora_dropout_problem(cfg, tiny_config("qwen3_moe"))
    assert lora_dropout_problem(cfg, tiny_config("llama")) is None
    assert lora_dropout_problem(cfg, tiny_config("gpt_oss")) is None  # all-linear leaves gpt-oss's experts
    asked = {"lora": {**cfg["lora"], "target_modules": ATTENTION, "target_parameters": EXPERTS}}
    assert "target_parameters" in lora_dropout_problem(asked, tiny_config("gpt_oss"))
    assert (
        lora_dropout_problem({"lora": {**cfg["lora"], "lora_dropout": 0.0}}, tiny_config("qwen3_moe")) is None
    )


def test_gguf_export_of_a_moe_model_says_it_cannot_yet_in_one_sentence(tmp_path):
    """core.gguf writes dense Llama, Mistral and Qwen2: a MoE folder is refused before a byte is written, with the
    way that does exist (llama.cpp's own converter)."""
    import subprocess
    import sys

    from core.demo.toy import build_tiny_model
    from tests.conftest import REPO

    model = build_tiny_model(tmp_path / "m", "qwen3_moe")
    out = tmp_path / "m.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "core.gguf", "--model", str(model), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and not out.exists()
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and "mixture-of-experts model" in errors[0] and "convert_hf_to_gguf.py" in errors[0]
    )


# Granite 4.0-H: a router casting its logits to fp32 (top-k, softmax over k), the grouped experts, and the shared
# MLP beside the block in every layer (core.estimate.granite_moe_terms); attention layers only, Mamba has its own tests
GRANITE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    shared_intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
)
GRANITE_EXPERTS = ["block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"]
GRANITE_LORA = {
    "attention": dict(target_modules=ATTENTION),
    "experts": dict(target_modules=ATTENTION, target_parameters=GRANITE_EXPERTS),
    "all-linear": dict(target_modules="all-linear"),
}


@pytest.mark.parametrize("mode", list(GRANITE_LORA))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_granite_moe_layer_saves_what_autograd_saves(tmp_path, dtype, mode):
    """One middle layer of Granite 4.0-H against autograd: its router, the routed pairs, the shared MLP, and the
    load-balancing loss's softmax of the fp32 logits."""
    from transformers import AutoConfig

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    lora = GRANITE_LORA[mode]
    cfgs = {
        n: AutoConfig.for_model(
            "granitemoehybrid", **GRANITE, num_hidden_layers=n, layer_types=["attention"] * n
        )
        for n in (2, 3)
    }
    measured = _saved_bytes(cfgs[3], torch_dtype, lora) - _saved_bytes(cfgs[2], torch_dtype, lora)
    cfgs[2].save_pretrained(tmp_path)
    spec, plan = load_spec(str(tmp_path)), _plan(tmp_path, lora, dtype)
    targets = lora_targets(str(tmp_path), normalize_targets(plan.target_modules), plan.target_parameters)
    facts = moe_of(spec)
    assert facts.router == "fp32_topk_softmax" and facts.shared_width == 96 and not facts.unsupported
    planned = (
        layer_kinds(spec, facts, plan, targets, 64)["moe"] + moe_layer(spec, facts, plan, targets, 64).outside
    )
    assert planned == measured
