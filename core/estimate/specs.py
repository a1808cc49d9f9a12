"""Model specs for the memory planner: the shape facts of a causal LM, counted exactly from its real module tree.

A spec comes from a bundled preset (hub id -> the public config.json fields, core/presets.json), a local model
folder (its config.json), or any other Hub id: its config.json alone, fetched into the Hugging Face cache (a few
KiB, no weights: core.hub), or the cached one offline. Parameter counts come from building the model on the
`meta` device (no memory, no weights) and counting; LoRA targets come from applying peft's own `get_peft_model`
to that meta model.

Importing torch, transformers and peft for that costs seconds, so the specs and LoRA targets of presets and
local folders are also kept on disk, per installed library version, in the user's cache folder (the same one as
core.recipe.schema's config schema): a spec is rebuilt only when the libraries, this file, or the model's config
fields change. A cache entry that cannot be read is rebuilt; a cache folder that cannot be written is skipped.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, fields
from functools import lru_cache

from core.estimate.layer_kinds import layers_json, mlp_linear_names
from core.estimate.layer_shapes import kv_cache_per_byte, shapes_json
from core.estimate.mla_terms import is_mla, latent_cache_per_byte
from core.estimate.model_config import SpecError as SpecError
from core.estimate.model_config import _config_from_dict, _config_source, load_model_config
from core.estimate.model_config import preset_ids as preset_ids
from core.estimate.moe import moe_json
from core.estimate.spec_cache import _cache_path, _int, _read_entry, _typed, _write_entry
from core.estimate.spec_cache import cache_dir as cache_dir  # the tests clear and inspect it here
from core.estimate.spec_cache import metadata as metadata
from core.estimate.unplanned import unplanned_sentence
from core.estimate.vlm import VISION_MODULES, is_vlm_config, language_model, vlm_json
from core.fmt import error_line
from core.recipe import peft_targets


@dataclass(frozen=True)
class LinearShape:
    """One LoRA target as peft adapts it: an nn.Linear, or (experts > 0) a parameter peft's target_parameters
    wraps (a fused 3-D expert stack, or a 2-D router weight: experts 1). Per expert, in -> out."""

    name: str  # module path, e.g. model.layers.0.self_attn.q_proj; a parameter's: ...mlp.experts.gate_up_proj
    in_features: int
    out_features: int
    bias: bool
    experts: int = 0  # 0: an nn.Linear; else the experts peft's ParamWrapper gives one rank-r adapter each
    rank: int = (
        1  # the rank per unit of r (peft doubles it for a fused gate_up converted from gate/up targets)
    )


@dataclass(frozen=True)
class ModelSpec:
    """Everything the estimator needs about a model, independent of how it is trained."""

    model_id: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    total_params: int  # exact, from the meta model (tied weights counted once)
    embedding_params: int  # input embedding matrix
    lm_head_params: int  # 0 when tied to the embedding
    decoder_linears: tuple[
        LinearShape, ...
    ]  # every nn.Linear inside the decoder layers (what 4-bit quantizes)
    param_numels: tuple[int, ...]  # every parameter tensor's element count (optimizers treat tensors by size)
    norms_per_layer: int
    config_json: str  # the config as JSON, so the spec can be rebuilt (and cached) from a hashable value
    moe_json: str = ""  # core.estimate.moe's facts of a mixture-of-experts model ("" for a dense one)
    head_norms: bool = (
        False  # RMSNorms on each query and key head (Qwen3's q_norm / k_norm), not in norms_per_layer
    )
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head, softmaxed with the scores (eager)
    sdpa: bool = (
        True  # the model class runs sdpa attention (gpt-oss does not: transformers falls back to eager)
    )
    vlm_json: str = ""  # core.estimate.vlm's facts of a vision-language model ("" for a language model)
    # every decoder layer's token mixers and feed-forward block (core.estimate.layer_kinds): hybrids such as
    # Qwen3.5, Qwen3-Next, Granite 4.0-H, Nemotron-H, Falcon-H1, LFM2 interleave attention with recurrent layers
    layers_json: str = ""
    # what all-linear leaves out on this model, one sentence per kind (core.recipe.peft_targets), JSON list
    all_linear_notes: str = ""
    # every layer's own attention / MLP / per-layer-input shape where layers differ (core.estimate.layer_shapes:
    # Gemma 4's sliding and full layers, KV sharing); "" where they share the fields above
    shapes_json: str = ""

    @property
    def recurrent_layers(self) -> int:
        """Layers that mix the sequence by a recurrence (Mamba, Gated DeltaNet, short convolutions...)."""
        from core.estimate.layer_kinds import ATTENTION, kinds_of

        return sum(1 for mixers, _ in kinds_of(self) if any(m != ATTENTION for m in mixers))

    @property
    def linear_params(self) -> int:
        return sum(s.in_features * s.out_features for s in self.decoder_linears)

    @property
    def kv_cache_bytes_per_token_per_byte(self) -> int:
        """K and V for every attention layer, per token, per byte of element size."""
        from core.estimate.layer_kinds import attention_layers

        own = kv_cache_per_byte(self)  # layers of their own shapes; a layer reusing K/V caches none
        if own is None:  # MLA caches its compressed latent and k_pe, not per-head K and V
            own = latent_cache_per_byte(self.config_json, attention_layers(self)) if is_mla(self) else None
        return own if own is not None else 2 * attention_layers(self) * self.num_kv_heads * self.head_dim


def _build_meta_model(cfg):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # a vision-language model: the class a VLM run trains (transformers' image-text-to-text one), vision included
    auto = AutoModelForImageTextToText if is_vlm_config(cfg) else AutoModelForCausalLM
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return auto.from_config(cfg)
    except ValueError as exc:
        raise SpecError(
            f"The config (model_type '{cfg.model_type}') is not a causal language model that transformers can "
            f"build with {auto.__name__} ({str(exc).splitlines()[0][:160]}); this planner handles decoder LLMs "
            "and the vision-language families it names (Qwen2/2.5/3-VL, Qwen3.5, Gemma 3, Idefics3, SmolVLM, "
            "LLaVA) only."
        ) from None
    except (
        Exception
    ) as exc:  # the model's own code fails on this config (a field it needs is missing or None)
        raise SpecError(
            f"transformers cannot build a '{cfg.model_type}' model from this config.json ({error_line(exc, 160)}); "
            "fix the config (the model card's config.json has every field it needs)."
        ) from None


@lru_cache(maxsize=32)
def _meta_model_for(config_json: str):
    return _build_meta_model(_config_from_dict(json.loads(config_json), "The config"))


def parameter_shapes(fields: dict) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(base_model_prefix, {state-dict name: shape}) of the model config.json `fields` describes, from the same
    meta model the planner counts; SpecError when it cannot be built."""
    meta = _meta_model_for(json.dumps(fields, sort_keys=True))
    return meta.base_model_prefix, {k: tuple(t.shape) for k, t in meta.state_dict().items()}


