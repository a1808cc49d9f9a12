"""Where a plan's model numbers come from, in one line: the bundled preset, the local folder, or the Hub id @
its commit with the exact parameter count and dtypes its safetensors headers give (read without the weights)."""

from __future__ import annotations

from pathlib import Path

from core.estimate.model_config import _presets
from core.hub import ids as hub_ids


def source_line(model: str) -> str:
    """Where a plan's model numbers come from: the preset, the local folder, or the Hub id @ its commit (with the
    exact parameter count and dtypes of the safetensors headers)."""
    model = str(model).strip()
    if model in _presets():
        return f"model numbers from: the bundled preset {model} (its config.json fields; nothing downloaded)"
    if Path(model).expanduser().exists():
        return f"model numbers from: the local folder {Path(model).expanduser()} (its config.json)"
    ref = hub_ids.parse(model)
    if ref is None:
        return f"model numbers from: the cached config of {model} (the local Hugging Face cache)"
    from core.hub.remote import facts, weights

    try:
        found = facts(ref)
        w = weights(found)
    except hub_ids.HubError as exc:
        return f"model numbers from: the Hub's config.json of {ref} (safetensors headers not read: {exc})"
    if found.cached_only:
        headers = f" + the cached safetensors headers: {w.label()}" if w else " (offline: headers not read)"
        return f"model numbers from: the cache, {found.label()} (offline): config.json{headers}"
    headers = (
        f" + safetensors headers: {w.label()}" if w else " (no safetensors weights to read headers from)"
    )
    return f"model numbers from: the Hub, {found.label()} ({hub_ids.endpoint()}): config.json{headers}"
