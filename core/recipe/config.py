"""The run config: one YAML file, whose sections are the libraries' own configuration classes.

    method:       sft (trl.SFTTrainer), dpo (trl.DPOTrainer, preference pairs) or kto (trl.KTOTrainer, rated
                  answers); each is a module of core.recipe.methods
    model:        {path, dtype, attn_implementation, trust_remote_code, reference_path (DPO, KTO)}
    quantization: the fields of transformers.BitsAndBytesConfig
    lora:         the fields of peft.LoraConfig (+ `enabled`: false for a full fine-tune)
    data:         {path, subset, format, columns, split, eval_split, mask_prompt}    the cockpit's data loader
    training:     every field of trl.SFTConfig (TrainingArguments + SFT's own), e.g. max_length, packing;
                  of the method's own config class otherwise (trl.DPOConfig, trl.KTOConfig), e.g. beta

The schema of the library sections is read from the installed libraries (their dataclass fields, types and
choices), so a key that a new TRL/transformers/peft release adds works the day it is installed. It is cached per
library version (core.recipe.schema), so validating a config does not import torch. Errors name the key's path
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
from core.fmt import error_line
from core.recipe import distributed, methods, schema, trackers, vision
from core.recipe import rewards as reward_specs
from core.recipe.config_keys import (
    ALIASES,
    COLUMN_KEYS,
    DEFAULTS,
    EXTRA_VALUES,
    METHODS,
    OWN_SCHEMA,
    OWN_TRAINING,
    OWNED,
    RANGES,
    RENAMED,
    SECTIONS,
    TOP_LEVEL,
)
from core.recipe.engine_args import bnb_config, lora_config, training_args


class ConfigError(ValueError):
    """A run config problem; the message names the key path and says how to fix it."""


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
    if section == "training":
        fields.update(OWN_TRAINING)
        fields.update(methods.get(method).own_training)
    for key in OWNED.get(section, {}):
        fields.pop(key, None)
    return fields


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
    return f" See the {section} keys in docs/run-config.md."


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
    if path == "data.image_size" and vision.image_size(value) is None:
        return "must be WIDTHxHEIGHT in pixels, two whole numbers above 0 such as 1024x768"
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
    if path.startswith("distributed."):
        return distributed.field_problem(path, value)
    if path == "training.warmup_steps" and not (value >= 0 and (value < 1 or float(value).is_integer())):
        return "must be a fraction of the steps (0 to <1) or a whole number of steps"
    return None


def field_errors(raw: Any, here: bool = True) -> tuple[dict, dict[str, str]]:
    """(the config with defaults filled in and values coerced, {key path: one sentence}) for every problem.
    here=False: the run is planned for another machine, so what this one lacks (a package) is no problem.

    A form shows each message next to its field; validate_config raises the first one.
    """
    errors: dict[str, str] = {}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return default_config(), {
            "config": "The run config must be a mapping with the keys " + ", ".join(TOP_LEVEL) + "."
        }
    errors.update(renamed_twice(raw))
    raw = migrate(raw)
    cfg = default_config()
    method = raw.get("method", "sft")
    if method not in METHODS:
        errors["method"] = f"method must be one of {', '.join(METHODS)} (got {_short(method)})."
        method = "sft"
    cfg["method"] = method
    cfg["training"].update(methods.get(method).defaults)
    known = section_schema("training", method)
    for key in [k for k in cfg["training"] if k not in known]:
        del cfg["training"][key]  # a cockpit default this method's config has no key for (GRPO: max_length)
    if methods.get(method).name == "grpo":
        cfg["rewards"] = copy.deepcopy(raw.get("rewards"))
        errors.update(reward_specs.problems(cfg["rewards"]))
    elif "rewards" in raw:
        errors["rewards"] = (
            f"rewards: reward functions are for method grpo (this run's method is {method}): drop the section or "
            "set method: grpo."
        )
    for top, values in raw.items():
        if top in ("method", "rewards"):
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
            if problem and top == "distributed":  # its own words for a wrong type: what the key takes
                problem = distributed.field_problem(path, value) or problem
            problem = problem or (
                None if value is None else _check_range(path, value) or _special_checks(path, value)
            )
            if problem:
                errors[path] = f"{path} {problem} (got {_short(value)})."
                continue
            cfg[top][key] = copy.deepcopy(value)
    if not errors:
        problem = _combination_problem(cfg) or (_missing_here(cfg) if here else None)
        if problem:
            errors[problem[0]] = problem[1]
    return cfg, errors


def validate_config(raw: Any, here: bool = True) -> dict:
    """Fill defaults and check every key; return the complete config or raise ConfigError naming the key path.
    here=False: valid for some machine, not necessarily this one (the Estimate page plans any card)."""
    cfg, errors = field_errors(raw, here)
    if errors:
        raise ConfigError(next(iter(errors.values())))
    return cfg


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def renamed_twice(raw: dict) -> dict[str, str]:
    """{old key path: sentence} for each old spelling (RENAMED) set beside its new key: one of them would be
    dropped silently, so the config says both and neither wins."""
    out = {}
    for (section, key), (new_section, new_key, _) in RENAMED.items():
        old, new = raw.get(section), raw.get(new_section)
        if not (isinstance(old, dict) and key in old and isinstance(new, dict) and new_key in new):
            continue
        if section not in OWN_SCHEMA and key in section_schema(section):
            continue  # the library still knows the old key: it is a setting of its own
        if (section, key) == (new_section, new_key):
            continue
        out[f"{section}.{key}"] = (
            f"{section}.{key} and {new_section}.{new_key} are both set ({old[key]!r} and {new[new_key]!r}); "
            f"{section}.{key} is the old name of {new_section}.{new_key}: keep one of them."
        )
    return out


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
            "data.path is required: a .jsonl/.json/.csv/.parquet file, a save_to_disk folder or a Hub dataset id.",
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
    if method.name == "grpo":
        problem = _grpo_problem(cfg)
        if problem:
            return problem
    if t.get("early_stopping_patience") and (
        cfg["data"]["eval_split"] <= 0 or t.get("eval_strategy") == "no"
    ):
        return (
            "training.early_stopping_patience",
            "training.early_stopping_patience needs evaluations to judge by: set data.eval_split (e.g. 0.05) and "
            "leave training.eval_strategy at steps or epoch.",
        )
    if q.get("load_in_4bit") and not cfg["lora"]["enabled"]:
        return (
            "quantization.load_in_4bit",
            "quantization.load_in_4bit needs lora.enabled: true (4-bit weights cannot be trained directly).",
        )
    # padding_free without packing: the engine truncates rows to max_length itself (TRL would refuse the pair).
    return distributed.combination_problem(cfg)


def _grpo_problem(cfg: dict) -> tuple[str, str] | None:
    """What trl.GRPOConfig would refuse with a traceback, said in the run config's words."""
    t = cfg["training"]
    g = t.get("num_generations", 8)
    if not isinstance(g, int) or g < 2:
        return (
            "training.num_generations",
            f"training.num_generations must be at least 2 (got {g!r}): GRPO compares each completion with the "
            "others of its prompt's group.",
        )
    weights = t.get("reward_weights")
    if weights is not None and len(weights) != len(cfg["rewards"]):
        return (
            "training.reward_weights",
            f"training.reward_weights has {len(weights)} weights for {len(cfg['rewards'])} reward functions "
            f"({', '.join(reward_specs.names(cfg['rewards']))}): give one weight per reward, in the same order.",
        )
    if t.get("generation_batch_size") is not None and t.get("steps_per_generation") is not None:
        return (
            "training.steps_per_generation",
            "training.generation_batch_size and training.steps_per_generation both set: TRL takes one of them.",
        )
    batch = t["per_device_train_batch_size"] * distributed.world_size(cfg)
    if t.get("generation_batch_size") is not None:
        generation = t["generation_batch_size"]
        if generation % batch:
            return (
                "training.generation_batch_size",
                f"training.generation_batch_size {generation} must be a multiple of the global batch size {batch} "
                "(per_device_train_batch_size x GPUs).",
            )
    else:
        steps = t.get("steps_per_generation") or t["gradient_accumulation_steps"]
        generation = batch * steps
    if generation % g:
        options = [b for b in range(g, 4 * g + 1, g)]
        return (
            "training.num_generations",
            f"The generation batch ({generation} completions: per_device_train_batch_size "
            f"{t['per_device_train_batch_size']} x {distributed.world_size(cfg)} GPU(s) x "
            f"{t.get('steps_per_generation') or t['gradient_accumulation_steps']} steps per generation) must divide "
            f"by training.num_generations {g}: set per_device_train_batch_size to a multiple of {g} (e.g. "
            f"{', '.join(map(str, options[:3]))}) or num_generations to a divisor of {generation}.",
        )
    return None


