"""Model specs: exact counts from the real module tree, checked against real tiny models and real peft/bnb."""

import json
from pathlib import Path

import pytest
import torch

from core.estimate.activation_terms import kv_cache_bytes_per_token
from core.estimate.bill import estimate
from core.estimate.plan import Plan
from core.estimate.specs import (
    SpecError,
    load_spec,
    lora_targets,
    normalize_targets,
    preset_ids,
)
from core.estimate.static_terms import weight_bytes


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
    plan = Plan(model=str(tiny_llama), lora_r=r, target_modules=targets, seq_len=16, device="cpu")
    assert estimate(plan).trainable_params == trainable  # the planner's count from the module tree


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
        model=str(path), tuning="qlora", load_dtype="bf16", double_quant=double_quant, prepare_kbit=False
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


# ----------------------------------------------------------------------------------------------------------
# The disk cache (issue #16: the first Estimate render built the preset on meta through torch/transformers/peft)


@pytest.fixture()
def spec_cache(tmp_path, monkeypatch):
    """An empty cache folder of its own, and no spec or target list remembered in memory."""
    from core.estimate import specs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def forget():
        specs.cache_dir.cache_clear()
        specs._spec_for.cache_clear()
        specs._targets_for.cache_clear()

    forget()
    yield specs
    forget()


def _assert_same_spec(cached, fresh):
    from dataclasses import fields

    from core.estimate.specs import ModelSpec

    for f in fields(ModelSpec):
        a, b = getattr(cached, f.name), getattr(fresh, f.name)
        assert type(a) is type(b) and a == b, f"{fresh.model_id}: {f.name} differs after the cache"
    assert cached == fresh and hash(cached) == hash(fresh)


def _no_builds(specs, monkeypatch):
    def refuse(*args):
        raise AssertionError("built again instead of read from the disk cache")

    specs._spec_for.cache_clear()
    specs._targets_for.cache_clear()
    monkeypatch.setattr(specs, "_build_spec", refuse)
    monkeypatch.setattr(specs, "_build_targets", refuse)


def test_every_preset_and_folder_spec_round_trips_through_the_disk_cache(
    spec_cache, monkeypatch, tiny_llama, tiny_llama_tied, tiny_gpt2
):
    specs = spec_cache
    models = preset_ids() + [str(tiny_llama), str(tiny_llama_tied), str(tiny_gpt2)]
    fresh = {m: specs._build_spec(m, specs.load_model_config(m)) for m in models}
    targets = {}
    for m in models:
        assert load_spec(m) == fresh[m]  # built and written
        # a VLM's LoRA stays off its (frozen by default) vision tower: peft's exclude_modules
        exclude = specs.VISION_EXCLUDE if fresh[m].vlm_json else ""
        every = targets[m, "all-linear"] = specs._build_targets(
            fresh[m].config_json, "all-linear", (), exclude
        )
        first = (every[0].name.rsplit(".", 1)[-1],)  # q_proj; Phi-3's qkv_proj; GPT-2's c_attn
        targets[m, first] = specs._build_targets(fresh[m].config_json, first, (), exclude)
        assert lora_targets(m, "all-linear") == every and lora_targets(m, first) == targets[m, first]
    assert len(list(specs.cache_dir().glob("spec-*.json"))) == len(models)

    _no_builds(specs, monkeypatch)
    for m in models:
        _assert_same_spec(load_spec(m), fresh[m])
    for (m, t), shapes in targets.items():
        cached = lora_targets(m, t)
        assert type(cached) is tuple and all(type(s) is type(shapes[0]) for s in cached)
        assert cached == shapes


