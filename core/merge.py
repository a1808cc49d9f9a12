"""Merge a LoRA adapter into its base model shard by shard, verify it, and export it atomically.

`merge_and_unload()` loads the whole model (often in fp32); this engine instead reads the base checkpoint one
tensor (or one block of rows) at a time and streams each output tensor straight into its output shard, so RAM
stays near one tensor plus the adapter whatever the model size. Every merged weight is computed in fp32 and
rounded once to the output dtype. The export is written into a temporary folder beside the target and renamed
into place only when it is complete and verified: a merge killed midway leaves no target folder.

Pitfalls handled (shared/design/merge.md): tied embeddings (lm_head written explicitly, tie flag cleared),
GPT-2 Conv1D (layer kind from the model built on the meta device, never from shapes), embedding LoRA
(transposed delta), modules_to_save (replace, not add), rsLoRA, rank/alpha patterns (r read from tensor shapes),
key mapping (an adapter tensor that matches nothing fails loudly), DoRA on Linear/Conv1D, unknown adapter
types and features refused with a clear message.

CLI: python -m core.merge --base DIR --adapter DIR --out DIR [--dtype bf16|fp16|fp32] [--shard-size 5GB]
                          [--device cpu|cuda] [--verify auto|full|quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from core.workspace import WorkspaceError, default_workspace, inside

GB = 1024**3
MB = 1024**2
# Rows are processed in blocks of at most this many fp32 bytes: a 128k x 8k embedding (~4 GB in fp32) never
# materialises whole.
CHUNK_BYTES = 256 * MB
COPY_BLOCK = 64 * MB
# Python + torch + transformers already use a few hundred MB before any tensor is read.
RUNTIME_OVERHEAD = 768 * MB
TEMP_MARKER = ".lora-cockpit-merge"
PAUSE_ENV = "LORA_COCKPIT_TEST_MERGE_PAUSE_AFTER_FIRST_SHARD"  # test-only: makes the kill test deterministic

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
DTYPE_ARGS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Relative to the logits of the fp32 oracle; bf16 keeps 8 mantissa bits, so a merged bf16 model drifts by ~1e-2.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 2e-2)}
DEFAULT_PROMPTS = ("Hello! How are you today?", "The capital of France is", "def add(a, b):\n    return")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# adapter_config fields whose adapters cannot be folded into plain weights exactly.
UNSUPPORTED_FEATURES = {
    "target_parameters": "LoRA on raw parameters (target_parameters, e.g. MoE experts)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "use_qalora": "QA-LoRA",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA only acts after its invocation tokens)",
    "arrow_config": "Arrow routing",
    "use_bdlora": "BD-LoRA",
    "monteclora_config": "MonteCLoRA",
    "velora_config": "VeLoRA",
    "kasa_config": "KaSA",
}


class MergeError(ValueError):
    """A user-facing problem with a merge; the message says what is wrong and how to fix it."""


@dataclass
class MergeProgress:
    phase: str  # "merge", "verify", "done"
    tensors_done: int
    tensors_total: int
    bytes_written: int
    bytes_total: int
    key: str = ""


ProgressFn = Callable[[MergeProgress], None]


# ----------------------------------------------------------------------------------------------------------
# Reading the base checkpoint
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TensorInfo:
    key: str
    code: str  # safetensors dtype code
    shape: tuple
    file: Path
    offset: int = 0  # absolute byte offset in `file` (safetensors only)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.code)


def _itemsize(code: str) -> int:
    return torch.empty((), dtype=ST_DTYPES[code]).element_size()


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise MergeError(f"{path} is not a safetensors file (shorter than 8 bytes).")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * MB:
            raise MergeError(f"{path} is not a valid safetensors file (header of {n} bytes).")
        header = json.loads(f.read(n))
    return header, 8 + n


class BaseCheckpoint:
    """The base model's weights on disk: sharded or single safetensors, or PyTorch .bin (loaded whole)."""

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        self.tensors: dict[str, TensorInfo] = {}
        self.warnings: list[str] = []
        self.kind = "safetensors"
        self._bin: dict[Path, dict] = {}
        files = self._weight_files()
        for file in files:
            if self.kind == "safetensors":
                header, data_start = read_safetensors_header(file)
                entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
                for key, v in sorted(entries, key=lambda kv: kv[1]["data_offsets"][0]):
                    if v["dtype"] not in ST_DTYPES:
                        raise MergeError(
                            f"{file.name}: tensor {key} has dtype {v['dtype']} this merge cannot read."
                        )
                    self.tensors[key] = TensorInfo(
                        key, v["dtype"], tuple(v["shape"]), file, data_start + v["data_offsets"][0]
                    )
            else:
                for key, t in self._load_bin(file).items():
                    if t.dtype not in TORCH_TO_ST:
                        raise MergeError(
                            f"{file.name}: tensor {key} has dtype {t.dtype} this merge cannot read."
                        )
                    self.tensors[key] = TensorInfo(key, TORCH_TO_ST[t.dtype], tuple(t.shape), file)
        self.largest_file_bytes = max(f.stat().st_size for f in files)
        self.total_bytes = sum(t.nbytes for t in self.tensors.values())

    def _weight_files(self) -> list[Path]:
        d = self.dir
        for index_name, single, kind in (
            ("model.safetensors.index.json", "model.safetensors", "safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin", "bin"),
        ):
            self.kind = kind
            if (d / index_name).is_file():
                weight_map = json.loads((d / index_name).read_text())["weight_map"]
                names = list(dict.fromkeys(weight_map.values()))
                missing = [n for n in names if not (d / n).is_file()]
                if missing:
                    raise MergeError(
                        f"Base model {d} is incomplete: {index_name} lists {missing[0]}, which is missing."
                    )
                files = [d / n for n in names]
            elif (d / single).is_file():
                files = [d / single]
            else:
                continue
            if kind == "bin":
                self.warnings.append(
                    f"The base model is stored as PyTorch .bin ({len(files)} file(s)): each file is loaded whole "
                    "(not streamed), so RAM use is about the largest .bin file. Safetensors bases merge with less RAM."
                )
            return files
        raise MergeError(
            f"No model weights in {d}: expected model.safetensors, model.safetensors.index.json or "
            "pytorch_model.bin. Point --base at the folder of the original (unquantized) base model."
        )

    def _load_bin(self, file: Path) -> dict:
        if file not in self._bin:
            self._bin.clear()  # keep one .bin file in memory at a time
            try:
                sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:
                sd = torch.load(file, map_location="cpu", weights_only=True)  # legacy non-zip format: no mmap
            self._bin[file] = sd
        return self._bin[file]

    def read_rows(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor, in its stored dtype, as a fresh tensor. Safetensors are read with plain file reads of
        exactly those bytes (no mmap kept open), so the process's RSS grows only by the rows read."""
        info = self.tensors[key]
        if self.kind == "bin":
            t = self._load_bin(info.file)[key]
            return (t if not info.shape else t[start:stop]).clone()  # callers add in place: never a view
        if not info.shape:
            start, stop, row_shape = 0, 1, ()
        else:
            stop = info.shape[0] if stop is None else stop
            row_shape = info.shape[1:]
        t = torch.empty((stop - start) * math.prod(row_shape), dtype=ST_DTYPES[info.code])
        if t.numel():
            buf = t.view(torch.uint8).numpy()  # read straight into the tensor's memory: no extra copy
            with open(info.file, "rb") as f:
                f.seek(info.offset + start * buf.nbytes // (stop - start))
                if f.readinto(buf) != buf.nbytes:
                    raise MergeError(f"{info.file} is truncated: cannot read tensor {key}.")
        return t.reshape(info.shape if not info.shape else (stop - start, *row_shape))

    def raw_blocks(self, key: str) -> Iterator[bytes]:
        """The stored bytes of a tensor, in blocks (for tensors copied unchanged)."""
        info = self.tensors[key]
        if self.kind == "bin":
            yield _tensor_bytes(self._load_bin(info.file)[key])
            return
        left, pos = info.nbytes, info.offset
        with open(info.file, "rb") as f:
            f.seek(pos)
            while left:
                block = f.read(min(COPY_BLOCK, left))
                if not block:
                    raise MergeError(f"{info.file} is truncated: cannot read tensor {key}.")
                left -= len(block)
                yield block


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


# ----------------------------------------------------------------------------------------------------------
# Reading the adapter
# ----------------------------------------------------------------------------------------------------------


@dataclass
class LoraModule:
    name: str  # module path in the model, e.g. model.layers.0.self_attn.q_proj
    A: torch.Tensor | None = None  # fp32; Linear/Conv1D: (r, in); Embedding: (r, vocab)
    B: torch.Tensor | None = None  # fp32; Linear/Conv1D: (out, r); Embedding: (hidden, r)
    embedding: bool = False  # saved as lora_embedding_A/B
    magnitude: torch.Tensor | None = None  # DoRA
    bias: torch.Tensor | None = None  # lora_bias: lora_B's bias
    scale: float = 1.0
    kind: str = ""  # linear, conv1d, embedding: from the meta model

    @property
    def r(self) -> int:
        return self.A.shape[0]


@dataclass
class Adapter:
    dir: Path
    config: dict
    modules: dict[str, LoraModule]
    replacements: dict[
        str, torch.Tensor
    ]  # param key (model naming) -> full tensor (modules_to_save, base_layer)
    nbytes: int

    @property
    def use_dora(self) -> bool:
        return bool(self.config.get("use_dora"))


_LORA_KEY = re.compile(r"^(?P<mod>.+)\.(?P<part>lora_A|lora_B)\.(?P<param>weight|bias)$")
_EMB_KEY = re.compile(r"^(?P<mod>.+)\.(?P<part>lora_embedding_A|lora_embedding_B)$")
_MAG_KEY = re.compile(r"^(?P<mod>.+)\.lora_magnitude_vector(\.weight)?$")
_MTS_KEY = re.compile(r"^(?P<mod>.+)\.(?P<which>modules_to_save|original_module)\.(?P<param>[^.]+)$")
_BASE_LAYER_KEY = re.compile(r"^(?P<mod>.+)\.base_layer\.(?P<param>[^.]+)$")
_PREFIX = "base_model.model."


def _pattern_value(patterns: dict, module: str, default):
    """peft's get_pattern_key: a pattern applies when it matches the end of the module name at a dot."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def load_adapter(adapter_dir: str | os.PathLike) -> Adapter:
    d = Path(adapter_dir)
    cfg_path = d / "adapter_config.json"
    if not cfg_path.is_file():
        raise MergeError(f"{d} is not a peft adapter folder: adapter_config.json is missing.")
    cfg = json.loads(cfg_path.read_text())
    ptype = str(cfg.get("peft_type", "")).upper()
    if ptype != "LORA":
        raise MergeError(
            f"Adapter type {cfg.get('peft_type')!r} in {cfg_path} cannot be merged by this tool: only LoRA (and DoRA) "
            "adapters fold exactly into the base weights."
        )
    for key, what in UNSUPPORTED_FEATURES.items():
        if cfg.get(key):
            raise MergeError(
                f"The adapter uses {what} ({key}={cfg[key]!r} in {cfg_path}); this merge cannot fold that into "
                "plain weights exactly. Use the adapter unmerged with peft instead."
            )
    if cfg.get("use_dora") and cfg.get("lora_bias"):
        raise MergeError(f"DoRA together with lora_bias ({cfg_path}) is not supported by this merge.")

    if (d / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(d / "adapter_model.safetensors"))
    elif (d / "adapter_model.bin").is_file():
        state = torch.load(d / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise MergeError(
            f"No adapter weights in {d}: expected adapter_model.safetensors (or adapter_model.bin)."
        )

    modules: dict[str, LoraModule] = {}
    replacements: dict[str, torch.Tensor] = {}
    originals: dict[str, torch.Tensor] = {}
    nbytes = 0
    for key, t in state.items():
        nbytes += t.numel() * 4
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise MergeError(
                f"Adapter tensor {key!r} contains NaN or inf: the adapter is broken (diverged training?)."
            )
        if not key.startswith(_PREFIX):
            raise MergeError(
                f"Adapter tensor {key!r} does not start with {_PREFIX!r}: this is not a peft LoRA adapter for a "
                "causal LM saved with save_pretrained."
            )
        k = key[len(_PREFIX) :]
        if m := _LORA_KEY.match(k):
            mod = modules.setdefault(m["mod"], LoraModule(m["mod"]))
            if m["param"] == "bias":
                if m["part"] != "lora_B":
                    raise MergeError(f"Unexpected adapter tensor {key!r}: lora_A never has a bias.")
                mod.bias = t.float()
            elif m["part"] == "lora_A":
                mod.A = t.float()
            else:
                mod.B = t.float()
        elif m := _EMB_KEY.match(k):
            mod = modules.setdefault(m["mod"], LoraModule(m["mod"]))
            mod.embedding = True
            if m["part"] == "lora_embedding_A":
                mod.A = t.float()
            else:
                mod.B = t.float()
        elif m := _MAG_KEY.match(k):
            modules.setdefault(m["mod"], LoraModule(m["mod"])).magnitude = t.float()
        elif m := _MTS_KEY.match(k):
            # peft also saves the wrapper's own names when it saves embedding layers (resized vocabulary):
            # modules_to_save.* is the trained copy (same as the plain key), original_module.* the untrained base.
            target = f"{m['mod']}.{m['param']}"
            if m["which"] == "original_module":
                originals[target] = t
            elif target in replacements and not torch.equal(replacements[target], t):
                raise MergeError(
                    f"Adapter holds two different trained copies of {target}: cannot tell which is right."
                )
            else:
                replacements[target] = t
        elif m := _BASE_LAYER_KEY.match(k):
            # peft saved the base layer itself (embedding layers, possibly resized): it replaces the base tensor.
            replacements[f"{m['mod']}.{m['param']}"] = t
        elif "lora_" in k or "modules_to_save" in k or "token_adapter" in k or "trainable_tokens" in k:
            raise MergeError(
                f"Adapter tensor {key!r} is of a kind this merge does not know; refusing rather than writing a "
                "model that silently differs from the adapter."
            )
        else:
            if k in replacements and not torch.equal(replacements[k], t):
                raise MergeError(
                    f"Adapter holds two different trained copies of {k}: cannot tell which is right."
                )
            replacements[k] = t  # modules_to_save: a full trained copy of the module's parameter
    for k, t in originals.items():
        replacements.setdefault(
            k, t
        )  # an untrained (possibly resized) base copy counts only without a trained one

    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    for name, mod in modules.items():
        if mod.A is None or mod.B is None:
            raise MergeError(
                f"Adapter module {name} has only one of its LoRA A/B matrices: the adapter is incomplete."
            )
        r = mod.A.shape[0]  # read r from the shape: rank_pattern may differ per module
        if mod.B.shape[-1] != r:
            raise MergeError(f"Adapter module {name}: lora_A has rank {r} but lora_B has {mod.B.shape[-1]}.")
        expected_r = _pattern_value(rank_pattern, name, cfg.get("r", r))
        if expected_r != r:
            raise MergeError(
                f"Adapter module {name}: tensors have rank {r} but adapter_config.json says r={expected_r} "
                "(r/rank_pattern): the config and the weights do not belong together."
            )
        alpha = _pattern_value(alpha_pattern, name, cfg.get("lora_alpha", 8))
        mod.scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        if cfg.get("use_dora") and mod.magnitude is None:
            raise MergeError(
                f"DoRA adapter module {name} has no lora_magnitude_vector: the adapter is incomplete."
            )
    return Adapter(d, cfg, modules, replacements, nbytes)


# ----------------------------------------------------------------------------------------------------------
# Planning: which output tensor comes from which base tensor and adapter pieces
# ----------------------------------------------------------------------------------------------------------


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
        return math.prod(self.shape) * _itemsize(self.out_code)

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
    config = json.loads(cfg_path.read_text())
    quant = config.get("quantization_config")
    if quant:
        raise MergeError(
            f"The base model in {base_dir} is stored quantized ({quant.get('quant_method', 'quantized')}): its "
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


# ----------------------------------------------------------------------------------------------------------
# Computing merged tensors
# ----------------------------------------------------------------------------------------------------------


def _add_delta_(w: torch.Tensor, mod: LoraModule, start: int, stop: int) -> torch.Tensor:
    """Add rows [start, stop) of the scaled LoRA delta to `w` (fp32, stored orientation), in place: one fused
    matmul-add, no full-size temporary."""
    A, B = mod.A.to(w.device), mod.B.to(w.device)
    if mod.kind == "linear":
        return w.addmm_(B[start:stop], A, alpha=mod.scale)  # W (out, in) += s * B A
    # Conv1D stores W^T; embedding LoRA is applied as A^T B^T
    return w.addmm_(A[:, start:stop].T, B.T, alpha=mod.scale)


def merged_blocks(plan: TensorPlan, base: BaseCheckpoint, device="cpu") -> Iterator[torch.Tensor]:
    """The output tensor as row blocks in the output dtype (fp32 math, one rounding)."""
    out_dtype = ST_DTYPES[plan.out_code]
    rows = plan.shape[0] if plan.shape else 1
    row_elems = math.prod(plan.shape[1:]) if plan.shape else 1
    mod = plan.lora
    whole = (
        mod is not None and mod.magnitude is not None and mod.kind == "conv1d"
    )  # DoRA norm is per column here
    step = rows if whole else max(1, CHUNK_BYTES // max(1, row_elems * 4))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if plan.replacement is not None:
            w = plan.replacement[start:stop] if plan.shape else plan.replacement
            # a copy: the in-place add below must never touch the adapter's own tensor
            w = w.to(device=device, dtype=torch.float32, copy=True)
        else:
            w = base.read_rows(plan.src_key, start, stop).to(device=device, dtype=torch.float32)
        if mod is not None:
            w = _add_delta_(w, mod, start, stop)
            if mod.magnitude is not None:  # DoRA: W' = m / ||W + dW|| (per output feature) * (W + dW)
                mag = mod.magnitude.to(device)
                if mod.kind == "linear":
                    w = w * (mag[start:stop] / torch.linalg.norm(w, dim=1)).unsqueeze(1)
                else:
                    w = w * (mag / torch.linalg.norm(w, dim=0)).unsqueeze(0)
        if plan.bias_of is not None:
            w = w + plan.bias_of.bias.to(device)[start:stop] * plan.bias_of.scale
        # Inputs were checked to be finite (adapter at load); only fp16 can overflow on the way out.
        if out_dtype == torch.float16 and w.abs().max().item() > torch.finfo(torch.float16).max:
            raise MergeError(
                f"The merged tensor {plan.out_key} overflows float16: export with --dtype bf16 or fp32."
            )
        yield w.to(out_dtype).to("cpu")


def _tensor_stream(plan: TensorPlan, base: BaseCheckpoint, device) -> Iterator[memoryview | bytes]:
    src = base.tensors[plan.src_key]
    if not plan.changed and src.code == plan.out_code:
        yield from base.raw_blocks(plan.src_key)  # unchanged: copy the stored bytes
    else:
        for block in merged_blocks(plan, base, device):
            yield _tensor_bytes(block)


def _write_shard(
    path: Path,
    tensors: list[TensorPlan],
    base: BaseCheckpoint,
    device,
    on_tensor: Callable[[TensorPlan, int], None],
) -> None:
    """Write one safetensors file, streaming each tensor's bytes: the header is known up front from the plan,
    so no output shard is ever held in memory."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.out_key] = {
            "dtype": t.out_code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # safetensors pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for t in tensors:
            written = 0
            for chunk in _tensor_stream(t, base, device):
                f.write(chunk)
                written += len(chunk)
            if written != t.nbytes:
                raise MergeError(
                    f"Internal error: {t.out_key} produced {written} bytes, expected {t.nbytes}."
                )
            on_tensor(t, written)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------
# Preflight
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Preflight:
    base_dir: str
    adapter_dir: str
    target: str
    out_dtype: str
    n_tensors: int
    n_lora_modules: int
    n_replaced: int
    n_shards: int
    base_bytes: int
    adapter_bytes: int
    out_bytes: int
    largest_tensor_bytes: int
    ram_available: int
    ram_needed: int
    verify_ram_needed: int
    disk_free: int
    disk_needed: int
    verify_mode: str
    qlora: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        return [
            f"base: {self.base_dir} ({_gb(self.base_bytes)}), adapter: {self.adapter_dir} ({self.n_lora_modules} "
            f"LoRA modules, {self.n_replaced} replaced tensors)",
            f"output: {self.target} — {self.n_tensors} tensors, {_gb(self.out_bytes)} in {self.out_dtype}, "
            f"{self.n_shards} shard(s)",
            f"RAM: need ~{_gb(self.ram_needed)} to merge, {_gb(self.verify_ram_needed)} for the logits check; "
            f"{_gb(self.ram_available)} available",
            f"disk: need {_gb(self.disk_needed)}, {_gb(self.disk_free)} free",
            f"verification: {self.verify_mode}",
        ]


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / MB:.1f} MB"


def _read_yaml(path: Path) -> dict:
    try:
        import yaml

        data = yaml.safe_load(path.read_text())
        return data if isinstance(data, dict) else {}
    except Exception:
        return {}


def run_config_for(adapter_dir: Path) -> dict:
    """The run's config.yaml when the adapter lives in a run directory (runs/<name>/adapter), else {}."""
    for cand in (adapter_dir / "config.yaml", adapter_dir.parent / "config.yaml"):
        if cand.is_file():
            return _read_yaml(cand)
    return {}


def is_qlora(adapter_dir: Path) -> bool:
    """True when the run config says the base was loaded in 4 bit (QLoRA)."""
    q = run_config_for(adapter_dir).get("quantization")
    if isinstance(q, str):
        return q.lower() in ("nf4", "fp4", "4bit", "4-bit", "qlora", "int4")
    if isinstance(q, dict):
        if q.get("load_in_4bit") or q.get("bits") == 4:
            return True
        for k in ("mode", "type", "method", "quant_type", "kind"):
            if str(q.get(k, "")).lower() in ("nf4", "fp4", "4bit", "4-bit", "qlora", "int4"):
                return True
    return False


def _pid_alive(pid: int) -> bool:
    return pid != os.getpid() and psutil.pid_exists(pid)


def clean_stale_temps(target: Path) -> list[Path]:
    """Remove temp folders of earlier merges into `target` whose process is gone. Only folders carrying our
    marker file are touched, so nothing the user made is ever deleted."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for p in target.parent.glob(f".{target.name}.merging-*"):
        marker = p / TEMP_MARKER
        if not marker.is_file():
            continue
        try:
            pid = int(json.loads(marker.read_text()).get("pid", -1))
        except (ValueError, OSError):
            pid = -1
        if not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _tokenizer_source(adapter_dir: Path, base_dir: Path) -> Path:
    # A run's adapter folder carries the tokenizer it trained with (maybe with added tokens): prefer it.
    return adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir


def preflight(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    shard_size: int | str = "5GB",
    workspace: str | os.PathLike | None = None,
    verify: str = "auto",
) -> tuple[Preflight, MergePlan]:
    """Check everything before writing anything. Structural problems (bad adapter, wrong base) raise
    MergeError; resource problems (RAM, disk, existing target) are listed in `problems` with the numbers."""
    ws = Path(workspace) if workspace else default_workspace()
    try:
        target = inside(ws, out_dir)
    except WorkspaceError as e:
        raise MergeError(f"Output folder: {e}") from e
    base_dir, adapter_dir = Path(base_dir).expanduser().resolve(), Path(adapter_dir).expanduser().resolve()
    if not base_dir.is_dir():
        raise MergeError(f"Base model folder {base_dir} does not exist.")
    if not adapter_dir.is_dir():
        raise MergeError(f"Adapter folder {adapter_dir} does not exist.")
    if verify not in ("auto", "full", "quick"):
        raise MergeError(f"verify must be auto, full or quick, not {verify!r}.")
    adapter = load_adapter(adapter_dir)
    plan = plan_merge(base_dir, adapter, dtype, shard_size)

    problems: list[str] = []
    notes = list(plan.base.warnings) + list(plan.notes)
    if target.exists():
        problems.append(
            f"The target {target} already exists: choose a new folder name (an export is never overwritten)."
        )
    if target in (base_dir, adapter_dir) or base_dir in target.parents or adapter_dir in target.parents:
        problems.append(
            f"The target {target} lies inside the base or adapter folder: choose a folder under exports/."
        )

    qlora = is_qlora(adapter_dir)
    if qlora:
        notes.append(
            "QLoRA adapter: it was trained against the 4-bit (NF4) dequantized weights, but it is merged into the "
            "bf16/fp16 base, the usual choice. The merged model is therefore not bit-identical to what training saw; "
            "expect a small deviation (the verification compares against base+adapter at full precision)."
        )
    largest = max((t.nbytes for t in plan.tensors), default=0)
    largest_src = max((t.nbytes for t in plan.base.tensors.values()), default=0)
    chunk = min(CHUNK_BYTES, max(largest_src, largest) * 4)
    ram_needed = adapter.nbytes + 4 * chunk + RUNTIME_OVERHEAD
    if plan.base.kind == "bin":
        ram_needed += plan.base.largest_file_bytes
    n_params = sum(math.prod(t.shape) for t in plan.tensors)
    verify_ram = n_params * 4 + adapter.nbytes + RUNTIME_OVERHEAD  # one fp32 model at a time
    ram_available = psutil.virtual_memory().available
    if ram_needed > ram_available:
        problems.append(
            f"Not enough free RAM: the merge needs about {_gb(ram_needed)}, {_gb(ram_available)} is available. "
            "Close other programs, or merge on a machine with more memory."
        )
    if verify == "auto":
        verify = "full" if verify_ram < 0.8 * ram_available else "quick"
        if verify == "quick":
            notes.append(
                f"The logits check needs ~{_gb(verify_ram)} RAM but {_gb(ram_available)} is available: only the quick "
                "check (every tensor re-read, merged rows recomputed, config and tokenizer loaded) will run."
            )
    probe = target.parent
    while not probe.exists():
        probe = probe.parent
    disk_free = shutil.disk_usage(probe).free
    tok_dir = _tokenizer_source(adapter_dir, base_dir)
    small = sum((tok_dir / n).stat().st_size for n in TOKENIZER_FILES if (tok_dir / n).is_file())
    disk_needed = plan.out_bytes + small + 64 * MB
    if disk_needed > disk_free:
        problems.append(
            f"Not enough free disk at {probe}: the export needs {_gb(disk_needed)}, {_gb(disk_free)} is free."
        )
    pf = Preflight(
        base_dir=str(base_dir),
        adapter_dir=str(adapter_dir),
        target=str(target),
        out_dtype=DTYPE_NAMES[plan.out_dtype],
        n_tensors=len(plan.tensors),
        n_lora_modules=len(adapter.modules),
        n_replaced=len(adapter.replacements),
        n_shards=len(plan.shards),
        base_bytes=plan.base.total_bytes,
        adapter_bytes=adapter.nbytes,
        out_bytes=plan.out_bytes,
        largest_tensor_bytes=largest,
        ram_available=ram_available,
        ram_needed=ram_needed,
        verify_ram_needed=verify_ram,
        disk_free=disk_free,
        disk_needed=disk_needed,
        verify_mode=verify,
        qlora=qlora,
        problems=problems,
        notes=notes,
    )
    return pf, plan


# ----------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Verification:
    mode: str  # full or quick
    passed: bool
    dtype: str
    messages: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None  # merged vs base+adapter (peft, unmerged), logits
    tolerance: float | None = None
    adapter_effect: float | None = None  # base+adapter vs base, logits
    merged_vs_base: float | None = None
    argmax_agreement: float | None = None
    spot_check_max_diff: float | None = None
    model_loads: bool | None = None
    tokenizer_loads: bool | None = None
    qlora_deviation: float | None = (
        None  # merged vs the adapter on the NF4-quantized base (what training saw)
    )

    def lines(self) -> list[str]:
        out = [f"verification ({self.mode}): {'PASSED' if self.passed else 'FAILED'}"]
        if self.max_abs_diff is not None:
            out.append(
                f"max |logits merged - base+adapter| = {self.max_abs_diff:.3g} (tolerance {self.tolerance:.3g}, "
                f"{self.dtype}); adapter effect max |Δ| = {self.adapter_effect:.3g}; merged vs base = "
                f"{self.merged_vs_base:.3g}; argmax agreement {self.argmax_agreement:.1%}"
            )
        if self.qlora_deviation is not None:
            out.append(
                f"QLoRA: max |logits merged - adapter on the 4-bit base| = {self.qlora_deviation:.3g} (expected, "
                "not an error: training saw NF4-rounded weights, the export holds the full-precision base)"
            )
        if self.spot_check_max_diff is not None:
            out.append(
                f"spot check of merged rows re-read from disk: max |Δ| = {self.spot_check_max_diff:.3g}"
            )
        return out + self.messages


def _prompt_ids(tokenizer, vocab_size: int) -> list[torch.Tensor]:
    ids = []
    for p in DEFAULT_PROMPTS:
        if tokenizer is not None:
            t = tokenizer(p, return_tensors="pt")["input_ids"]
        else:
            t = torch.tensor([[(ord(c) * 7) % vocab_size for c in p]])
        ids.append(t.clamp(max=vocab_size - 1))
    return ids


@torch.no_grad()
def _logits(model, prompts, device) -> list[torch.Tensor]:
    return [model(input_ids=p.to(device)).logits.float().cpu() for p in prompts]


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def verify_export(
    plan: MergePlan, out_dir: Path, mode: str = "full", device: str = "cpu", qlora: bool = False
) -> Verification:
    """Check the written export. quick: every shard's header matches the plan, merged rows re-read and compared
    with a recomputation, config and tokenizer load. full: also logits of the merged model (loaded with
    AutoModelForCausalLM) against the base with the adapter applied by peft (unmerged), on fixed prompts."""
    from safetensors import safe_open
    from transformers import AutoConfig

    out_dtype = plan.out_dtype
    v = Verification(mode=mode, passed=True, dtype=DTYPE_NAMES[out_dtype])

    # Structure: every planned tensor is present with its shape and dtype.
    for shard, tensors in plan.shards:
        header, _ = read_safetensors_header(out_dir / shard)
        if header.get("__metadata__", {}).get("format") != "pt":
            v.passed = False
            v.messages.append(f"{shard} lacks the {{'format': 'pt'}} metadata.")
        for t in tensors:
            h = header.get(t.out_key)
            if h is None or tuple(h["shape"]) != tuple(t.shape) or h["dtype"] != t.out_code:
                v.passed = False
                v.messages.append(f"{shard}: tensor {t.out_key} is missing or has the wrong shape/dtype.")
    # Spot check: the first and last rows of each merged tensor, re-read through safe_open.
    worst, worst_scale = 0.0, 0.0
    shard_of = {t.out_key: s for s, ts in plan.shards for t in ts}
    for t in plan.tensors:
        if not t.changed:
            continue
        with safe_open(str(out_dir / shard_of[t.out_key]), "pt") as f:
            sl = f.get_slice(t.out_key)
            rows = t.shape[0] if t.shape else 1
            for start in {0, max(0, rows - 2)}:
                stop = min(rows, start + 2)
                got = (sl[start:stop] if t.shape else f.get_tensor(t.out_key)).float()
                want = _recompute_rows(t, plan.base, start, stop)
                if want.numel():
                    worst = max(worst, (got.reshape(want.shape) - want).abs().max().item())
                    worst_scale = max(worst_scale, want.abs().max().item())
    v.spot_check_max_diff = worst
    # A block matmul may differ from the full one in the last bit, then round one ulp apart; a corrupt write
    # (wrong offset, wrong dtype) is off by the size of the weights themselves.
    spot_tol = 4 * torch.finfo(out_dtype).eps * (1 + worst_scale)
    if worst > spot_tol:
        v.passed = False
        v.messages.append(
            "Merged rows read back from disk differ from their recomputation: the export is corrupt."
        )

    try:
        AutoConfig.from_pretrained(str(out_dir))
    except Exception as e:
        v.passed = False
        v.messages.append(f"config.json does not load with AutoConfig: {e}")
    tokenizer = None
    if (out_dir / "tokenizer_config.json").is_file():
        try:
            tokenizer = _load_tokenizer(out_dir)
            v.tokenizer_loads = True
        except Exception as e:
            v.passed, v.tokenizer_loads = False, False
            v.messages.append(f"The tokenizer does not load with AutoTokenizer: {type(e).__name__}: {e}")
    else:
        v.messages.append(
            "No tokenizer files were found in the adapter or base folder: the export has no tokenizer."
        )

    if mode != "full" or not v.passed:
        return v

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    vocab = plan.config.get("vocab_size") or 32
    prompts = _prompt_ids(tokenizer, vocab)
    device = _logits_device(plan, device, v)
    try:
        base_model = AutoModelForCausalLM.from_pretrained(str(plan.base_dir), dtype=torch.float32).to(device)
        if plan.new_vocab_size:  # as in training: resized first, the adapter then brings the trained rows
            base_model.resize_token_embeddings(plan.new_vocab_size, mean_resizing=False)
        peft_model = PeftModel.from_pretrained(base_model, str(plan.adapter.dir)).to(device).eval()
        ref = _logits(peft_model, prompts, device)
        with peft_model.disable_adapter():
            base_logits = _logits(peft_model, prompts, device)
        del peft_model, base_model
    except Exception as e:
        v.passed = False
        v.messages.append(f"Could not run the base with the adapter through peft: {type(e).__name__}: {e}")
        return v
    try:
        merged = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).to(device).eval()
        v.model_loads = True
        got = _logits(merged, prompts, device)
        del merged
    except Exception as e:
        v.passed, v.model_loads = False, False
        v.messages.append(f"The export does not load with AutoModelForCausalLM: {type(e).__name__}: {e}")
        return v
    if qlora:
        v.qlora_deviation = _qlora_deviation(plan, prompts, got, device, v)
    atol, rtol = TOLERANCES[out_dtype]
    scale = max(r.abs().max().item() for r in ref)
    v.tolerance = atol + rtol * scale
    v.max_abs_diff = max((g - r).abs().max().item() for g, r in zip(got, ref, strict=True))
    v.adapter_effect = max((r - b).abs().max().item() for r, b in zip(ref, base_logits, strict=True))
    v.merged_vs_base = max((g - b).abs().max().item() for g, b in zip(got, base_logits, strict=True))
    agree = [(g.argmax(-1) == r.argmax(-1)).float().mean().item() for g, r in zip(got, ref, strict=True)]
    v.argmax_agreement = sum(agree) / len(agree)
    if v.max_abs_diff > v.tolerance:
        v.passed = False
        v.messages.append(
            f"The merged model's logits differ from base+adapter by {v.max_abs_diff:.3g} (> {v.tolerance:.3g}): "
            "the merge is wrong. Please report this adapter/base pair."
        )
    if v.merged_vs_base <= v.tolerance:
        v.passed = False
        v.messages.append(
            f"The merged model is indistinguishable from the base (max |Δ| {v.merged_vs_base:.3g}): the adapter "
            "changes nothing (an untrained adapter, lora_B all zeros?)."
        )
    return v


def _logits_device(plan: MergePlan, device: str, v: Verification) -> str:
    """Where the logits check runs. It loads the whole model in float32 (4 bytes a parameter), which the merge
    itself never does: on a GPU that cannot hold it (a 7B model is ~28 GB, an RTX 4090 has 24) it runs on
    the CPU instead of failing the merge with CUDA out of memory. The preflight sized it for the RAM."""
    if device != "cuda":
        return device
    need = sum(math.prod(t.shape) for t in plan.tensors) * 4 + plan.adapter.nbytes
    try:
        torch.cuda.empty_cache()  # blocks the merge's deltas left cached count as taken in mem_get_info
        free, _total = torch.cuda.mem_get_info()
    except Exception:  # no figure: trust the GPU
        return device
    if need * 1.2 < free:  # activations and the allocator's rounding on top of the weights
        return device
    v.messages.append(
        f"The logits check needs ~{_gb(need)} of GPU memory in float32 but {_gb(free)} is free: it ran on the CPU."
    )
    return "cpu"


def _qlora_deviation(plan: MergePlan, prompts, merged_logits, device: str, v: Verification) -> float | None:
    """How far the export is from what QLoRA training saw: the adapter on the NF4-quantized base. A figure to
    report, not a pass/fail check (the usual merge into the full-precision base is never bit-identical)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        q = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(plan.base_dir), quantization_config=q, dtype=torch.float32, device_map={"": device}
        )
        model = PeftModel.from_pretrained(model, str(plan.adapter.dir)).eval()
        ref = _logits(model, prompts, device)
        del model
    except Exception as e:  # bitsandbytes missing or unsupported here: the figure is optional
        v.messages.append(f"QLoRA deviation not measured ({type(e).__name__}: {e}).")
        return None
    return max((g - r).abs().max().item() for g, r in zip(merged_logits, ref, strict=True))