def decoder_layers(model):
    """The repeated decoder blocks: the largest nn.ModuleList of blocks (modules holding modules) in the model;
    a list of bare Linears is none (Gemma 3n's altup_projections outnumber the layers of a 2-layer config)."""
    import torch.nn as nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    blocks = [m for m in lists if any(next(c.children(), None) is not None for c in m)] or lists
    return max(blocks, key=len) if blocks else None


def load_spec(model: str) -> ModelSpec:
    """The spec of `model` (preset id, local folder or cached id): from memory, the disk cache, or the meta build.

    A folder's spec is looked up by its config.json content, so an edited config is never answered from the
    cache; without torch, transformers or peft imported when the disk cache has it.
    """
    model = str(model)  # a Path works too, and the spec's model_id is always a str
    source = _config_source(model.strip()) if model.strip() else None
    if source is None:  # a name only the HF cache may know, or bad input: load_model_config says which
        return _spec_for(model, None, "")
    data, where = source
    return _spec_for(model, json.dumps(data, sort_keys=True), where)


@lru_cache(maxsize=64)
def _spec_for(model: str, source_json: str | None, where: str) -> ModelSpec:
    if source_json is None:
        return _build_spec(model, load_model_config(model))
    try:
        return _cached_spec(model, source_json, where)
    except SpecError:
        raise
    except (
        Exception
    ) as exc:  # e.g. a per-layer (heterogeneous) config whose globals transformers refuses to give
        raise SpecError(
            f"{where} describes a model this planner cannot count ({error_line(exc, 160)}); it plans decoder "
            "LLMs whose layers share one shape."
        ) from None


