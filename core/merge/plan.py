"""Planning: which output tensor comes from which base tensor and adapter pieces (key mapping, layer kinds from
the model built on the meta device, tied embeddings, resized vocabulary, output shards)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.merge.adapter import Adapter, LoraModule
from core.merge.common import MergeError, read_json_object
from core.merge.shards import (
    DTYPE_ARGS,
    DTYPE_NAMES,
    FLOAT_CODES,
    ST_DTYPES,
    TORCH_TO_ST,
    BaseCheckpoint,
    itemsize,
)


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
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    cfg.pop("quantization_config", None)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise MergeError("The base config.json has no model_type: cannot tell which architecture to build.")
    try:
        hf_cfg = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
    except Exception as e:  # unknown architecture, remote code, ...
        raise MergeError(
            f"Cannot build the base architecture {model_type!r} from its config.json ({type(e).__name__}: {e}). "
            "Only causal LMs that transformers knows without remote code can be merged."
        ) from e
    return model, hf_cfg


def _module_kind(module) -> str:
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return "conv1d"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if isinstance(module, torch.nn.Linear):
        return "linear"
    return type(module).__name__


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
    base_dir = Path(base_dir)
    cfg_path = base_dir / "config.json"
    if not cfg_path.is_file():
        raise MergeError(f"{base_dir} has no config.json: point --base at a transformers model folder.")
    config = read_json_object(cfg_path, "restore it (copy or download the base model again).")
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
        raise MergeError(
            f"The base model in {base_dir} is stored quantized ({method}): its "
            "weights cannot be merged exactly. Point --base at the original bf16/fp16 model the quantized one was "
            "made from (for QLoRA, the model you passed to training before 4-bit loading)."
        )
    base = BaseCheckpoint(base_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPE_ARGS:
            raise MergeError(f"Output dtype {dtype!r} is not one of {', '.join(DTYPE_ARGS)}.")
        dtype = DTYPE_ARGS[dtype]
    out_dtype = dtype or _default_dtype(config, base)
    out_code = TORCH_TO_ST[out_dtype]
    max_shard = parse_size(shard_size)

    arch = (adapter.config.get("auto_mapping") or {}).get("base_model_class")
    base_archs = config.get("architectures") or []
    if arch and base_archs and arch not in base_archs:
        raise MergeError(
            f"The adapter was trained on a {arch} but the base in {base_dir} is a {base_archs[0]}: pick the base "
            f"model the adapter was trained on (adapter_config.json says {adapter.config.get('base_model_name_or_path')!r})."
        )

    model, hf_cfg = _meta_model(config)
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    in_emb = names.get(id(model.get_input_embeddings()))
    out_emb_mod = model.get_output_embeddings()
    out_emb = names.get(id(out_emb_mod)) if out_emb_mod is not None else None
    prefix = getattr(model, "base_model_prefix", "") + "."

    def base_key(param_key: str) -> str | None:
        """The checkpoint key for a model parameter; old checkpoints may lack the base model prefix."""
        for cand in (param_key, param_key.removeprefix(prefix), prefix + param_key):
            if cand in base.tensors:
                return cand
        return None

    tied = bool(getattr(hf_cfg, "tie_word_embeddings", False)) and out_emb is not None and in_emb is not None
    out_emb_key = f"{out_emb}.weight" if out_emb else None
    tied_missing = tied and base_key(out_emb_key) is None  # lm_head.weight not on disk: it is the embedding

    # Attach every adapter piece to a base tensor; anything that matches nothing is an error.
    by_key: dict[str, TensorPlan] = {}
    for key, info in base.tensors.items():
        code = out_code if info.code in FLOAT_CODES else info.code
        by_key[key] = TensorPlan(key, key, info.shape, code)
    extra_lm_head: TensorPlan | None = None
    touches_embeddings = False

    def plan_for(param_key: str, what: str) -> TensorPlan:
        nonlocal extra_lm_head
        if tied_missing and param_key == out_emb_key:
            if extra_lm_head is None:
                src = base_key(f"{in_emb}.weight")
                extra_lm_head = TensorPlan(out_emb_key, src, base.tensors[src].shape, out_code)
            return extra_lm_head
        k = base_key(param_key)
        if k is None:
            raise MergeError(
                f"{what} targets {param_key}, which is not in the base checkpoint {base_dir}: the adapter does not "
                "belong to this base model (or the checkpoint uses other key names)."
            )
        return by_key[k]

    for name, mod in adapter.modules.items():
        module = modules.get(name)
        if module is None:
            raise MergeError(
                f"Adapter module {name} does not exist in the base architecture ({config.get('model_type')}): the "
                "adapter belongs to another model."
            )
        mod.kind = _module_kind(module)
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
        if name in (in_emb, out_emb):
            touches_embeddings = True
        plan = plan_for(f"{name}.weight", f"Adapter module {name}")
        if plan.lora is not None:
            raise MergeError(f"Two adapter modules map to the same base tensor {plan.out_key}.")
        plan.lora = mod
        if mod.bias is not None:
            bplan = plan_for(f"{name}.bias", f"The lora_bias of {name}")
            bplan.bias_of = mod
    for pkey, t in adapter.replacements.items():
        plan = plan_for(pkey, f"Adapter tensor {pkey} (modules_to_save / saved base layer)")
        module_name = pkey.rsplit(".", 1)[0]
        if module_name in (in_emb, out_emb):
            touches_embeddings = True
        plan.replacement = t
        if tuple(t.shape) != tuple(plan.shape):
            resized = module_name in (in_emb, out_emb) and t.shape[1:] == plan.shape[1:]
            if not resized:
                raise MergeError(
                    f"Adapter tensor {pkey} has shape {tuple(t.shape)} but the base has {tuple(plan.shape)}: the "
                    "adapter does not belong to this base model."
                )
            plan.shape = tuple(t.shape)

    # Shapes of LoRA pieces against the base tensor they modify.
    for plan in [*by_key.values(), *([extra_lm_head] if extra_lm_head else [])]:
        mod = plan.lora
        if mod is None:
            continue
        rows, cols = plan.shape[0], math.prod(plan.shape[1:])
        if mod.kind == "linear":
            want_a, want_b = cols, rows  # W (out, in)
        else:  # conv1d W (in, out); embedding W (vocab, hidden): delta = A^T B^T
            want_a, want_b = rows, cols
        if mod.A.shape[1] != want_a or mod.B.shape[0] != want_b:
            raise MergeError(
                f"Adapter module {mod.name} does not fit the base: LoRA A {tuple(mod.A.shape)} / B {tuple(mod.B.shape)} "
                f"cannot update a {mod.kind} weight of shape {plan.shape}. Was the adapter trained on another model size?"
            )
        if mod.magnitude is not None and mod.magnitude.numel() != (rows if mod.kind == "linear" else cols):
            raise MergeError(
                f"DoRA magnitude of {mod.name} has {mod.magnitude.numel()} entries, expected {rows}."
            )

    if adapter.config.get("ensure_weight_tying") and tied and touches_embeddings:
        raise MergeError(
            "The adapter was trained with ensure_weight_tying on tied embeddings; this merge does not support that "
            "combination. Use the adapter unmerged with peft."
        )

    tensors: list[TensorPlan] = []
    for key in base.tensors:
        tensors.append(by_key[key])
        if extra_lm_head is not None and key == extra_lm_head.src_key:
            tensors.append(extra_lm_head)
    untied = False
    notes: list[str] = []
    if tied and touches_embeddings:
        if extra_lm_head is None and tied_missing:
            src = base_key(f"{in_emb}.weight")
            extra_lm_head = TensorPlan(out_emb_key, src, base.tensors[src].shape, out_code)
            tensors.insert(tensors.index(by_key[src]) + 1, extra_lm_head)
        untied = True
        notes.append(
            "Tied embeddings: the adapter changes the embedding or the output head, so lm_head.weight is written "
            "separately and tie_word_embeddings is set to false (merging into the shared tensor would be wrong)."
        )

    new_vocab = None
    emb_plan = by_key.get(base_key(f"{in_emb}.weight") or "") if in_emb else None
    if (
        emb_plan is not None
        and emb_plan.replacement is not None
        and emb_plan.shape[0] != base.tensors[emb_plan.src_key].shape[0]
    ):
        new_vocab = emb_plan.shape[0]
        notes.append(
            f"The adapter resized the vocabulary to {new_vocab} tokens: vocab_size is updated in config.json."
        )
    if new_vocab is not None and out_emb_key is not None:
        head = extra_lm_head if extra_lm_head is not None else by_key.get(base_key(out_emb_key) or "")
        if head is not None and head.shape[0] != new_vocab:
            raise MergeError(
                f"The adapter resized the input embedding to {new_vocab} tokens but not the output head "
                f"({out_emb_key} has {head.shape[0]} rows): train with modules_to_save including the head too."
            )

    out_config = dict(config)
    out_config.pop("quantization_config", None)
    out_config["dtype"] = DTYPE_NAMES[out_dtype]
    if "torch_dtype" in out_config:
        out_config["torch_dtype"] = DTYPE_NAMES[out_dtype]
    if untied:
        out_config["tie_word_embeddings"] = False
    if new_vocab is not None:
        out_config["vocab_size"] = new_vocab

    shards: list[list[TensorPlan]] = [[]]
    filled = 0
    for t in tensors:
        if shards[-1] and filled + t.nbytes > max_shard:
            shards.append([])
            filled = 0
        shards[-1].append(t)
        filled += t.nbytes
    n = len(shards)
    names_ = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    return MergePlan(
        base_dir,
        adapter,
        base,
        out_config,
        out_dtype,
        tensors,
        list(zip(names_, shards, strict=True)),
        untied,
        new_vocab,
        notes,
    )