def test_a_cached_spec_loads_without_importing_torch(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import sys; from core.estimate.specs import load_spec, lora_targets; "
        "s = load_spec('meta-llama/Llama-2-7b-hf'); t = lora_targets(s.model_id, 'all-linear'); "
        "print(s.total_params, len(t), sorted({'torch', 'transformers', 'peft'} & set(sys.modules)))"
    )
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    runs = [
        subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout.split()[:2] == runs[1].stdout.split()[:2] == ["6738415616", "224"]
    assert "'torch'" in runs[0].stdout  # the cold run built it
    assert runs[1].stdout.split(maxsplit=2)[2].strip() == "[]"  # the warm run imported none of them


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not json", "a string field as int", "a missing field", "bytes", "another model", "folder"],
)
def test_a_damaged_cache_entry_is_rebuilt_not_raised(spec_cache, damage):
    import shutil

    specs = spec_cache
    model = "Qwen/Qwen2.5-0.5B"
    fresh = load_spec(model)
    (path,) = specs.cache_dir().glob("spec-*.json")
    text = path.read_text()
    entry = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_text("<html>proxy error</html>")
    elif damage == "a string field as int":
        entry["value"]["hidden_size"] = str(entry["value"]["hidden_size"])
        path.write_text(json.dumps(entry))
    elif damage == "a missing field":
        del entry["value"]["param_numels"]
        path.write_text(json.dumps(entry))
    elif damage == "bytes":
        path.write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "another model":  # a well-formed entry written for other inputs is not taken
        entry["value"]["total_params"] += 1
        entry["key"][1] = "someone/else"
        path.write_text(json.dumps(entry))
    elif damage == "folder":  # unreadable, and cannot be replaced either
        path.unlink()
        path.mkdir()
    specs._spec_for.cache_clear()
    _assert_same_spec(load_spec(model), fresh)
    if damage == "folder":
        shutil.rmtree(path)
    else:  # rewritten whole
        specs._spec_for.cache_clear()
        assert specs._read_entry(path, json.loads(path.read_text())["key"], specs._spec_from_json) == fresh


def test_an_unwritable_cache_folder_is_skipped(spec_cache, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    spec_cache.cache_dir.cache_clear()
    assert load_spec("meta-llama/Llama-3.2-1B").num_layers == 16
    assert lora_targets("meta-llama/Llama-3.2-1B", "all-linear")


def test_an_edited_folder_config_is_not_answered_from_the_cache(spec_cache, tmp_path, tiny_llama):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    before = load_spec(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (folder / "config.json").write_text(json.dumps(cfg))
    after = load_spec(str(folder))  # same path, same process: the content decides
    assert after.num_layers == before.num_layers + 1
    assert len(lora_targets(str(folder), "all-linear")) > len(before.decoder_linears)
    assert len(list(spec_cache.cache_dir().glob("spec-*.json"))) == 2


def test_the_cache_folder_changes_with_the_library_versions(spec_cache, monkeypatch):
    specs = spec_cache
    first = specs.cache_dir()
    real = specs.metadata.version
    monkeypatch.setattr(specs.metadata, "version", lambda pkg: "99.0" if pkg == "torch" else real(pkg))
    specs.cache_dir.cache_clear()
    assert specs.cache_dir() != first and specs.cache_dir().parent == first.parent


@pytest.mark.parametrize(
    ("model", "nearest"),
    [
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),  # a fine-tune: its base
        ("unsloth/Qwen2.5-7B-Instruct-bnb-4bit", "Qwen/Qwen2.5-7B"),  # repackaged under another organisation
        ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
        ("meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-1B"),  # the family's nearest size
        ("nobody/unrelated-thing", None),
    ],
)
def test_the_nearest_preset_is_found_by_family_then_size(model, nearest):
    from core.estimate.nearest import nearest_preset
    from core.estimate.specs import preset_ids

    assert nearest_preset(model, preset_ids()) == nearest


def test_the_cache_folder_changes_with_the_code_the_targets_come_from(spec_cache, monkeypatch, tmp_path):
    """LoRA target lists come from core.recipe.peft_targets, outside the planner's package: an edit there must
    rebuild the cache (keyed on core/estimate alone, a day's cache kept target lists the edit had changed)."""
    import shutil

    from core.estimate import spec_cache as module

    specs = spec_cache
    copy = tmp_path / "core"
    shutil.copytree(
        Path(module.__file__).parents[1], copy, ignore=shutil.ignore_patterns("__pycache__", "*.json")
    )
    monkeypatch.setattr(module, "__file__", str(copy / "estimate" / "spec_cache.py"))
    specs.cache_dir.cache_clear()
    first = specs.cache_dir()
    targets = copy / "recipe" / "peft_targets.py"
    targets.write_text(targets.read_text() + "\n# an edit\n")
    specs.cache_dir.cache_clear()
    assert specs.cache_dir() != first
