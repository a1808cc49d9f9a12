"""The run config: one YAML file with five sections (model, quantization, lora, data, training).

Key names are the library's own (BitsAndBytesConfig, LoraConfig, TrainingArguments) so a config reads like the
code it drives. Validation is strict: an unknown key or an out-of-range value is an error naming the key's path
(`training.learning_rate`), because a silently ignored typo costs a whole run.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

from core.files import atomic_write_text

SECTIONS = ("model", "quantization", "lora", "data", "training")

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTN = ("eager", "sdpa", "flash_attention_2", "flex_attention")
FORMATS = ("auto", "alpaca", "chat", "text")
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
# The optimizers that make sense for one-GPU LoRA/full fine-tuning and run without extra packages.
OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "sgd",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "lion_8bit",
    "paged_lion_8bit",
)


class ConfigError(ValueError):
    """A run config problem; the message names the key path and says how to fix it."""


DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {
        "path": None,  # a local folder or a hub id (required)
        "dtype": "auto",  # auto: bfloat16 on a CUDA GPU that supports it, float32 otherwise
        "attn_implementation": "sdpa",
        "trust_remote_code": False,
    },
    "quantization": {
        "load_in_4bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "auto",
    },
    "lora": {
        "enabled": True,  # false: full fine-tuning (the planner's method "full")
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "target_modules": "all-linear",
        "bias": "none",
        "use_rslora": False,
    },
    "data": {
        "path": None,  # a .json/.jsonl/.csv/.parquet file, a list of them, or a save_to_disk folder (required)
        "format": "auto",
        "columns": {},  # rename map, e.g. {"instruction": "question", "output": "answer"}
        "split": "train",  # which split of a DatasetDict folder to train on
        "max_length": 512,
        "eval_split": 0.0,  # fraction of rows held out for eval_loss (0 = no eval)
        "mask_prompt": True,
    },
    "training": {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "num_train_epochs": 1.0,
        "max_steps": -1,
        "learning_rate": 2e-4,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.03,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": "auto",  # auto: on when the CUDA GPU supports it; never on a CPU
        "fp16": False,
        "gradient_checkpointing": False,
        "optim": "adamw_torch",
        "logging_steps": 10,
        "eval_steps": None,  # None: same as logging_steps when data.eval_split > 0
        "save_steps": 200,
        "save_total_limit": 2,
        "seed": 42,
    },
}


# ---- validation ---------------------------------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _choice(options):
    def check(v):
        return None if v in options else f"must be one of {', '.join(map(str, options))}"

    return check


def _bool(v):
    return None if isinstance(v, bool) else "must be true or false"


def _int_range(lo, hi=None):
    def check(v):
        if not _is_int(v):
            return "must be a whole number"
        if v < lo or (hi is not None and v > hi):
            return f"must be between {lo} and {hi}" if hi is not None else f"must be at least {lo}"
        return None

    return check


def _num_range(lo, hi, lo_open=False, hi_open=False):
    def check(v):
        if not _is_num(v):
            return "must be a number"
        bad_lo = v <= lo if lo_open else v < lo
        bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
        if bad_lo or bad_hi:
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            return f"must be in {left}{lo}, {hi if hi is not None else 'inf'}{right}"
        return None

    return check


def _optional(check):
    return lambda v: None if v is None else check(v)


def _nonempty_str(v):
    return None if isinstance(v, str) and v.strip() else "must be a non-empty string"


def _paths(v):
    if isinstance(v, str) and v.strip():
        return None
    if isinstance(v, list) and v and all(isinstance(p, str) and p.strip() for p in v):
        return None
    return "must be a file/folder path or a non-empty list of file paths"


def _targets(v):
    if isinstance(v, str) and v.strip():
        return None
    if isinstance(v, list) and v and all(isinstance(m, str) and m for m in v):
        return None
    return "must be 'all-linear' or a non-empty list of module names such as [q_proj, v_proj]"


def _columns(v):
    if not isinstance(v, dict):
        return "must be a mapping from the expected column to your column, e.g. {output: answer}"
    allowed = {"instruction", "input", "output", "messages", "text"}
    for k, col in v.items():
        if k not in allowed:
            return f"has unknown key {k!r}: the expected columns are {', '.join(sorted(allowed))}"
        if not isinstance(col, str) or not col:
            return f"maps {k!r} to {col!r}: give the name of a column in your data"
    return None


def _bf16(v):
    return None if isinstance(v, bool) or v == "auto" else "must be true, false or auto"


RULES: dict[str, dict[str, Any]] = {
    "model": {
        "path": _nonempty_str,
        "dtype": _choice(DTYPES),
        "attn_implementation": _choice(ATTN),
        "trust_remote_code": _bool,
    },
    "quantization": {
        "load_in_4bit": _bool,
        "bnb_4bit_quant_type": _choice(("nf4", "fp4")),
        "bnb_4bit_use_double_quant": _bool,
        "bnb_4bit_compute_dtype": _choice(DTYPES),
    },
    "lora": {
        "enabled": _bool,
        "r": _int_range(1, 4096),
        "lora_alpha": _num_range(0, None, lo_open=True),
        "lora_dropout": _num_range(0, 1, hi_open=True),
        "target_modules": _targets,
        "bias": _choice(("none", "all", "lora_only")),
        "use_rslora": _bool,
    },
    "data": {
        "path": _paths,
        "format": _choice(FORMATS),
        "columns": _columns,
        "split": _nonempty_str,
        "max_length": _int_range(8, 1_048_576),
        "eval_split": _num_range(0, 0.5, hi_open=True),
        "mask_prompt": _bool,
    },
    "training": {
        "per_device_train_batch_size": _int_range(1, 65536),
        "gradient_accumulation_steps": _int_range(1, 65536),
        "num_train_epochs": _num_range(0, 10000, lo_open=True),
        "max_steps": lambda v: (
            None if _is_int(v) and (v == -1 or v >= 1) else "must be -1 (use num_train_epochs) or at least 1"
        ),
        "learning_rate": _num_range(0, 1, lo_open=True),
        "lr_scheduler_type": _choice(SCHEDULERS),
        "warmup_steps": lambda v: (
            None
            if _is_num(v) and v >= 0 and (v < 1 or float(v).is_integer())
            else "must be a fraction of the steps (0 to <1) or a whole number of steps"
        ),
        "weight_decay": _num_range(0, 1),
        "max_grad_norm": _num_range(0, None),
        "bf16": _bf16,
        "fp16": _bool,
        "gradient_checkpointing": _bool,
        "optim": _choice(OPTIMIZERS),
        "logging_steps": _int_range(1),
        "eval_steps": _optional(_int_range(1)),
        "save_steps": _int_range(1),
        "save_total_limit": _optional(_int_range(1)),
        "seed": _int_range(0, 2**32 - 1),
    },
}


def default_config() -> dict:
    """A deep copy of the defaults (model.path and data.path still empty)."""
    return copy.deepcopy(DEFAULTS)


def validate_config(raw: Any) -> dict:
    """Fill defaults and check every key; return the complete config or raise ConfigError naming the key path."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("The run config must be a mapping with the sections " + ", ".join(SECTIONS) + ".")
    for section in raw:
        if section not in DEFAULTS:
            raise ConfigError(
                f"{section}: unknown section; the run config has only the sections {', '.join(SECTIONS)}."
            )
    cfg = default_config()
    for section, values in raw.items():
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a mapping of keys, got {type(values).__name__}.")
        for key, value in values.items():
            if key not in RULES[section]:
                known = ", ".join(RULES[section])
                raise ConfigError(f"{section}.{key}: unknown key. Known keys in {section}: {known}.")
            problem = RULES[section][key](value)
            if problem:
                raise ConfigError(f"{section}.{key} {problem} (got {value!r}).")
            cfg[section][key] = copy.deepcopy(value)
    _check_combinations(cfg)
    return cfg


