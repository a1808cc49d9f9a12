"""Planning: which output tensor comes from which base tensor and adapter pieces (key mapping, layer kinds from
the model built on the meta device, tied embeddings, resized vocabulary, output shards)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.files import decode_config_floats
from core.merge.adapter import Adapter, LoraModule
from core.merge.errors import MergeError, load_json
from core.merge.experts import attach_parameters, module_kind, split_parameter_modules
from core.merge.model_files import auto_model_class
from core.merge.shards import (
    DTYPE_ARGS,
    DTYPE_NAMES,
    FLOAT_CODES,
    ST_DTYPES,
    TORCH_TO_ST,
    BaseCheckpoint,
    itemsize,
)
from core.plausible import ImplausibleConfig, check_model_config


@dataclass
class TensorPlan:
    out_key: str
    src_key: str
    shape: tuple
    out_code: str
    lora: LoraModule | None = None
    replacement: torch.Tensor | None = None
    bias_of: LoraModule | None = None  # this tensor is a bias that gets lora_B.bias * scale added

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.out_code)

    @property
    def changed(self) -> bool:
        return self.lora is not None or self.replacement is not None or self.bias_of is not None


@dataclass
class MergePlan:
    base_dir: Path
    adapter: Adapter
    base: BaseCheckpoint
    config: dict  # the output config.json
    out_dtype: torch.dtype
    tensors: list[TensorPlan]
    shards: list[tuple[str, list[TensorPlan]]]
    untied: bool = False
    new_vocab_size: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise MergeError(f"Shard size {text!r} is not a size: write it like 5GB, 500MB or 2GiB.")
    unit = (m[2] or "B").upper().replace("IB", "B")
    mult = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[
        unit
    ]
    if "I" in (m[2] or "").upper():
        mult = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}[unit]
    size = int(float(m[1]) * mult)
    if size < 1:
        raise MergeError(f"Shard size {text!r} must be positive.")
    return size


def _meta_model(config: dict):
    """The model built on the meta device: module types (Linear / Conv1D / Embedding) without any memory."""
    # transformers takes seconds to import: only when a plan is built (not for the MergePlan type alone)
    from transformers import AutoConfig

    cfg = decode_config_floats(dict(config))  # transformers' tagged inf / nan (Mamba-2's time_step_limit)
    cfg.pop("quantization_config", None)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise MergeError("The base config.json has no model_type: cannot tell which architecture to build.")
    try:
        hf_cfg = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            model = auto_model_class(config).from_config(hf_cfg)
    except Exception as e:  # unknown architecture, remote code, ...
        raise MergeError(
            f"Cannot build the base architecture {model_type!r} from its config.json ({type(e).__name__}: {e}). "
            "Only causal LMs (and vision-language models) that transformers knows without remote code can be merged."
        ) from e
    return model, hf_cfg


def _default_dtype(config: dict, base: BaseCheckpoint) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str) and name.replace("torch.", "") in ("bfloat16", "float16", "float32"):
        return getattr(torch, name.replace("torch.", ""))
    counts: dict[str, int] = {}
    for t in base.tensors.values():
        if t.code in ("BF16", "F16", "F32"):
            counts[t.code] = counts.get(t.code, 0) + t.nbytes
    return ST_DTYPES[max(counts, key=counts.get)] if counts else torch.float32


def plan_merge(
    base_dir: str | os.PathLike,
    adapter: Adapter,
    dtype: torch.dtype | str | None = None,
    shard_size: int | str = "5GB",
) -> MergePlan:
    """Map every adapter piece onto the base tensor it changes and lay out the output shards; anything that
    does not fit this base is a MergeError saying so, before a byte is written."""
    base_dir = Path(base_dir)
    config = _read_base_config(base_dir)
    base = BaseCheckpoint(base_dir)
    out_dtype = _output_dtype(dtype, config, base)
    out_code = TORCH_TO_ST[out_dtype]
    max_shard = parse_size(shard_size)
    _check_architecture(adapter, config, base_dir)
    targets = _Targets(base_dir, config, base, out_code)
    adapter.params = split_parameter_modules(adapter, targets.modules)
    targets.attach(adapter)
    attach_parameters(targets, adapter, adapter.params)
    targets.check_lora_shapes()
    if adapter.config.get("ensure_weight_tying") and targets.tied and targets.touches_embeddings:
        raise MergeError(
            "The adapter was trained with ensure_weight_tying on tied embeddings; this merge does not support that "
            "combination. Use the adapter unmerged with peft."
        )
    tensors, untied, notes = targets.output_tensors()
    new_vocab = targets.resized_vocabulary(notes)
    return MergePlan(
        base_dir,
        adapter,
        base,
        _output_config(config, out_dtype, untied, new_vocab),
        out_dtype,
        tensors,
        _split_into_shards(tensors, max_shard),
        untied,
        new_vocab,
        notes,
    )


def _read_base_config(base_dir: Path) -> dict:
    """The base's config.json; a quantized base is refused (its stored weights are not the ones to merge into)."""
    cfg_path = base_dir / "config.json"
    if not cfg_path.is_file():
        raise MergeError(f"{base_dir} has no config.json: point --base at a transformers model folder.")
    config = load_json(cfg_path, "restore it (copy or download the base model again).")
    try:  # the export carries this config on: one that no real model has is refused, as every other tool does
        check_model_config(config, str(cfg_path))
    except ImplausibleConfig as exc:
        raise MergeError(str(exc)) from None
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
        raise MergeError(
            f"The base model in {base_dir} is stored quantized ({method}): its "
            "weights cannot be merged exactly. Point --base at the original bf16/fp16 model the quantized one was "
            "made from (for QLoRA, the model you passed to training before 4-bit loading)."
        )
    return config


