"""Multi-head latent attention (core.estimate.mla_terms) planned as it runs: a tiny DeepSeek-V3 twin (v_head_dim below
the qk head dim: sdpa's math path on the CPU) and a tiny GLM-4.7-Flash twin (glm4_moe_lite, equal head dims: sdpa's
flash kernel). One real attention module's saved tensors (autograd's saved_tensors_hooks) equal the plan's, a real
LoRA step measures within 5% of the plan with and without gradient checkpointing, and the KV cache per token is
what transformers' DynamicCache holds after a forward (the compressed latent and k_pe, not per-head K and V)."""

import sys
import tempfile
from dataclasses import replace

import pytest

from core.estimate.plan import Plan
from core.estimate.specs import load_spec, lora_targets
from tests.cli import REPO
from tests.test_estimate_cli import estimate_main

sys.path.insert(0, str(REPO / "benchmarks"))
from families_accuracy import FAMILIES, measure  # noqa: E402  (the benchmark's own twins and measurement)

TOLERANCE = 0.05
TOKENS = 97  # the saved-tensor check: a token count no weight shape has (prime)


def saved_folder(tmp_path, model_type: str, fields: dict):
    from transformers import AutoConfig

    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    return folder


def autograd_saved(folder, plan: Plan) -> tuple[dict[str, int], int]:
    """({module path: bytes}, total bytes) per token that the last layer's attention module leaves saved for
    backward in the model a run of `plan` trains (core.measure.build, the engine's own), counted by storage once.
    Left out: tensors without the token dimension (weights, their autocast copies) and rope's cos / sin, which the
    model computes once for every layer and which need no grad."""
    import torch
    from transformers import AutoConfig

    from core.measure.build import build_model
    from core.measure.step_plan import autocast_dtype

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build_model(AutoConfig.from_pretrained(folder), plan, tmp)
    model.train()
    attn = model.get_decoder().layers[-1].self_attn
    state = {"active": False, "where": "", "shared": set()}
    by_module: dict[str, int] = {}
    seen: set[int] = set()

    def enter(_mod, _args, kwargs):
        state["active"] = True
        rope = kwargs.get("position_embeddings")  # (cos, sin); DeepSeek-V2's one complex freqs_cis
        rope = rope if isinstance(rope, (tuple, list)) else () if rope is None else (rope,)
        state["shared"] = {t.untyped_storage().data_ptr() for t in rope}

    def leave(*_):
        state["active"] = False

    attn.register_forward_pre_hook(enter, with_kwargs=True)
    attn.register_forward_hook(leave)
    for name, mod in attn.named_modules():
        mod.register_forward_pre_hook(lambda *_, n=name: state.update(where=n or "self_attn"))

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if state["active"] and TOKENS in t.shape and ptr not in seen and ptr not in state["shared"]:
            seen.add(ptr)
            by_module[state["where"]] = by_module.get(state["where"], 0) + storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS))
    dt = autocast_dtype(plan)
    autocast = torch.autocast("cpu", dtype=dt) if dt else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(input_ids=ids, labels=ids)
    return {k: v / TOKENS for k, v in by_module.items()}, sum(by_module.values()) / TOKENS


def planned_saved(folder, plan: Plan) -> dict[str, float]:
    from core.estimate.activation_terms import LayerTerms
    from core.estimate.mla_terms import is_mla, mla_block

    spec = load_spec(str(folder))
    assert is_mla(spec)
    targets = () if plan.tuning == "full" else lora_targets(str(folder), plan.target_modules)
    t = LayerTerms(spec, plan, targets)
    mla_block(t)
    return t.saved