def _recompute_rows(t: TensorPlan, base: BaseCheckpoint, start: int, stop: int) -> torch.Tensor:
    """Expected output rows [start, stop), recomputed from the base and the adapter (not from the written file)."""
    if t.lora is not None and t.lora.magnitude is not None and t.lora.kind == "conv1d":
        return next(merged_blocks(t, base))[start:stop].float()  # DoRA on Conv1D needs whole columns
    if t.replacement is not None:
        w = (t.replacement[start:stop] if t.shape else t.replacement).float()
    else:
        w = base.read_rows(t.src_key, start, stop).float()
    if t.lora is not None:
        w = (
            w.clone()
            + (
                t.lora.B[start:stop] @ t.lora.A
                if t.lora.kind == "linear"
                else t.lora.A[:, start:stop].T @ t.lora.B.T
            )
            * t.lora.scale
        )
        if t.lora.magnitude is not None:
            w = w * (t.lora.magnitude[start:stop] / torch.linalg.norm(w, dim=1)).unsqueeze(1)
    if t.bias_of is not None:
        w = w + t.bias_of.bias[start:stop] * t.bias_of.scale
    return w.to(ST_DTYPES[t.out_code]).float()


# ----------------------------------------------------------------------------------------------------------
# The merge
# ----------------------------------------------------------------------------------------------------------