def _output_dtype(dtype: torch.dtype | str | None, config: dict, base: BaseCheckpoint) -> torch.dtype:
    """The export's dtype: the one asked for (bf16 / fp16 / fp32 or a torch dtype), else the base's."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_ARGS:
            raise MergeError(f"Output dtype {dtype!r} is not one of {', '.join(DTYPE_ARGS)}.")
        dtype = DTYPE_ARGS[dtype]
    return dtype or _default_dtype(config, base)


def _check_architecture(adapter: Adapter, config: dict, base_dir: Path) -> None:
    """The model class peft recorded for the adapter must be one the base's config.json names."""
    arch = (adapter.config.get("auto_mapping") or {}).get("base_model_class")
    base_archs = config.get("architectures") or []
    if arch and base_archs and arch not in base_archs:
        raise MergeError(
            f"The adapter was trained on a {arch} but the base in {base_dir} is a {base_archs[0]}: pick the base "
            f"model the adapter was trained on (adapter_config.json says {adapter.config.get('base_model_name_or_path')!r})."
        )


def _checkpoint_names(model, tensors: dict) -> dict[str, str]:
    """{model parameter name: checkpoint key} for a checkpoint saved in an older layout that transformers renames
    as it loads (LLaVA's and Qwen2-VL's language_model.model.* become model.language_model.*): its own renamings,
    applied to each key. The merged checkpoint keeps the keys it had."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError, TypeError):  # another transformers: the names as they are
        return {}
    if not renamings:
        return {}
    meta = model.state_dict()
    out = {}
    for key in tensors:
        name = rename_source_key(key, renamings, [], model.base_model_prefix, meta)[0]
        if name != key:
            out[name] = key
    return out


class _Targets:
    """The base tensors an adapter can change, one TensorPlan each, and the adapter pieces attached to them.

    Module kinds and the embeddings come from the model built on the meta device. With tied embeddings the
    output head may not be on disk (it is the input embedding): a planned lm_head copied from the embedding
    (`extra_lm_head`) then stands for it."""

    def __init__(self, base_dir: Path, config: dict, base: BaseCheckpoint, out_code: str):
        self.base_dir, self.config, self.base, self.out_code = base_dir, config, base, out_code
        model, hf_cfg = _meta_model(config)
        self.modules = dict(model.named_modules())
        self.aliases = _checkpoint_names(model, base.tensors)  # base_key reads it from here on
        names = {id(m): n for n, m in self.modules.items()}
        self.in_emb = names.get(id(model.get_input_embeddings()))
        out_emb_mod = model.get_output_embeddings()
        self.out_emb = names.get(id(out_emb_mod)) if out_emb_mod is not None else None
        self.prefix = getattr(model, "base_model_prefix", "") + "."
        self.tied = (
            bool(getattr(hf_cfg, "tie_word_embeddings", False))
            and self.out_emb is not None
            and self.in_emb is not None
        )
        self.out_emb_key = f"{self.out_emb}.weight" if self.out_emb else None
        # lm_head.weight not on disk: it is the embedding
        self.tied_missing = self.tied and self.base_key(self.out_emb_key) is None
        self.by_key: dict[str, TensorPlan] = {}
        for key, info in base.tensors.items():
            code = out_code if info.code in FLOAT_CODES else info.code
            self.by_key[key] = TensorPlan(key, key, info.shape, code)
        self.extra_lm_head: TensorPlan | None = None
        self.touches_embeddings = False

    def base_key(self, param_key: str) -> str | None:
        """The checkpoint key for a model parameter; old checkpoints may lack the base model prefix."""
        for cand in (param_key, param_key.removeprefix(self.prefix), self.prefix + param_key):
            if cand in self.base.tensors:
                return cand
        return self.aliases.get(param_key)

    def _lm_head_from_embedding(self) -> TensorPlan:
        src = self.base_key(f"{self.in_emb}.weight")
        return TensorPlan(self.out_emb_key, src, self.base.tensors[src].shape, self.out_code)

    def plan_for(self, param_key: str, what: str) -> TensorPlan:
        """The planned output tensor for a model parameter; one the base does not have is a MergeError."""
        if self.tied_missing and param_key == self.out_emb_key:
            if self.extra_lm_head is None:
                self.extra_lm_head = self._lm_head_from_embedding()
            return self.extra_lm_head
        k = self.base_key(param_key)
        if k is None:
            raise MergeError(
                f"{what} targets {param_key}, which is not in the base checkpoint {self.base_dir}: the adapter does "
                "not belong to this base model (or the checkpoint uses other key names)."
            )
        return self.by_key[k]

    def attach(self, adapter: Adapter) -> None:
        """Attach every adapter piece to a base tensor; anything that matches nothing is an error."""
        for name, mod in adapter.modules.items():
            self._attach_lora(name, mod)
        for pkey, t in adapter.replacements.items():
            self._attach_replacement(pkey, t)

    def _attach_lora(self, name: str, mod: LoraModule) -> None:
        module = self.modules.get(name)
        if module is None:
            raise MergeError(
                f"Adapter module {name} does not exist in the base architecture ({self.config.get('model_type')}): "
                "the adapter belongs to another model."
            )
        mod.kind = module_kind(module)
        if mod.kind not in ("linear", "conv1d", "embedding"):
            raise MergeError(
                f"Adapter module {name} is a {mod.kind}; this merge supports Linear, Conv1D and Embedding."
            )
        if mod.embedding != (mod.kind == "embedding"):
            raise MergeError(
                f"Adapter module {name}: LoRA tensor names do not match the layer kind ({mod.kind})."
            )
        if mod.kind == "embedding" and mod.magnitude is not None:
            raise MergeError(
                f"DoRA on the embedding layer {name} is not supported by this merge; use peft unmerged."
            )
        if name in (self.in_emb, self.out_emb):
            self.touches_embeddings = True
        plan = self.plan_for(f"{name}.weight", f"Adapter module {name}")
        if plan.lora is not None:
            raise MergeError(f"Two adapter modules map to the same base tensor {plan.out_key}.")
        plan.lora = mod
        if mod.bias is not None:
            self.plan_for(f"{name}.bias", f"The lora_bias of {name}").bias_of = mod

    def _attach_replacement(self, pkey: str, t: torch.Tensor) -> None:
        """A full trained tensor (modules_to_save, a saved base layer) replaces the base's; only the embeddings
        may change their number of rows (a resized vocabulary)."""
        plan = self.plan_for(pkey, f"Adapter tensor {pkey} (modules_to_save / saved base layer)")
        module_name = pkey.rsplit(".", 1)[0]
        if module_name in (self.in_emb, self.out_emb):
            self.touches_embeddings = True
        plan.replacement = t
        if tuple(t.shape) != tuple(plan.shape):
            resized = module_name in (self.in_emb, self.out_emb) and t.shape[1:] == plan.shape[1:]
            if not resized:
                raise MergeError(
                    f"Adapter tensor {pkey} has shape {tuple(t.shape)} but the base has {tuple(plan.shape)}: the "
                    "adapter does not belong to this base model."
                )
            plan.shape = tuple(t.shape)

    def check_lora_shapes(self) -> None:
        """Shapes of LoRA pieces against the base tensor they modify."""
        for plan in [*self.by_key.values(), *([self.extra_lm_head] if self.extra_lm_head else [])]:
            if (
                plan.lora is not None and plan.lora.kind != "param"
            ):  # a parameter's pair: checked when attached
                _check_lora_fits(plan.lora, plan.shape)

    def output_tensors(self) -> tuple[list[TensorPlan], bool, list[str]]:
        """(tensors in output order, untied, notes): the base's order, with a separate lm_head right after the
        embedding when tied embeddings must be untied (the adapter changes one of them)."""
        tensors: list[TensorPlan] = []
        for key in self.base.tensors:
            tensors.append(self.by_key[key])
            if self.extra_lm_head is not None and key == self.extra_lm_head.src_key:
                tensors.append(self.extra_lm_head)
        if not (self.tied and self.touches_embeddings):
            return tensors, False, []
        if self.extra_lm_head is None and self.tied_missing:
            self.extra_lm_head = self._lm_head_from_embedding()
            tensors.insert(tensors.index(self.by_key[self.extra_lm_head.src_key]) + 1, self.extra_lm_head)
        return (
            tensors,
            True,
            [
                "Tied embeddings: the adapter changes the embedding or the output head, so lm_head.weight is "
                "written separately and tie_word_embeddings is set to false (merging into the shared tensor "
                "would be wrong)."
            ],
        )

    def resized_vocabulary(self, notes: list[str]) -> int | None:
        """The new vocabulary size when the adapter replaced the input embedding with more or fewer rows (a note
        says so); the output head must then have been resized with it."""
        emb_plan = self.by_key.get(self.base_key(f"{self.in_emb}.weight") or "") if self.in_emb else None
        if (
            emb_plan is None
            or emb_plan.replacement is None
            or emb_plan.shape[0] == self.base.tensors[emb_plan.src_key].shape[0]
        ):
            return None
        new_vocab = emb_plan.shape[0]
        notes.append(
            f"The adapter resized the vocabulary to {new_vocab} tokens: vocab_size is updated in config.json."
        )
        if self.out_emb_key is not None:
            head = (
                self.extra_lm_head
                if self.extra_lm_head is not None
                else self.by_key.get(self.base_key(self.out_emb_key) or "")
            )
            if head is not None and head.shape[0] != new_vocab:
                raise MergeError(
                    f"The adapter resized the input embedding to {new_vocab} tokens but not the output head "
                    f"({self.out_emb_key} has {head.shape[0]} rows): train with modules_to_save including the head "
                    "too."
                )
        return new_vocab


def _check_lora_fits(mod: LoraModule, shape: tuple) -> None:
    """LoRA A / B (and a DoRA magnitude) must have the sizes the base weight they update implies."""
    rows, cols = shape[0], math.prod(shape[1:])
    if mod.kind == "linear":
        want_a, want_b = cols, rows  # W (out, in)
    else:  # conv1d W (in, out); embedding W (vocab, hidden): delta = A^T B^T
        want_a, want_b = rows, cols
    if mod.A.shape[1] != want_a or mod.B.shape[0] != want_b:
        raise MergeError(
            f"Adapter module {mod.name} does not fit the base: LoRA A {tuple(mod.A.shape)} / B {tuple(mod.B.shape)} "
            f"cannot update a {mod.kind} weight of shape {shape}. Was the adapter trained on another model size?"
        )
    if mod.magnitude is not None and mod.magnitude.numel() != (rows if mod.kind == "linear" else cols):
        raise MergeError(
            f"DoRA magnitude of {mod.name} has {mod.magnitude.numel()} entries, expected {rows}."
        )


def _output_config(config: dict, out_dtype: torch.dtype, untied: bool, new_vocab: int | None) -> dict:
    """The export's config.json: the base's, unquantized, with its dtype, tie flag and vocabulary size."""
    out_config = dict(config)
    out_config.pop("quantization_config", None)
    out_config["dtype"] = DTYPE_NAMES[out_dtype]
    if "torch_dtype" in out_config:
        out_config["torch_dtype"] = DTYPE_NAMES[out_dtype]
    if untied:
        out_config["tie_word_embeddings"] = False
    if new_vocab is not None:
        out_config["vocab_size"] = new_vocab
    return out_config


def _split_into_shards(tensors: list[TensorPlan], max_shard: int) -> list[tuple[str, list[TensorPlan]]]:
    """Consecutive tensors into shards of at most `max_shard` bytes (a larger tensor gets one of its own), named
    as transformers names them."""
    shards: list[list[TensorPlan]] = [[]]
    filled = 0
    for t in tensors:
        if shards[-1] and filled + t.nbytes > max_shard:
            shards.append([])
            filled = 0
        shards[-1].append(t)
        filled += t.nbytes
    n = len(shards)
    names = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    return list(zip(names, shards, strict=True))
