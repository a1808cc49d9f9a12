"""The run config: one YAML file, whose sections are the libraries' own configuration classes.

    method:       sft (trl.SFTTrainer), dpo (trl.DPOTrainer, preference pairs) or kto (trl.KTOTrainer, rated
                  answers); each is a module of core.train.methods
    model:        {path, dtype, attn_implementation, trust_remote_code, reference_path (DPO, KTO)}
    quantization: the fields of transformers.BitsAndBytesConfig
    lora:         the fields of peft.LoraConfig (+ `enabled`: false for a full fine-tune)
    data:         {path, format, columns, split, eval_split, mask_prompt}    the cockpit's data loader
    training:     every field of trl.SFTConfig (TrainingArguments + SFT's own), e.g. max_length, packing;
                  of the method's own config class otherwise (trl.DPOConfig, trl.KTOConfig), e.g. beta

The schema of the library sections is read from the installed libraries (their dataclass fields, types and
choices), so a key that a new TRL/transformers/peft release adds works the day it is installed. It is cached per
library version (core.train.schema), so validating a config does not import torch. Errors name the key's path
and suggest the nearest key for a typo, because a silently ignored key costs a whole run.

`check_with_libraries(cfg)` then builds the real SFTConfig/LoraConfig/BitsAndBytesConfig objects: the libraries'
own cross-field checks (done by `--dry-run`, the trainer and the smoke test).
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from core import files
from core.files import YamlError, atomic_write_text, read_yaml
from core.train import methods, schema
from core.train.engine_args import bnb_config, lora_config, training_args

METHODS = methods.NAMES
SECTIONS = ("model", "quantization", "lora", "data", "training")
TOP_LEVEL = ("method", *SECTIONS)

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTN = ("eager", "sdpa", "flash_attention_2", "flex_attention")
# Suggestions for the Train page's selectors (every other value the library accepts is valid too).
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


# The cockpit's defaults where they differ from the libraries' (LoRA-sized learning rate, a short max_length
# for the first run, bf16 only where the GPU has it). Everything not listed takes the library's default.
DEFAULTS: dict[str, Any] = {
    "method": "sft",
    "model": {
        "path": None,  # a local folder or a hub id already in the local cache (required)
        "dtype": "auto",  # auto: bfloat16 on a CUDA GPU that supports it, float32 otherwise
        "attn_implementation": "sdpa",
        "trust_remote_code": False,
        "reference_path": None,  # DPO/KTO: an explicit reference model (default: the base with the adapter off)
    },
    "quantization": {
        "load_in_4bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "auto",  # auto: the dtype the weights are loaded in
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
        "eval_split": 0.0,  # fraction of rows held out for eval_loss (0 = no eval)
        "mask_prompt": True,  # train on the answer only, with any chat template
    },
    "training": {
        "max_length": 512,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "num_train_epochs": 1.0,
        "max_steps": -1,
        "learning_rate": 2e-4,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.03,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": "auto",  # auto: on when the CUDA GPU supports bf16 natively; never on a CPU
        "fp16": False,
        "gradient_checkpointing": True,  # TRL's default: what makes long sequences fit
        "optim": "adamw_torch",
        "logging_steps": 10,
        "eval_steps": None,  # None: same as logging_steps when data.eval_split > 0
        "save_steps": 200,
        "save_total_limit": 2,
        "seed": 42,
    },
}

# Keys whose meaning the cockpit owns: the run directory, the logs the UI reads, the data pipeline and the model
# loading are the engine's. Each maps to the sentence that says where the setting lives instead.
OWNED = {
    "training": {
        "output_dir": "the engine writes checkpoints into the run directory (core.train --run-dir)",
        "logging_dir": "the engine logs into the run directory (metrics.jsonl)",
        "overwrite_output_dir": "a run directory is never overwritten; start a new run instead",
        "resume_from_checkpoint": "resume a run with `python -m core.train ... --resume` (or Resume in the app)",
        "disable_tqdm": "the engine turns progress bars off so that stderr.log stays readable",
        "logging_nan_inf_filter": "the engine must see NaN losses to stop the run",
        "remove_unused_columns": "the engine feeds the trainer tokenized columns only",
        "use_cpu": "the engine picks the device (a CUDA GPU when there is one)",
        "model_init_kwargs": "the engine loads the model: use the model and quantization sections",
        "trust_remote_code": "set model.trust_remote_code",
        "dataset_text_field": "the engine tokenizes the data itself: set data.format and data.columns",
        "dataset_kwargs": "the engine tokenizes the data itself: set data.format and data.columns",
        "completion_only_loss": "the engine masks the prompt itself: set data.mask_prompt",
        "assistant_only_loss": "the engine masks the prompt itself: set data.mask_prompt",
        "pad_token": "the engine pads with the tokenizer's pad token (eos when it has none)",
        "chat_template_path": "the engine uses the model folder's chat template",
    },
    "lora": {
        "task_type": "the engine trains causal language models (CAUSAL_LM)",
        "peft_type": "this section is LoRA",
        "base_model_name_or_path": "the base is model.path",
        "revision": "the base is model.path",
        "inference_mode": "the adapter is trained",
        "auto_mapping": "set by peft",
        "peft_version": "set by peft",
    },
    "quantization": {
        "load_in_8bit": "8-bit training is not planned or tested here: use load_in_4bit (QLoRA) or none",
    },
}

# Names people bring from other tools -> where the setting lives here.
ALIASES = {
    "max_length": "training.max_length",
    "seq_len": "training.max_length",
    "cutoff_len": "training.max_length",
    "sequence_len": "training.max_length",
    "lr": "training.learning_rate",
    "epochs": "training.num_train_epochs",
    "num_epochs": "training.num_train_epochs",
    "batch_size": "training.per_device_train_batch_size",
    "micro_batch_size": "training.per_device_train_batch_size",
    "lora_r": "lora.r",
    "rank": "lora.r",
    "alpha": "lora.lora_alpha",
    "dropout": "lora.lora_dropout",
    "model_name_or_path": "model.path",
    "base_model": "model.path",
    "dataset": "data.path",
    "torch_dtype": "model.dtype",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "optim": "training.optim",
    "optimizer": "training.optim",
    "load_in_4bit": "quantization.load_in_4bit",
}

# Sanity ranges the libraries do not check themselves (a negative learning rate trains "fine" for a while).
RANGES: dict[str, tuple] = {
    "lora.r": (1, 4096),
    "lora.lora_alpha": (0, None, "open"),
    "lora.lora_dropout": (0, 1, "right-open"),
    "training.max_length": (8, 1_048_576),
    "training.per_device_train_batch_size": (1, 65536),
    "training.per_device_eval_batch_size": (1, 65536),
    "training.gradient_accumulation_steps": (1, 65536),
    "training.num_train_epochs": (0, 10000, "open"),
    "training.learning_rate": (0, 1, "left-open"),
    "training.weight_decay": (0, 1),
    "training.max_grad_norm": (0, None),
    "training.logging_steps": (0, None, "open"),
    "training.save_steps": (0, None, "open"),
    "training.eval_steps": (0, None, "open"),
    "training.save_total_limit": (1, None),
    "training.seed": (0, 2**32 - 1),
    "training.dataloader_num_workers": (0, 256),
    "data.eval_split": (0, 0.5, "right-open"),
}

# The cockpit's own sections, described the way core.train.schema describes the libraries' fields.
OWN_SCHEMA = {
    "model": {
        "path": {"kinds": ["str"]},
        "dtype": {"kinds": ["str"], "choices": list(DTYPES)},
        "attn_implementation": {"kinds": ["str"], "choices": list(ATTN)},
        "trust_remote_code": {"kinds": ["bool"]},
        "reference_path": {"kinds": ["str", "none"]},
    },
    "data": {
        "path": {"kinds": ["str", "list"]},
        "format": {
            "kinds": ["str"],
            "choices": list(
                dict.fromkeys(("auto",) + tuple(f for m in methods.REGISTRY.values() for f in m.formats))
            ),
        },
        "columns": {"kinds": ["dict"]},
        "split": {"kinds": ["str"]},
        "eval_split": {"kinds": ["float"]},
        "mask_prompt": {"kinds": ["bool"]},
    },
}
# Values the cockpit adds to a library field: "auto" precision/dtype is resolved by the engine per device.
EXTRA_VALUES = {"training.bf16": ("auto",), "quantization.bnb_4bit_compute_dtype": ("auto",)}
COLUMN_KEYS = tuple(dict.fromkeys(c for m in methods.REGISTRY.values() for c in m.columns))


def default_config() -> dict:
    """A deep copy of the defaults (model.path and data.path still empty)."""
    return copy.deepcopy(DEFAULTS)


def section_schema(section: str, method: str = "sft") -> dict[str, dict]:
    """{key: {"kinds": [...], "choices": [...]}} for one section: the libraries' fields (the training section is
    the method's config class's: trl.SFTConfig, trl.DPOConfig, trl.KTOConfig), or the cockpit's own."""
    if section in OWN_SCHEMA:
        return OWN_SCHEMA[section]
    name = methods.get(method).schema_section if section == "training" else section
    fields = dict(schema.library_schema()[name])
    if section == "lora":
        fields["enabled"] = {"kinds": ["bool"]}
    for key in OWNED.get(section, {}):
        fields.pop(key, None)
    return fields


