"""The libraries' configuration classes as a plain schema: {section: {key: {"kinds": [...], "choices": [...]}}}.

training = trl.SFTConfig's fields (trl.DPOConfig's for a DPO run: "training_dpo"), lora = peft.LoraConfig's, quantization = transformers.BitsAndBytesConfig's
constructor arguments. Read from the installed libraries (so a new key works the day it ships) and cached per
library version in the user's cache folder, so that validating a run config does not import torch (seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import os
import types
import typing
from importlib import metadata
from pathlib import Path

from core.files import atomic_write_text
from core.recipe import methods

FORMAT = 4  # bump when the schema's shape changes (2: training_dpo, 3: training_kto, 4: training_grpo)
PACKAGES = ("trl", "transformers", "peft")
# Values the libraries check only inside their constructors; listed so a typo is caught before any import.
KNOWN_CHOICES = {("quantization", "bnb_4bit_quant_type"): ["nf4", "fp4"]}
_memo: dict | None = None


def versions() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-cockpit"
    key = hashlib.sha1(json.dumps([FORMAT, versions()], sort_keys=True).encode()).hexdigest()[:16]
    return root / f"config-schema-{key}.json"


def library_schema() -> dict[str, dict[str, dict]]:
    """The schema for the installed versions: from memory, the cache file, or built from the libraries."""
    global _memo
    if _memo is not None:
        return _memo
    path = cache_file()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and {
            *(m.schema_section for m in methods.REGISTRY.values()),
            "lora",
            "quantization",
        } <= set(data):
            _memo = data
            return data
    except (OSError, ValueError):
        pass
    data = build_schema()
    with contextlib.suppress(
        OSError
    ):  # a read-only home: the schema is rebuilt next time, nothing else changes
        atomic_write_text(path, json.dumps(data))
    _memo = data
    return data


def build_schema() -> dict[str, dict[str, dict]]:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    # the training section of each method's runs: its TRL config class (training, training_dpo, training_kto)
    out = {m.schema_section: _dataclass_fields(m.config_class()) for m in methods.REGISTRY.values()}
    out["lora"] = _dataclass_fields(LoraConfig)
    import inspect

    quant = {}
    try:
        hints = typing.get_type_hints(BitsAndBytesConfig.__init__)
    except Exception:
        hints = {}
    for name, param in inspect.signature(BitsAndBytesConfig.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        if name in hints:
            quant[name] = describe(hints[name])
        elif isinstance(param.default, bool):
            quant[name] = {"kinds": ["bool"]}
        elif isinstance(param.default, float):
            quant[name] = {"kinds": ["float"]}
        else:
            quant[name] = {"kinds": ["any"]}
    out["quantization"] = quant
    for (section, key), choices in KNOWN_CHOICES.items():
        if key in out[section]:
            out[section][key] = {"kinds": ["str"], "choices": choices}
    return out


def _dataclass_fields(cls) -> dict[str, dict]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {}
    fields = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        spec = describe(hints.get(f.name, typing.Any))
        choices = f.metadata.get("choices") if f.metadata else None
        if choices and not spec.get("choices"):
            spec["choices"] = [c for c in choices if c is not None]
        fields[f.name] = spec
    return fields


def describe(tp) -> dict:
    """{"kinds": [...], "choices": [...]} for a type annotation; "any" where the library checks it itself."""
    kinds: list[str] = []
    choices: list = []

    def walk(t):
        origin = typing.get_origin(t)
        if origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(t):
                walk(arg)
        elif origin is typing.Literal:
            for value in typing.get_args(t):
                choices.append(value.value if isinstance(value, enum.Enum) else value)
                add({bool: "bool", int: "int", float: "float"}.get(type(value), "str"))
        elif t is type(None):
            add("none")
        elif t is bool:
            add("bool")
        elif t is int:
            add("int")
        elif t is float:
            add("float")
        elif t is str:
            add("str")
        elif isinstance(t, type) and issubclass(t, enum.Enum):
            add("str")
            choices.extend(str(m.value) for m in t)
        elif origin in (dict, typing.Dict) or t is dict:  # noqa: UP006
            add("dict")
        elif origin in (list, tuple, typing.List, typing.Tuple) or t in (list, tuple):  # noqa: UP006
            add("list")
        else:
            add("any")

    def add(kind):
        if kind not in kinds:
            kinds.append(kind)

    walk(tp)
    spec: dict = {"kinds": kinds or ["any"]}
    # A pattern like "pissa_niter_[number of iters]" is not a closed list of values
    if (
        choices
        and not any("[" in str(c) for c in choices)
        and all(isinstance(c, (str, int, float)) for c in choices)
    ):
        spec["choices"] = [c for c in choices if not isinstance(c, bool)]
        if not spec["choices"]:
            del spec["choices"]
    return spec