def _missing_here(cfg: dict) -> tuple[str, str] | None:
    """What this machine lacks for the config (a setting valid elsewhere)."""
    if cfg["training"].get("use_vllm"):
        problem = _vllm_problem()
        if problem:
            return "training.use_vllm", problem
    if cfg["training"].get("use_liger_kernel") and importlib.util.find_spec("liger_kernel") is None:
        return (
            "training.use_liger_kernel",
            "training.use_liger_kernel needs the liger-kernel package and a CUDA GPU (pip install liger-kernel); "
            "set it to false on this machine.",
        )
    problem = trackers.missing(cfg["training"].get("report_to"))
    if problem:
        return "training.report_to", problem
    return distributed.missing_here(cfg)


def _vllm_problem() -> str | None:
    """Why GRPO cannot generate with vLLM on this machine, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "training.use_vllm needs the vllm package (pip install vllm, on a machine with a CUDA GPU); set it to "
            "false to generate with transformers."
        )
    import torch

    if not torch.cuda.is_available():
        return (
            "training.use_vllm needs a CUDA GPU (vLLM does not run on this machine's CPU); set it to false."
        )
    return None


def checkpointing(cfg: dict) -> bool:
    """Gradient checkpointing on? transformers 5 also spells it activation_checkpointing."""
    t = cfg["training"]
    return bool(t.get("activation_checkpointing", t.get("gradient_checkpointing")))


def check_with_libraries(
    cfg: dict,
    run_dir: str | os.PathLike | None = None,
    has_eval: bool = False,
    smoke: bool = False,
    prec=None,
) -> None:
    """Build the libraries' own objects from a validated config, so their cross-field checks run before any model
    loads. has_eval, smoke and prec (core.precision.Precision) as the run builds them: a held-out split turns
    evaluation on (load_best_model_at_end is checked against it), and bf16 on a CPU is off. Raises ConfigError
    with the library's message (all of it: core.fmt.error_line), prefixed by the section it came from."""

    builds = (
        ("quantization", lambda: bnb_config(cfg, prec.dtype if prec else None)),
        ("lora", lambda: lora_config(cfg)),
        ("training", lambda: training_args(cfg, run_dir, prec, smoke=smoke, has_eval=has_eval)),
    )
    for section, build in builds:
        try:
            build()
        except ConfigError:
            raise
        except Exception as exc:  # the libraries raise ValueError/TypeError/... with their own sentence
            raise ConfigError(f"{section}: {error_line(exc)}") from None


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
