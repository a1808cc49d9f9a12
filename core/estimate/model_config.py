"""Where a model's config.json comes from, for the planner: a bundled preset (core/estimate/presets.json), a local
model folder, a Hub id (its config.json alone, core.hub), or the local Hugging Face cache -- read and checked before
transformers builds anything from it (core.plausible), then turned into a transformers config."""

from __future__ import annotations

import json
import warnings
from functools import lru_cache
from pathlib import Path

from core.estimate.nearest import suggestion
from core.files import BadFile, decode_config_floats, load_json_object
from core.fmt import error_line
from core.hub import ids as hub_ids
from core.plausible import ImplausibleConfig, check_model_config

PRESETS_FILE = Path(__file__).with_name("presets.json")


class SpecError(ValueError):
    """A model that cannot be planned for; the message says what is wrong and how to fix it."""


def preset_ids() -> list[str]:
    return list(_presets())


@lru_cache(maxsize=1)
def _presets() -> dict[str, dict]:
    return json.loads(PRESETS_FILE.read_text())


def _config_from_dict(fields: dict, where: str):
    from transformers import AutoConfig

    fields = decode_config_floats(fields)
    try:  # before transformers builds anything from it: a lying config.json would allocate gigabytes
        check_model_config(fields, where)
    except ImplausibleConfig as exc:
        raise SpecError(str(exc)) from None
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise SpecError(f"{where} has no 'model_type', so transformers cannot tell which architecture it is.")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (
        Exception
    ) as exc:  # ValueError / KeyError, and huggingface_hub's strict dataclass checks' own types
        if model_type not in _known_model_types():
            raise SpecError(
                f"{where} has model_type '{model_type}', which this transformers version does not know; point at "
                "a model folder of an architecture transformers supports (or upgrade transformers)."
            ) from None
        raise SpecError(
            f"{where} is not a valid {model_type} config ({error_line(exc, 200)}); fix that file."
        ) from None


def _known_model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def _config_source(model: str) -> tuple[dict, str] | None:
    """The raw config fields of a preset, a local model folder or a Hub id (its config.json alone, no weights),
    and where they came from, read without torch or transformers; None for a name that only the local Hugging
    Face cache may know."""
    if model in _presets():
        return _presets()[model], f"The preset '{model}'"
    path = Path(model).expanduser()
    if not path.exists():
        ref = hub_ids.parse(model)
        return _hub_source(model, ref) if ref is not None else None
    if path.is_file() and path.name == "config.json":
        path = path.parent
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.is_file():
        raise SpecError(
            f"The folder '{path}' has no config.json; point at a Hugging Face model folder "
            "(the one that holds config.json and the weights)."
        )
    try:  # core.files' bounded reader: a regular file of sane size (a model config is < 1 MiB), a JSON object
        data = load_json_object(cfg_file)
    except BadFile as exc:
        raise SpecError(
            f"{cfg_file} {exc.why}: a model's config.json is a small JSON object; fix or replace that file."
        ) from None
    return decode_config_floats(data), str(cfg_file)


def _hub_source(model: str, ref) -> tuple[dict, str]:
    from core.hub.fetch import config_json

    try:
        data, found = config_json(ref)
    except hub_ids.HubError as exc:
        raise SpecError(
            f"Unknown model '{model}': it is not a bundled preset id or a local folder, and {exc} "
            + suggestion(model, preset_ids())
        ) from None
    return decode_config_floats(data), f"The config.json of {found.label()}"


def load_model_config(model: str):
    """The transformers config for a preset id, a local folder, or a model id in the local HF cache."""
    model = str(model).strip()
    if not model:
        raise SpecError(
            "No model given: pick a preset (e.g. meta-llama/Llama-2-7b-hf) or a local model folder."
        )
    source = _config_source(model)
    if source is not None:
        return _config_from_dict(*source)
    # Last resort: a config the user already has in the local Hugging Face cache. Never touch the network.
    try:
        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception:
        cfg = None
    if cfg is not None:
        try:
            check_model_config(cfg.to_dict(), f"The cached config of {model}")
        except ImplausibleConfig as exc:
            raise SpecError(str(exc)) from None
        return cfg
    path = Path(model).expanduser()
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:  # meant as a folder, not a hub id
        raise SpecError(
            f"The folder '{path}' does not exist: give the path of a local model folder (the one that holds "
            "config.json), or pick a bundled preset."
        )
    raise SpecError(
        f"Unknown model '{model}': it is not a bundled preset, a local folder, a Hub id (ORG/NAME) or a model in "
        f"the local Hugging Face cache; give the path of a folder holding its config.json. "
        + suggestion(model, preset_ids())
    )