# ---- validation ---------------------------------------------------------------------------------------------


def _suggest(section: str, key: str) -> str:
    """ "Did you mean" for a key: the nearest key of the same section, or where the setting lives here."""
    if key in ALIASES and ALIASES[key] != f"{section}.{key}":
        return f" It is called {ALIASES[key]} here."
    if section == "training":
        owners = [m for m in methods.REGISTRY.values() if key in section_schema("training", m.name)]
        if owners:
            names = " or ".join(f"{m.label} ({m.trainer_name.replace('Trainer', 'Config')})" for m in owners)
            return f" It is a setting of {names}: set method: {owners[0].name}."
    known = list(section_schema(section))
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if near:
        return f" Did you mean {section}.{near[0]}?"
    for other in SECTIONS:
        if other != section and key in section_schema(other):
            return f" {key} belongs in the {other} section ({other}.{key})."
    return f" See the {section} keys in the README's run-config section."


def _check_value(path: str, value: Any, spec: dict) -> tuple[Any, str | None]:
    """(the value, coerced where YAML is ambiguous, or the problem)."""
    kinds, choices = spec.get("kinds") or ["any"], spec.get("choices")
    extra = EXTRA_VALUES.get(path, ())
    if value in extra and not isinstance(value, bool):
        return value, None
    if value is None:
        return (
            (None, None)
            if "none" in kinds or "any" in kinds
            else (None, "must be set (it has no 'none' value)")
        )
    if "any" in kinds:
        return value, None
    if isinstance(value, bool):
        if "bool" in kinds:
            return value, None
        return value, "must not be true/false" + (
            f": one of {', '.join(map(str, choices))}" if choices else ""
        )
    if isinstance(value, int) and ("int" in kinds or "float" in kinds):
        return value, None  # a whole number stays one (logging_steps: 10, not 10.0)
    if isinstance(value, float):
        if not math.isfinite(value):
            return value, "must be a finite number"
        if "float" in kinds:
            return value, None
        if "int" in kinds:
            return value, "must be a whole number"
    if isinstance(value, str):
        # YAML 1.1 reads 2e-4 (no dot) as a string: take it as the number it is
        if "float" in kinds and "str" not in kinds:
            try:
                number = float(value)
            except ValueError:
                return value, "must be a number"
            return (number, None) if math.isfinite(number) else (value, "must be a finite number")
        if "str" in kinds:
            if choices and value not in choices:
                near = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.6)
                hint = f" Did you mean {near[0]!r}?" if near else ""
                listed = ", ".join(map(str, choices[:12])) + (
                    f", ... ({len(choices)} in all)" if len(choices) > 12 else ""
                )
                return value, f"must be one of {listed}.{hint}"
            return value, None
    if isinstance(value, list) and "list" in kinds:
        return value, None
    if isinstance(value, dict) and "dict" in kinds:
        return value, None
    wanted = {
        "bool": "true or false",
        "int": "a whole number",
        "float": "a number",
        "str": "a string",
        "list": "a list",
        "dict": "a mapping",
    }
    words = [wanted[k] for k in kinds if k in wanted]
    return value, "must be " + " or ".join(words or ["a value of another type"])