# the MLA layers of two Kimi-Delta-Attention hybrids: one q_proj, rope-less (Kimi Linear) or with a per-head sigmoid
# output gate (Bailing hybrid, Ling 2.5), layer 0 a recurrent layer without the MLA Linears
HYBRID = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    first_k_dense_replace=2,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    qk_head_dim=24,
    num_experts=4,
    num_experts_per_token=2,
    num_expert_group=1,
    topk_group=1,
    linear_head_dim=16,
    linear_num_heads=4,
    head_dim=8,
    pad_token_id=0,
    eos_token_id=1,
)
TWINS = {
    "deepseek_v3": FAMILIES["deepseek_v3"][0],
    "deepseek_v2": FAMILIES["deepseek_v3"][0],  # its rope through one complex freqs_cis
    "glm4_moe_lite": FAMILIES["glm4_moe_lite"][0],
    "kimi_linear": HYBRID,
    "bailing_hybrid": dict(
        HYBRID,
        mlp_layer_types=["dense", "dense"],
        expert_swiglu_limit_list=[0, 0],
        share_expert_swiglu_limit_list=[0, 0],
    ),
}
BASE = Plan(
    model="twin",
    device="cpu",
    seq_len=TOKENS,
    lora_r=8,
    lora_alpha=16,
    lora_dropout=0.0,
    gradient_checkpointing=False,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, fields, plan",
    [
        ("deepseek_v3", {}, BASE),  # sdpa: the CPU math path (qk head 24, v head 16), fp32 upcasts
        (
            "deepseek_v3",
            {},
            replace(BASE, attn="eager"),
        ),  # q, k, fp32 probabilities and their cast, v's storage
        ("deepseek_v3", {"q_lora_rank": None}, BASE),  # one q_proj (DeepSeek-V2-Lite, Kimi Linear)
        ("deepseek_v3", {}, replace(BASE, lora_dropout=0.05, target_modules="q_b_proj,kv_b_proj,o_proj")),
        # fp32 without autocast: no copies, so v keeps kv_b_proj's whole output and kv_a_layernorm its input's
        ("deepseek_v3", {}, replace(BASE, load_dtype="fp32", compute_dtype="fp32", attn="eager")),
        ("glm4_moe_lite", {}, BASE),  # equal head dims: sdpa's flash kernel saves q, k, v (a view), out, lse
        (
            "glm4_moe_lite",
            {},
            replace(BASE, tuning="full"),
        ),  # every Linear's input, the norms' weighted inputs
        ("deepseek_v2", {}, BASE),
        ("kimi_linear", {}, BASE),
        (
            "bailing_hybrid",
            {},
            BASE,
        ),  # the gate: sigmoid's fp32 output, the gate and the output it multiplies
        ("bailing_hybrid", {}, replace(BASE, attn="eager")),
    ],
    ids=[
        "ds3-sdpa-math",
        "ds3-eager",
        "ds3-q-proj",
        "ds3-dropout",
        "ds3-fp32-eager",
        "glm-sdpa",
        "glm-full",
        "ds2-sdpa-math",
        "kimi-linear",
        "bailing-sdpa",
        "bailing-eager",
    ],
)
def test_the_attention_saves_what_autograd_saves(tmp_path, family, fields, plan):
    folder = saved_folder(tmp_path, family, {**TWINS[family], **fields})
    plan = replace(plan, model=str(folder))
    measured, total = autograd_saved(folder, plan)
    planned = planned_saved(folder, plan)
    assert sum(planned.values()) == pytest.approx(total, rel=1e-9), (planned, measured)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "no-ckpt"])
def test_a_real_step_measures_within_5_percent_of_its_plan(family, checkpointing):
    planned, measured = measure(family, FAMILIES[family][0], 300, checkpointing)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite", "kimi_linear"])
def test_the_kv_cache_per_token_is_what_dynamic_cache_holds(tmp_path, family):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = saved_folder(tmp_path, family, TWINS[family])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 128, (1, TOKENS)), use_cache=True)
    # the attention layers' K / V (Kimi Linear's recurrent layers hold states of their own, not per token)
    kv_layers = [layer for layer in out.past_key_values.layers if hasattr(layer, "keys")]
    held = sum(t.nbytes for layer in kv_layers for t in (layer.keys, layer.values))
    spec = load_spec(str(folder))
    assert spec.kv_cache_bytes_per_token_per_byte * 2 == held / TOKENS  # bf16: 2 bytes an element
    # the latents' norms are the attention's (mla_terms), not Gemma-2-style norms around the MLP (Kimi Linear's
    # layer 0, which the spec reads them from, is a KDA layer with a gated norm of its own)
    if family != "kimi_linear":
        assert spec.norms_per_layer == 2
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", "--lora-r", "4")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
