"""The bundled preset nearest by name to a model id the planner cannot reach: 'Qwen/Qwen2.5-7B-Instruct' offline
and not cached is planned as 'Qwen/Qwen2.5-7B' (a fine-tune keeps its base's shapes), not as a Llama-2 preset.

Names only: the family (organisation and name without its size and its fine-tune suffixes) must match closely,
then the nearest size wins. Ground layer: no torch, no transformers, nothing read from disk.
"""

from __future__ import annotations

import math
import re
from difflib import SequenceMatcher

from core.fmt import command

# Suffixes that name a fine-tune or a packaging of a base model, not another architecture.
VARIANTS = {
    "instruct", "chat", "it", "hf", "base", "sft", "dpo", "rlhf", "awq", "gptq", "gguf", "bnb", "4bit", "8bit",
    "fp16", "bf16", "int4", "int8",
}  # fmt: skip
SIZE = re.compile(r"^(\d+(?:\.\d+)?)([bm])$")  # 7b, 1.5b, 135m
FAMILY_MATCH = 0.8  # how close two families must be to suggest one for the other


def _parts(model_id: str) -> tuple[str, float | None]:
    """('qwen/qwen2.5', 7.0) for 'Qwen/Qwen2.5-7B-Instruct': the family and the size in billions of parameters."""
    org, _, name = model_id.strip().lower().rpartition("/")
    size, kept = None, []
    for token in re.split(r"[-_]", name.partition("@")[0]):
        found = SIZE.match(token)
        if found and size is None:
            size = float(found.group(1)) / (1000 if found.group(2) == "m" else 1)
        elif token and token not in VARIANTS:
            kept.append(token)
    return f"{org}/{'-'.join(kept)}", size


def nearest_preset(model_id: str, presets: list[str]) -> str | None:
    """The preset of the closest family, and within it the closest size; None when no family is close."""
    family, size = _parts(model_id)
    scored = []
    for preset in presets:
        their_family, their_size = _parts(preset)
        # a repackaging under another organisation (unsloth/Qwen2.5-7B-Instruct-bnb-4bit) is matched by its name
        match = max(
            SequenceMatcher(None, family, their_family).ratio(),
            0.95 * SequenceMatcher(None, family.partition("/")[2], their_family.partition("/")[2]).ratio(),
        )
        if match >= FAMILY_MATCH:
            apart = abs(math.log(size / their_size)) if size and their_size else math.inf
            scored.append((-round(match, 2), apart, preset))
    return min(scored)[2] if scored else None


def suggestion(model_id: str, presets: list[str]) -> str:
    """The sentence an 'Unknown model' message ends with: the nearest preset by name, else a few to pick from."""
    near = nearest_preset(model_id, presets)
    if near is None:
        return (
            f"Pick a bundled preset such as {', '.join(presets[:3])} (full list: {command('estimate')} "
            "--list-models)."
        )
    same = _parts(near) == _parts(model_id)
    return (
        f"The nearest bundled preset by name is {near}"
        + (" (the same architecture: a fine-tune keeps its base's shapes)" if same else "")
        + ": pick it to plan offline."
    )