def _check_range(path: str, value: Any) -> str | None:
    if path not in RANGES or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    lo, hi, *mode = RANGES[path]
    mode = mode[0] if mode else "closed"
    lo_open, hi_open = mode in ("open", "left-open"), mode in ("open", "right-open")
    bad = (value <= lo if lo_open else value < lo) or (
        hi is not None and (value >= hi if hi_open else value > hi)
    )
    if not bad:
        return None
    if hi is None:
        return f"must be {'above' if lo_open else 'at least'} {lo}"
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    return f"must be in {left}{lo}, {hi}{right}"


def _special_checks(path: str, value: Any) -> str | None:
    if path in ("model.path", "data.split") and not (isinstance(value, str) and value.strip()):
        return "must be a non-empty string"
    if path == "data.path":
        ok = (isinstance(value, str) and value.strip()) or (
            isinstance(value, list) and value and all(isinstance(p, str) and p.strip() for p in value)
        )
        return None if ok else "must be a file/folder path or a non-empty list of file paths"
    if path == "data.columns":
        for k, col in value.items():
            if k not in COLUMN_KEYS:
                return f"has unknown key {k!r}: the expected columns are {', '.join(COLUMN_KEYS)}"
            if not isinstance(col, str) or not col:
                return f"maps {k!r} to {col!r}: give the name of a column in your data"
    if path == "lora.target_modules" and not (
        (isinstance(value, str) and value.strip())
        or (isinstance(value, list) and value and all(isinstance(m, str) and m for m in value))
    ):
        return "must be 'all-linear' or a non-empty list of module names such as [q_proj, v_proj]"
    if path == "training.max_steps" and not (value == -1 or value >= 1):
        return "must be -1 (use num_train_epochs) or at least 1"
    if path == "training.warmup_steps" and not (value >= 0 and (value < 1 or float(value).is_integer())):
        return "must be a fraction of the steps (0 to <1) or a whole number of steps"
    return None


