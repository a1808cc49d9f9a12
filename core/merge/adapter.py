"""Reading a peft LoRA adapter: its config, its tensors mapped to module names, and what cannot be merged."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from core.merge.errors import MergeError, load_json
from core.merge.shards import read_safetensors_header

RESAVE = "re-save the adapter with peft's save_pretrained, or copy its folder again."

# adapter_config fields whose adapters cannot be folded into plain weights exactly.
UNSUPPORTED_FEATURES = {
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
    # LoRA on parameters (target_parameters: a MoE model's experts, a router's weight): peft's ParamWrapper pairs by
    # module name, attached to the checkpoint's tensors by core.merge.experts
    params: dict[str, LoraModule] = field(default_factory=dict)

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
    """The peft LoRA adapter in `adapter_dir`, every tensor in fp32 and mapped to its module; anything that
    cannot be folded into plain weights exactly is a MergeError saying why."""
    d = Path(adapter_dir)
    cfg = _read_config(d)
    modules, replacements, nbytes = _sort_tensors(_read_weights(d))
    _set_scales(modules, cfg)
    return Adapter(d, cfg, modules, replacements, nbytes)


def _read_config(d: Path) -> dict:
    """adapter_config.json, refused unless it is a complete LoRA config without unsupported features."""
    if not d.is_dir():
        raise MergeError(
            f"Adapter folder {d} does not exist: point --adapter at the folder holding adapter_config.json "
            "(a run's adapter/ folder)."
        )
    cfg_path = d / "adapter_config.json"
    if not cfg_path.is_file():
        raise MergeError(f"{d} is not a peft adapter folder: adapter_config.json is missing.")
    cfg = load_json(cfg_path, RESAVE)
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
    # Every LoRA config peft saves has both; without them the file is not the config of these weights.
    r = cfg.get("r")
    if r is None:
        raise MergeError(f"{cfg_path} has no 'r' (the LoRA rank): it is incomplete; {RESAVE}")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or r < 1 or r != int(r):
        raise MergeError(f"{cfg_path} has r={r!r}, not a positive whole number: {RESAVE}")
    targets = cfg.get("target_modules")
    if targets is None:
        raise MergeError(f"{cfg_path} has no 'target_modules': it is incomplete; {RESAVE}")
    if not isinstance(targets, (str, list)):
        raise MergeError(f"{cfg_path} has target_modules={targets!r}, not a name or a list: {RESAVE}")
    return cfg


def check_adapter(adapter_dir: str | os.PathLike) -> None:
    """MergeError (one sentence) unless `adapter_dir` holds a complete LoRA adapter: its config and its weights
    file, read from the safetensors header alone. What a command taking --adapter checks before it loads a model
    or trains anything."""
    d = Path(adapter_dir)
    _read_config(d)
    _weights_file(d)


def _weights_file(d: Path) -> Path:
    """adapter_model.safetensors (its header checked) or adapter_model.bin."""
    st_path, bin_path = d / "adapter_model.safetensors", d / "adapter_model.bin"
    if st_path.is_file():
        read_safetensors_header(st_path, RESAVE)  # truncated or corrupt: one sentence, not the library trace
        return st_path
    if not bin_path.is_file():
        raise MergeError(
            f"No adapter weights in {d}: expected adapter_model.safetensors (or adapter_model.bin)."
        )
    return bin_path


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors from adapter_model.safetensors (or .bin); a broken file is one sentence."""
    path = _weights_file(d)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as e:
            raise MergeError(f"{path} cannot be read ({e}): {RESAVE}") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, pickle errors, ...
        raise MergeError(f"{path} cannot be read ({type(e).__name__}: {e}): {RESAVE}") from e
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise MergeError(f"{path} does not hold a dict of tensors: {RESAVE}")
    return state


def _sort_tensors(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, LoraModule], dict[str, torch.Tensor], int]:
    """(LoRA modules, replacement tensors, fp32 bytes): each saved tensor to the module it belongs to."""
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
        _sort_tensor(key, key[len(_PREFIX) :], t, modules, replacements, originals)
    for k, t in originals.items():
        # an untrained (possibly resized) base copy counts only without a trained one
        replacements.setdefault(k, t)
    return modules, replacements, nbytes


def _sort_tensor(
    key: str,
    k: str,
    t: torch.Tensor,
    modules: dict[str, LoraModule],
    replacements: dict[str, torch.Tensor],
    originals: dict[str, torch.Tensor],
) -> None:
    """One saved tensor (`key`, `k` without the peft prefix) into `modules`, `replacements` or `originals`."""
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
        else:
            _add_trained_copy(replacements, target, t)
    elif m := _BASE_LAYER_KEY.match(k):
        # peft saved the base layer itself (embedding layers, possibly resized): it replaces the base tensor.
        replacements[f"{m['mod']}.{m['param']}"] = t
    elif "lora_" in k or "modules_to_save" in k or "token_adapter" in k or "trainable_tokens" in k:
        raise MergeError(
            f"Adapter tensor {key!r} is of a kind this merge does not know; refusing rather than writing a "
            "model that silently differs from the adapter."
        )
    else:
        _add_trained_copy(
            replacements, k, t
        )  # modules_to_save: a full trained copy of the module's parameter


def _add_trained_copy(replacements: dict[str, torch.Tensor], target: str, t: torch.Tensor) -> None:
    if target in replacements and not torch.equal(replacements[target], t):
        raise MergeError(
            f"Adapter holds two different trained copies of {target}: cannot tell which is right."
        )
    replacements[target] = t


def _set_scales(modules: dict[str, LoraModule], cfg: dict) -> None:
    """Check each module is complete and its rank agrees with the config; set its scale (alpha / r, rsLoRA:
    alpha / sqrt(r)) from lora_alpha and the rank/alpha patterns."""
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
        if cfg.get("target_parameters") and (".base_layer" in name or expected_r != r):
            mod.scale = (
                None  # a wrapped parameter's pair (its rank counts experts): core.merge.experts decides
            )
            continue
        if expected_r != r:
            raise MergeError(
                f"Adapter module {name}: tensors have rank {r} but adapter_config.json says r={expected_r} "
                "(r/rank_pattern): the config and the weights do not belong together."
            )
        alpha = _pattern_value(alpha_pattern, name, cfg.get("lora_alpha", 8))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise MergeError(
                f"Adapter module {name}: adapter_config.json gives lora_alpha {alpha!r} (lora_alpha/alpha_pattern), "
                "not a finite number: the scale of its update is unknown; fix the config (training used a number)."
            )
        mod.scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        if cfg.get("use_dora") and mod.magnitude is None:
            raise MergeError(
                f"DoRA adapter module {name} has no lora_magnitude_vector: the adapter is incomplete."
            )