def _cached_spec(model: str, source_json: str, where: str) -> ModelSpec:
    path = _cache_path("spec", [model, source_json])
    spec = _read_entry(path, ["spec", model, source_json], _spec_from_json)
    if spec is None:
        spec = _build_spec(model, _config_from_dict(json.loads(source_json), where))
        _write_entry(path, ["spec", model, source_json], asdict(spec))
    return spec


def _build_spec(model: str, cfg) -> ModelSpec:
    """Count the spec of `cfg` on its meta model (imports torch and transformers)."""
    import torch.nn as nn

    config_json = json.dumps(_config_fields(cfg), sort_keys=True)
    meta = _meta_model_for(config_json)
    vlm = vlm_json(meta, cfg)
    if vlm and json.loads(vlm)["unsupported"]:
        raise SpecError(json.loads(vlm)["unsupported"])
    # a VLM's vision tower may have more blocks than its language model: count the language model's layers
    layers = decoder_layers(language_model(meta) if vlm else meta)
    if layers is None or len(layers) == 0:
        raise SpecError(f"'{model}' has no repeated decoder layers; this planner handles decoder LLMs only.")
    layers_prefix = next(name for name, mod in meta.named_modules() if mod is layers)

    params = dict(meta.named_parameters())  # named_parameters de-duplicates tied weights
    embed = meta.get_input_embeddings()
    head = meta.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    linears = tuple(
        LinearShape(name, mod.in_features, mod.out_features, mod.bias is not None)
        for name, mod in meta.named_modules()
        if isinstance(mod, nn.Linear) and name.startswith(layers_prefix + ".")
    )
    norms = [n for n, m in layers[0].named_modules() if "norm" in type(m).__name__.lower()]
    head_norms = any(n.endswith(("q_norm", "k_norm")) for n in norms)

    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    refused = unplanned_sentence(cfg.model_type, json.loads(config_json), layers[0])  # BLT, Doge, Inkling
    if refused:
        raise SpecError(refused)
    moe = moe_json(meta, layers, text)
    unsupported = json.loads(moe)["unsupported"] if moe else ""
    if unsupported:
        raise SpecError(unsupported)
    shapes = shapes_json(layers)  # each layer's own shape where they differ (Gemma 3n's MLP widths)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if isinstance(_global(text, key), (list, tuple)) and not (key == "intermediate_size" and shapes):
            raise SpecError(
                f"'{model}' gives {key} per layer ({error_line(str(getattr(text, key)), 60)}); this planner plans "
                "decoder LLMs whose layers share one shape."
            )
    # a model without attention layers (Mamba-2) has no attention heads; its own heads are its mixer's
    heads = _global(text, "num_attention_heads") or 0
    head_dim = (_global(text, "head_dim") or text.hidden_size // heads) if heads else 0
    return ModelSpec(
        model_id=model,
        model_type=text.model_type,
        hidden_size=text.hidden_size,
        intermediate_size=_mlp_width(linears, text, moe),
        num_layers=len(layers),
        num_heads=heads,
        num_kv_heads=(_global(text, "num_key_value_heads") or heads) if heads else 0,
        head_dim=head_dim,
        vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 0,
        tie_word_embeddings=tied,
        total_params=sum(p.numel() for p in params.values()),
        embedding_params=embed.weight.numel(),
        lm_head_params=0 if (head is None or tied) else head.weight.numel(),
        decoder_linears=linears,
        param_numels=tuple(p.numel() for p in params.values()),
        # MLA's q_a_layernorm / kv_a_layernorm norm the latents inside the attention (core.estimate.mla_terms)
        norms_per_layer=len(
            [n for n in norms if not n.endswith(("q_norm", "k_norm", "v_norm", "a_layernorm"))]
        ),
        config_json=config_json,
        moe_json=moe,
        head_norms=head_norms,
        attention_sinks=any(n.rsplit(".", 1)[-1] == "sinks" for n, _ in layers[0].named_parameters()),
        sdpa=bool(getattr(meta, "_supports_sdpa", True)),
        vlm_json=vlm,
        layers_json=_layers_json(layers, moe),
        all_linear_notes=json.dumps(peft_targets.all_linear(meta)[1]),
        shapes_json=shapes,
    )


def _layers_json(layers, moe: str) -> str:
    """Every layer's kinds; LongCat-Flash's (MoE facts' sublayers > 1) keep their attentions in a ModuleList:
    attention and the shortcut MoE (core.estimate.longcat_terms plans its sublayers)."""
    facts = json.loads(moe) if moe else {}
    if facts.get("sublayers", 1) > 1:
        return json.dumps([[["attention"], "moe"]] * len(layers))
    return layers_json(layers, facts.get("experts_path", ""))


def _global(text, key: str):
    """A config field; one transformers gives per layer (Gemma 4's head_dim: it refuses the global) is layer
    0's, and the spec's shapes_json records every layer's own."""
    try:
        return getattr(text, key, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        return getattr(text.per_layer_config[0], key, None)


def _mlp_width(linears, text, moe: str) -> int:
    """The dense MLP's width as built: its down projection's input (LFM2 adjusts the config's intermediate_size,
    Granite's shared MLP has its own); the config's for a mixture of experts (core.estimate.moe has its widths)."""
    width = getattr(text, "intermediate_size", None)
    if not moe:
        down = mlp_linear_names(linears, text.hidden_size)[-1]
        built = [s.in_features for s in linears if s.name.rsplit(".", 1)[-1] == down and not s.experts]
        width = built[0] if built else width
    return width if isinstance(width, int) and width > 0 else 4 * text.hidden_size


def _config_fields(cfg) -> dict:
    fields = cfg.to_dict()
    fields["model_type"] = cfg.model_type
    for sub in ("text_config", "vision_config"):  # a VLM's sub-configs carry their own bookkeeping keys
        if isinstance(fields.get(sub), dict):
            for key in ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"):
                fields[sub].pop(key, None)
    for key in ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"):
        fields.pop(key, None)
    return fields


def normalize_targets(target_modules: str | list | tuple) -> tuple[str, ...] | str:
    """'all-linear' stays a string (peft's keyword); 'q_proj, v_proj' becomes ('q_proj', 'v_proj')."""
    if isinstance(target_modules, str):
        if target_modules.strip() == "all-linear":
            return "all-linear"
        target_modules = target_modules.split(",")
    names = tuple(sorted({t.strip() for t in target_modules if t and t.strip()}))
    if not names:
        raise SpecError("No LoRA target modules given: use all-linear or names such as q_proj,v_proj.")
    return names


def lora_targets(
    model: str,
    target_modules: str | tuple[str, ...],
    target_parameters: str | tuple[str, ...] = (),
    vision_frozen: bool = True,
) -> tuple[LinearShape, ...]:
    """The layers and parameters peft adapts for `target_modules` (and `target_parameters`: MoE experts), found by
    peft itself on the meta model -- with its own conversion of targets for transformers 5's fused experts.

    Trainable LoRA params for rank r are then sum(r * rank * max(experts, 1) * (in + out)) over these shapes, which
    is what peft counts.
    """
    spec = load_spec(model)
    targets = normalize_targets(target_modules)
    params = normalize_parameters(target_parameters)
    refused = peft_targets.refused_targets(spec.model_type, targets)
    if refused:
        raise SpecError(refused)
    try:
        if spec.vlm_json and vision_frozen:  # peft's exclude_modules keeps LoRA off the vision tower
            return _targets_for(spec.config_json, targets, params, VISION_EXCLUDE)
        return _targets_for(spec.config_json, targets, params)
    except SpecError:
        raise
    except ValueError as exc:  # peft's "Target modules ... not found in the base model"
        wanted = targets if isinstance(targets, str) else ",".join(targets)
        available = sorted({s.name.rsplit(".", 1)[-1] for s in spec.decoder_linears})
        raise SpecError(
            f"LoRA target modules '{wanted}' match no layer of {model} ({str(exc).splitlines()[0][:120]}); "
            f"this model's Linear layers are: {', '.join(available)} (or use all-linear)."
        ) from None
    except Exception as exc:  # peft's own code fails on this architecture
        raise SpecError(
            f"peft cannot put LoRA on {model} ({error_line(exc, 160)}); try explicit target_modules such as "
            "q_proj,v_proj."
        ) from None


def normalize_parameters(target_parameters: str | list | tuple) -> tuple[str, ...]:
    """'mlp.experts.gate_up_proj, mlp.experts.down_proj' (or a list) as a sorted tuple; () for none."""
    if isinstance(target_parameters, str):
        target_parameters = target_parameters.split(",")
    return tuple(sorted({t.strip() for t in target_parameters or () if t and t.strip()}))


# peft's exclude_modules for a frozen vision tower and projector (a regex, matched in full against module names)
# the vision side at the top of the model too (Llama 4's vision_model, BLIP-2's Linear language_projection)
VISION_EXCLUDE = rf"(.*\.)?({'|'.join(VISION_MODULES)})(\..*)?"


@lru_cache(maxsize=128)
def _targets_for(
    config_json: str, targets: str | tuple[str, ...], params: tuple[str, ...] = (), exclude: str = ""
) -> tuple[LinearShape, ...]:
    """The meta model is built from `config_json` alone, so its LoRA targets are cached under it."""
    key = (
        ["targets", config_json, targets]
        + ([list(params)] if params else [])
        + ([exclude] if exclude else [])
    )
    path = _cache_path("targets", key)
    shapes = _read_entry(path, key, _linears_from_json)
    if shapes is None:
        shapes = _build_targets(config_json, targets, params, exclude)
        _write_entry(path, key, [asdict(s) for s in shapes])
    return shapes


def _build_targets(
    config_json: str, targets: str | tuple[str, ...], params: tuple[str, ...] = (), exclude: str = ""
) -> tuple[LinearShape, ...]:
    """Apply peft's get_peft_model to a copy of the meta model (imports peft); ValueError when nothing matches."""
    import copy

    from peft import LoraConfig, get_peft_model

    meta = copy.deepcopy(_meta_model_for(config_json))  # peft edits the tree in place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LoraConfig(
            r=1,
            target_modules=list(targets) if targets != "all-linear" else peft_targets.all_linear(meta)[0],
            target_parameters=list(params) or None,
            exclude_modules=exclude or None,
        )
        peft_model = get_peft_model(meta, config)
    from peft.tuners.lora import LoraLayer, ParamWrapper

    out = []
    for name, mod in peft_model.base_model.model.named_modules():
        if isinstance(mod, ParamWrapper):
            out.append(_parameter_target(name, mod))
        elif isinstance(mod, LoraLayer):
            base = mod.get_base_layer()
            if hasattr(base, "in_features"):
                fan_in, fan_out = base.in_features, base.out_features
            else:  # GPT-2's Conv1D stores its weight as (in, out) and has no in_features
                fan_in, fan_out = base.weight.shape
            out.append(LinearShape(name, int(fan_in), int(fan_out), base.bias is not None))
    return tuple(out)


def _parameter_target(name: str, mod) -> LinearShape:
    """A parameter peft's target_parameters wraps (ParamWrapper; nested ones wrap each other): named by its
    module's path and the parameter, with peft's own in/out (swapped for experts x out x in storage) and rank."""
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    experts = int(mod.num_experts)
    rank = int(next(iter(mod.lora_A.values())).weight.shape[0]) // experts  # r=1 times peft's rank_pattern
    return LinearShape(
        f"{name}.{mod.parameter_name}", int(mod.in_features), int(mod.out_features), False, experts, rank
    )


def describe(spec: ModelSpec) -> str:
    return (
        f"{spec.model_id}: {spec.model_type}, {spec.total_params / 1e9:.2f} B params, {spec.num_layers} layers, "
        f"hidden {spec.hidden_size}, heads {spec.num_heads}/{spec.num_kv_heads} kv, vocab {spec.vocab_size}"
    )


def _linears_from_json(rows) -> tuple[LinearShape, ...]:
    if not isinstance(rows, list):
        raise TypeError("not a list of layers")
    out = []
    for row in rows:
        if set(row) != {"name", "in_features", "out_features", "bias", "experts", "rank"}:
            raise ValueError(f"not a layer: {row!r}")
        out.append(
            LinearShape(
                _typed(row["name"], str),
                _int(row["in_features"]),
                _int(row["out_features"]),
                _typed(row["bias"], bool),
                _int(row["experts"]),
                _int(row["rank"]),
            )
        )
    return tuple(out)


def _spec_from_json(data) -> ModelSpec:
    """A ModelSpec from its asdict() JSON, every field checked for its type (a wrong file raises)."""
    names = [f.name for f in fields(ModelSpec)]
    if not isinstance(data, dict) or sorted(data) != sorted(names):
        raise ValueError("not a ModelSpec")
    values = {}
    for f in fields(ModelSpec):
        value = data[f.name]
        if f.name == "decoder_linears":
            values[f.name] = _linears_from_json(value)
        elif f.name == "param_numels":
            values[f.name] = tuple(_int(v) for v in _typed(value, list))
        else:
            values[f.name] = _typed(value, {"str": str, "int": int, "bool": bool}[f.type])
    return ModelSpec(**values)