def field_errors(raw: Any) -> tuple[dict, dict[str, str]]:
    """(the config with defaults filled in and values coerced, {key path: one sentence}) for every problem.

    A form shows each message next to its field; validate_config raises the first one.
    """
    errors: dict[str, str] = {}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return default_config(), {
            "config": "The run config must be a mapping with the keys " + ", ".join(TOP_LEVEL) + "."
        }
    raw = migrate(raw)
    cfg = default_config()
    method = raw.get("method", "sft")
    if method not in METHODS:
        errors["method"] = f"method must be one of {', '.join(METHODS)} (got {_short(method)})."
        method = "sft"
    cfg["method"] = method
    cfg["training"].update(methods.get(method).defaults)
    for top, values in raw.items():
        if top == "method":
            continue
        if top not in SECTIONS:
            near = difflib.get_close_matches(str(top), TOP_LEVEL, n=1, cutoff=0.6)
            hint = f" Did you mean {near[0]}?" if near else ""
            errors[str(top)] = (
                f"{top}: unknown section; the run config has only {', '.join(TOP_LEVEL)}.{hint}"
            )
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            errors[top] = f"{top}: must be a mapping of keys, got {type(values).__name__}."
            continue
        fields = section_schema(top, method)
        owned = OWNED.get(top, {})
        for key, value in values.items():
            path = f"{top}.{key}"
            if key in owned:
                errors[path] = f"{path} is set by the engine: {owned[key]}."
                continue
            if key not in fields:
                errors[path] = f"{path}: unknown key.{_suggest(top, str(key))}"
                continue
            value, problem = _check_value(path, value, fields[key])
            problem = problem or (
                None if value is None else _check_range(path, value) or _special_checks(path, value)
            )
            if problem:
                errors[path] = f"{path} {problem} (got {_short(value)})."
                continue
            cfg[top][key] = copy.deepcopy(value)
    if not errors:
        problem = _combination_problem(cfg)
        if problem:
            errors[problem[0]] = problem[1]
    return cfg, errors