@dataclass
class MergeResult:
    out_dir: str
    preflight: Preflight
    verification: Verification
    files: list[tuple[str, int]]
    total_bytes: int
    seconds: float
    peak_rss: int

    def to_dict(self) -> dict:
        return asdict(self)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_small_files(plan: MergePlan, tmp: Path) -> None:
    (tmp / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")
    tok_dir = _tokenizer_source(plan.adapter.dir, plan.base_dir)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, tmp / name)
    if (plan.base_dir / "generation_config.json").is_file():
        shutil.copyfile(plan.base_dir / "generation_config.json", tmp / "generation_config.json")
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": plan.out_bytes},  # bytes, as transformers expects
            "weight_map": {t.out_key: name for name, ts in plan.shards for t in ts},
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for p in tmp.iterdir():
        if p.is_file() and p.name != TEMP_MARKER:
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def merge(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    shard_size: int | str = "5GB",
    device: str = "cpu",
    verify: str = "auto",
    workspace: str | os.PathLike | None = None,
    progress: ProgressFn | None = None,
    on_preflight: Callable[[Preflight], None] | None = None,
) -> MergeResult:
    """Merge `adapter_dir` into `base_dir` and export to `out_dir` (inside the workspace). Raises MergeError
    with a sentence saying what to fix; on any failure nothing is left at `out_dir`."""
    started = time.time()
    if device not in ("cpu", "cuda"):
        raise MergeError(f"Device {device!r} is not supported: use cpu or cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise MergeError("--device cuda was asked for but PyTorch sees no CUDA GPU: use --device cpu.")
    ws = Path(workspace) if workspace else default_workspace()
    try:
        target = inside(ws, out_dir)
    except WorkspaceError as e:
        raise MergeError(f"Output folder: {e}") from e
    clean_stale_temps(target)
    pf, plan = preflight(base_dir, adapter_dir, target, dtype, shard_size, ws, verify)
    if on_preflight:
        on_preflight(pf)
    if not pf.ok:
        raise MergeError(" ".join(pf.problems))

    proc = psutil.Process()
    peak = proc.memory_info().rss
    total_tensors, total_bytes = len(plan.tensors), plan.out_bytes
    done = {"tensors": 0, "bytes": 0}

    def report(phase: str, key: str = "") -> None:
        if progress:
            progress(MergeProgress(phase, done["tensors"], total_tensors, done["bytes"], total_bytes, key))

    def on_tensor(t: TensorPlan, n: int) -> None:
        nonlocal peak
        done["tensors"] += 1
        done["bytes"] += n
        peak = max(peak, proc.memory_info().rss)
        report("merge", t.out_key)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.merging-{os.getpid()}"
    tmp.mkdir()
    (tmp / TEMP_MARKER).write_text(
        json.dumps({"pid": os.getpid(), "target": str(target), "started": started})
    )
    ok = False
    try:
        report("merge")
        for i, (name, tensors) in enumerate(plan.shards):
            _write_shard(tmp / name, tensors, plan.base, device, on_tensor)
            if i == 0 and os.environ.get(PAUSE_ENV):
                (tmp / ".paused").write_text("paused after the first shard (test hook)")
                time.sleep(float(os.environ[PAUSE_ENV]))
        _write_small_files(plan, tmp)
        report("verify")
        verification = verify_export(plan, tmp, pf.verify_mode, device, qlora=pf.qlora)
        peak = max(peak, proc.memory_info().rss)
        if not verification.passed:
            raise MergeError("Verification failed, nothing was exported: " + " ".join(verification.messages))
        (tmp / TEMP_MARKER).unlink()
        (tmp / ".paused").unlink(missing_ok=True)
        _fsync_dir(tmp)
        if target.exists():
            raise MergeError(f"The target {target} appeared while merging: not overwriting it.")
        os.rename(tmp, target)
        _fsync_dir(target.parent)
        ok = True
    finally:
        if not ok:
            shutil.rmtree(tmp, ignore_errors=True)
    files = sorted((p.name, p.stat().st_size) for p in target.iterdir() if p.is_file())
    report("done")
    return MergeResult(
        out_dir=str(target),
        preflight=pf,
        verification=verification,
        files=files,
        total_bytes=sum(s for _, s in files),
        seconds=time.time() - started,
        peak_rss=peak,
    )


# ----------------------------------------------------------------------------------------------------------
# Try it: base vs adapter, same prompt
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TryResult:
    prompt: str
    base_text: str
    adapter_text: str
    seconds: float


def try_adapter(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    prompt: str,
    max_new_tokens: int = 48,
    device: str = "cpu",
    chat: bool = True,
) -> TryResult:
    """Greedy generation from one prompt with the base and with the adapter (one model load, adapter toggled)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    if not prompt or not prompt.strip():
        raise MergeError("The prompt is empty: type something for both models to continue.")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise MergeError(f"{adapter_dir} is not a peft adapter folder: adapter_config.json is missing.")
    if not (base_dir / "config.json").is_file():
        raise MergeError(f"{base_dir} has no config.json: choose the base model folder.")
    load_adapter(adapter_dir)  # refuse unknown adapter types with our message
    tokenizer = _load_tokenizer(_tokenizer_source(adapter_dir, base_dir))
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).to(device)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto").to(device)
    model = PeftModel.from_pretrained(model, str(adapter_dir)).to(device).eval()
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    n = ids["input_ids"].shape[1]
    with torch.no_grad():
        with model.disable_adapter():
            base_out = model.generate(**ids, **kwargs)
        adapter_out = model.generate(**ids, **kwargs)
    return TryResult(
        prompt=text,
        base_text=tokenizer.decode(base_out[0, n:], skip_special_tokens=True),
        adapter_text=tokenizer.decode(adapter_out[0, n:], skip_special_tokens=True),
        seconds=time.time() - t0,
    )


# ----------------------------------------------------------------------------------------------------------
# Finding adapters and their base (for the page)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class AdapterChoice:
    run: str | None
    adapter_dir: str
    base_dir: str | None
    state: str | None
    base_note: str


def guess_base(adapter_dir: str | os.PathLike) -> tuple[str | None, str]:
    """(base folder or None, where it came from): the run's config.yaml `model` section, else
    adapter_config.json's base_model_name_or_path, when that folder exists locally."""
    d = Path(adapter_dir)
    model = run_config_for(d).get("model")
    cands: list[tuple[str, str]] = []
    if isinstance(model, str):
        cands.append((model, "run config.yaml"))
    elif isinstance(model, dict):
        for k in ("path", "name_or_path", "base", "base_model", "name", "id"):
            if isinstance(model.get(k), str):
                cands.append((model[k], f"run config.yaml model.{k}"))
    try:
        cfg = json.loads((d / "adapter_config.json").read_text())
        if cfg.get("base_model_name_or_path"):
            cands.append((cfg["base_model_name_or_path"], "adapter_config.json"))
    except (OSError, ValueError):
        pass
    for path, source in cands:
        p = Path(path).expanduser()
        if (p / "config.json").is_file():
            return str(p.resolve()), source
    if cands:
        return (
            None,
            f"{cands[0][0]!r} (from {cands[0][1]}) is not a local model folder: enter the base folder.",
        )
    return None, "the adapter does not name its base model: enter the base folder."


def list_adapters(workspace: str | os.PathLike) -> list[AdapterChoice]:
    """Finished (and other) runs with a saved adapter: <workspace>/runs/*/adapter/adapter_config.json."""
    out = []
    for cfg in sorted(Path(workspace).glob("runs/*/adapter/adapter_config.json")):
        adapter = cfg.parent
        state = None
        with contextlib.suppress(OSError, ValueError):
            state = json.loads((adapter.parent / "status.json").read_text()).get("state")
        base, note = guess_base(adapter)
        out.append(AdapterChoice(adapter.parent.name, str(adapter), base, state, note))
    return out


def suggest_export_name(source: str, workspace: str | os.PathLike) -> str:
    """`<source>-merged`, numbered when that export already exists (never proposes an existing folder)."""
    from core.workspace import suggest_run_name

    stem = suggest_run_name(f"{source}-merged")[:56]
    exports = Path(workspace) / "exports"
    name, n = stem, 2
    while (exports / name).exists():
        name, n = f"{stem}-{n}", n + 1
    return name


def folder_listing(path: str | os.PathLike) -> tuple[list[tuple[str, int]], int]:
    files = sorted((p.name, p.stat().st_size) for p in Path(path).iterdir() if p.is_file())
    return files, sum(s for _, s in files)


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m core.merge",
        description="Merge a LoRA adapter into its base model, shard by shard, verified, written atomically.",
    )
    ap.add_argument("--base", required=True, help="folder of the base model (safetensors or .bin)")
    ap.add_argument("--adapter", required=True, help="peft adapter folder (adapter_config.json + weights)")
    ap.add_argument(
        "--out", required=True, help="new export folder, inside the workspace (never overwritten)"
    )
    ap.add_argument(
        "--dtype", choices=sorted(DTYPE_ARGS), default=None, help="output dtype (default: the base's)"
    )
    ap.add_argument("--shard-size", default="5GB", help="maximum size of an output shard (default 5GB)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the deltas are computed")
    ap.add_argument(
        "--verify",
        choices=["auto", "full", "quick"],
        default="auto",
        help="full: logits vs base+adapter (needs RAM for one fp32 model); quick: structure and spot checks",
    )
    args = ap.parse_args(argv)
    # The CLI prints its own progress and verdict; library progress bars and advisory warnings are noise here.
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)

    state = {"last": -1.0}

    def progress(p: MergeProgress) -> None:
        if p.phase == "merge" and p.tensors_total:
            frac = p.tensors_done / p.tensors_total
            if frac - state["last"] >= 0.1 or p.tensors_done == p.tensors_total:
                state["last"] = frac
                print(
                    f"  merged {p.tensors_done}/{p.tensors_total} tensors, {_gb(p.bytes_written)} written",
                    file=sys.stderr,
                )
        elif p.phase == "verify":
            print("  verifying ...", file=sys.stderr)

    def show_preflight(pf: Preflight) -> None:
        print("preflight:")
        for line in pf.lines():
            print("  " + line)
        for note in pf.notes:
            print("  note: " + note)
        sys.stdout.flush()

    try:
        result = merge(
            args.base,
            args.adapter,
            args.out,
            args.dtype,
            args.shard_size,
            args.device,
            args.verify,
            progress=progress,
            on_preflight=show_preflight,
        )
    except (MergeError, WorkspaceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in result.verification.lines():
        print(line)
    print(
        f"exported {result.out_dir}: {len(result.files)} files, {_gb(result.total_bytes)}, in {result.seconds:.1f} s"
    )
    print(f"peak RSS {_gb(result.peak_rss)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
