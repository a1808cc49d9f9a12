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
and suggest the nearest key for a typo, because a silently ignored key costs a whole run. A value is checked by
core.recipe.config_values, the combinations of values by core.recipe.config_combos.

`check_with_libraries(cfg)` then builds the real SFTConfig/LoraConfig/BitsAndBytesConfig objects: the libraries'
own cross-field checks (done by `--dry-run`, the trainer and the smoke test).
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

from core import files
from core.files import YamlError, atomic_write_text, read_yaml
from core.fmt import error_line
from core.recipe import distributed, methods, schema
from core.recipe import rewards as reward_specs
from core.recipe.config_combos import combination_problem, missing_here
from core.recipe.config_keys import (
    ALIASES,
    DEFAULTS,
    METHODS,
    OWN_SCHEMA,
    OWN_TRAINING,
    OWNED,
    RENAMED,
    SECTIONS,
    TOP_LEVEL,
)
from core.recipe.config_values import check_range, check_value, special_checks
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
            value, problem = check_value(path, value, fields[key])
            if problem and top == "distributed":  # its own words for a wrong type: what the key takes
                problem = distributed.field_problem(path, value) or problem
            problem = problem or (
                None if value is None else check_range(path, value) or special_checks(path, value)
            )
            if problem:
                errors[path] = f"{path} {problem} (got {_short(value)})."
                continue
            cfg[top][key] = copy.deepcopy(value)
    if not errors:
        problem = combination_problem(cfg) or (missing_here(cfg) if here else None)
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