def _check_combinations(cfg: dict) -> None:
    if cfg["model"]["path"] is None:
        raise ConfigError("model.path is required: the folder of a local model or a hub id.")
    if cfg["data"]["path"] is None:
        raise ConfigError(
            "data.path is required: a .jsonl/.json/.csv/.parquet file or a save_to_disk folder."
        )
    t, q = cfg["training"], cfg["quantization"]
    if t["bf16"] is True and t["fp16"]:
        raise ConfigError("training.bf16 and training.fp16 are both true: choose one (bf16 on recent GPUs).")
    if q["load_in_4bit"] and not cfg["lora"]["enabled"]:
        raise ConfigError(
            "quantization.load_in_4bit needs lora.enabled: true (4-bit weights cannot be trained directly)."
        )


# ---- files --------------------------------------------------------------------------------------------------


def config_to_yaml(cfg: dict) -> str:
    import yaml

    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)


def load_config(path: str | os.PathLike) -> dict:
    """Read and validate a YAML run config."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Run config {p} does not exist: give the path of a YAML file.")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML ({exc}).") from None
    return validate_config(raw)


def dump_config(cfg: dict, path: str | os.PathLike) -> Path:
    """Validate, then write atomically (temp file + os.replace) so a reader never sees half a file."""
    cfg = validate_config(cfg)
    return atomic_write_text(path, config_to_yaml(cfg))


# ---- from the planner ---------------------------------------------------------------------------------------


def _get(plan: Any, key: str, default=None):
    if isinstance(plan, dict):
        return plan.get(key, default)
    return getattr(plan, key, default)


def plan_to_config(plan: Any, base: dict | None = None) -> dict:
    """Turn the planner's plan (core.estimate.Plan or its dict) into a run config, on top of `base`.

    Tolerant: a missing or None key leaves the base value alone. Returns a validated config when base has the
    required paths, else an unvalidated dict the caller completes.
    """
    cfg = copy.deepcopy(base) if base else default_config()
    for section in SECTIONS:
        cfg.setdefault(section, {})
    plan = plan or {}

    def put(section, key, value, convert=lambda v: v):
        if value is not None:
            cfg[section][key] = convert(value)

    method = str(_get(plan, "method") or "").lower()
    if method == "full":
        cfg["lora"]["enabled"] = False
        cfg["quantization"]["load_in_4bit"] = False
    elif method in ("lora", "qlora"):
        cfg["lora"]["enabled"] = True
        cfg["quantization"]["load_in_4bit"] = method == "qlora"

    lora = _get(plan, "lora") if isinstance(_get(plan, "lora"), dict) else {}
    put("lora", "r", _get(plan, "lora_r", lora.get("r")), int)
    put("lora", "lora_alpha", _get(plan, "lora_alpha", lora.get("alpha", lora.get("lora_alpha"))))
    put("lora", "lora_dropout", _get(plan, "lora_dropout", lora.get("dropout", lora.get("lora_dropout"))))
    targets = _get(plan, "target_modules", lora.get("target_modules"))
    if targets:
        put("lora", "target_modules", targets if isinstance(targets, str) else list(targets))

    put(
        "training",
        "per_device_train_batch_size",
        _get(plan, "batch_size", _get(plan, "micro_batch_size")),
        int,
    )
    put("data", "max_length", _get(plan, "seq_len", _get(plan, "max_length")), int)
    put("training", "gradient_checkpointing", _get(plan, "gradient_checkpointing"), bool)
    put("training", "optim", _get(plan, "optim"))

    attn = _get(plan, "attn", _get(plan, "attn_implementation"))
    if attn:
        put(
            "model",
            "attn_implementation",
            {"flash": "flash_attention_2", "fa2": "flash_attention_2"}.get(attn, attn),
        )
    put("model", "path", _get(plan, "model"), str)
    short = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    dtype = _get(plan, "load_dtype", _get(plan, "dtype"))
    if dtype:
        put("model", "dtype", short.get(str(dtype), str(dtype)))
    # The compute dtype is the Trainer's mixed-precision flag (and the 4-bit compute dtype).
    compute = _get(plan, "compute_dtype") or dtype
    if compute:
        compute = short.get(str(compute), str(compute))
        if _get(plan, "autocast") is False or compute == "float32":
            cfg["training"]["bf16"], cfg["training"]["fp16"] = False, False
        elif compute == "bfloat16":
            cfg["training"]["bf16"], cfg["training"]["fp16"] = "auto", False
        elif compute == "float16":
            cfg["training"]["bf16"], cfg["training"]["fp16"] = False, True
        if compute in DTYPES:
            cfg["quantization"]["bnb_4bit_compute_dtype"] = compute
    quant = _get(plan, "quant_type", _get(plan, "bnb_4bit_quant_type"))
    if quant:
        put("quantization", "bnb_4bit_quant_type", str(quant).lower())
    put("quantization", "bnb_4bit_use_double_quant", _get(plan, "double_quant"), bool)

    if cfg["model"].get("path") and cfg["data"].get("path"):
        return validate_config(cfg)
    return cfg