def validate_config(raw: Any) -> dict:
    """Fill defaults and check every key; return the complete config or raise ConfigError naming the key path."""
    cfg, errors = field_errors(raw)
    if errors:
        raise ConfigError(next(iter(errors.values())))
    return cfg


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Keys that moved or that a library renamed: (section, old key) -> (section, new key, value map). The config is
# stored under the current names; an old spelling from another tool or an older release still reads.
RENAMED = {
    ("data", "max_length"): ("training", "max_length", None),
    ("training", "max_seq_length"): ("training", "max_length", None),
    ("training", "evaluation_strategy"): ("training", "eval_strategy", None),
    # transformers 5 turned the flag into a sampling strategy
    ("training", "group_by_length"): (
        "training",
        "train_sampling_strategy",
        {True: "group_by_length", False: None},
    ),
    ("model", "torch_dtype"): ("model", "dtype", None),
}


def migrate(raw: dict) -> dict:
    """Old spellings (RENAMED) rewritten to today's keys, unless the library still knows the old key."""
    out = None
    for (section, key), (new_section, new_key, values) in RENAMED.items():
        old = raw.get(section)
        if not isinstance(old, dict) or key not in old:
            continue
        if section not in OWN_SCHEMA and key in section_schema(section):
            continue  # the installed library still has this key: keep it as the user wrote it
        out = out or copy.deepcopy(raw)
        value = out[section].pop(key)
        if values is not None:
            value = values.get(value, value) if isinstance(value, (bool, str, int)) else value
            if value is None:
                continue
        target = out.get(new_section)
        if target is None:
            out[new_section] = target = {}
        if isinstance(target, dict):
            target.setdefault(new_key, value)
    return out if out is not None else raw


def _combination_problem(cfg: dict) -> tuple[str, str] | None:
    if cfg["model"]["path"] is None:
        return "model.path", "model.path is required: the folder of a local model or a hub id."
    if cfg["data"]["path"] is None:
        return (
            "data.path",
            "data.path is required: a .jsonl/.json/.csv/.parquet file or a save_to_disk folder.",
        )
    t, q = cfg["training"], cfg["quantization"]
    if t.get("bf16") is True and t.get("fp16"):
        return (
            "training.bf16",
            "training.bf16 and training.fp16 are both true: choose one (bf16 on recent GPUs).",
        )
    method, fmt = methods.get(cfg), cfg["data"]["format"]
    if fmt != "auto" and fmt not in method.formats:
        owners = [m.name for m in methods.REGISTRY.values() if fmt in m.formats]
        return (
            "data.format",
            f"data.format {fmt} is not a format of method {method.name} ({method.summary}): use "
            f"{', '.join(('auto', *method.formats))}"
            + (f", or set method: {owners[0]} for {fmt} data." if owners else "."),
        )
    if cfg["model"].get("reference_path") and not method.traits.reference:
        return (
            "model.reference_path",
            f"model.reference_path is the reference model of a preference run (DPO, KTO); method {method.name} "
            "has none: drop it or change the method.",
        )
    if method.smoke_batch_size > 1 and t["per_device_train_batch_size"] < method.smoke_batch_size:
        return (
            "training.per_device_train_batch_size",
            f"training.per_device_train_batch_size must be at least {method.smoke_batch_size} for method "
            f"{method.name}: {method.trainer_name} estimates its KL term from the other rows of a batch.",
        )
    if q.get("load_in_4bit") and not cfg["lora"]["enabled"]:
        return (
            "quantization.load_in_4bit",
            "quantization.load_in_4bit needs lora.enabled: true (4-bit weights cannot be trained directly).",
        )
    # padding_free without packing: the engine truncates rows to max_length itself (TRL would refuse the pair).
    if t.get("use_liger_kernel") and importlib.util.find_spec("liger_kernel") is None:
        return (
            "training.use_liger_kernel",
            "training.use_liger_kernel needs the liger-kernel package and a CUDA GPU (pip install liger-kernel); "
            "set it to false on this machine.",
        )
    return None


def checkpointing(cfg: dict) -> bool:
    """Gradient checkpointing on? transformers 5 also spells it activation_checkpointing."""
    t = cfg["training"]
    return bool(t.get("activation_checkpointing", t.get("gradient_checkpointing")))


def check_with_libraries(cfg: dict, run_dir: str | os.PathLike | None = None) -> None:
    """Build the libraries' own objects from a validated config, so their cross-field checks run before any model
    loads. Raises ConfigError with the library's message, prefixed by the section it came from."""

    for section, build in (("quantization", bnb_config), ("lora", lora_config), ("training", training_args)):
        try:
            build(cfg, run_dir) if section == "training" else build(cfg)
        except ConfigError:
            raise
        except Exception as exc:  # the libraries raise ValueError/TypeError/... with their own sentence
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{section}: {text}") from None


# ---- files --------------------------------------------------------------------------------------------------


def config_to_yaml(cfg: dict) -> str:
    import yaml

    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)


MAX_CONFIG_BYTES = files.MAX_YAML_BYTES


def load_config(path: str | os.PathLike) -> dict:
    """Read and validate a YAML run config (through core.files.read_yaml: regular files only, bounded, aliases
    refused)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"Run config {p} does not exist: give the path of a YAML file.")
    try:
        return validate_config(read_yaml(p))
    except YamlError as exc:
        raise ConfigError(str(exc)) from None


def parse_yaml(text: str, where: str = "the run config") -> Any:
    """A run config's text as data (core.files.parse_yaml: aliases refused), ConfigError for bad YAML."""
    try:
        return files.parse_yaml(text, where)
    except YamlError as exc:
        raise ConfigError(str(exc)) from None


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
    """The Estimate page's plan (core.estimate Plan or its dict) as a run config, on top of `base`: the inverse
    of core.estimate.from_config.plan_for_config for the settings a run config carries.

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

    objective = _get(plan, "objective")
    if objective is not None:
        cfg["method"] = objective
        if cfg["data"].get("format") not in (None, "auto", *methods.get(objective).formats):
            cfg["data"]["format"] = "auto"
    if objective and methods.get(objective).traits.reference and _get(plan, "precompute_ref"):
        cfg["training"]["precompute_ref_log_probs"] = True
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
        if isinstance(targets, str) and targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        put("lora", "target_modules", targets if isinstance(targets, str) else list(targets))

    put(
        "training",
        "per_device_train_batch_size",
        _get(plan, "batch_size", _get(plan, "micro_batch_size")),
        int,
    )
    put("training", "max_length", _get(plan, "seq_len", _get(plan, "max_length")), int)
    put("training", "gradient_checkpointing", _get(plan, "gradient_checkpointing"), bool)
    put("training", "optim", _get(plan, "optim"))
    # the memory levers a run config carries (core.estimate.levers); the others are always on in the engine
    for plan_key, key in (
        ("padding_free", "padding_free"),
        ("packing", "packing"),
        ("activation_offloading", "activation_offloading"),
        ("liger", "use_liger_kernel"),
    ):
        value = _get(plan, plan_key)
        if value is not None and (value or key in cfg["training"]):
            cfg["training"][key] = bool(value)
    if _get(plan, "packing"):
        put("training", "packing_strategy", _get(plan, "packing_strategy"))

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
