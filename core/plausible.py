"""Refuse a model config.json that cannot describe a real model before anything is built from it.

A lying config.json (vocab_size 10^9, hidden_size 10^6 x 10^4 layers) makes transformers, peft or the GGUF vocab
reader allocate gigabytes and fail minutes later. Every reader that builds from a model's config (the planner's
meta model, the trainer's preflight and dry run, the GGUF export) checks it here first: one sentence naming the
key, its value and the plausible range. Ground layer: no imports from core.
"""

from __future__ import annotations

import json

HIDDEN = (1, 131_072)  # the largest real models: 16k-25k wide
LAYERS = (1, 1_024)  # the deepest: ~160
HEADS = (1, 4_096)
INNER = (1, 1_048_576)
EXPERTS = (0, 4_096)  # 0: a dense member of a MoE family (Granite 4.0-H Micro's num_local_experts)

LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 4_194_304),  # the largest vocabularies: ~260k tokens
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "intermediate_size": INNER,
    "moe_intermediate_size": INNER,
    "n_inner": INNER,
    "ffn_dim": INNER,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "num_layers": LAYERS,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": (1, 16_384),
    "max_position_embeddings": (1, 1 << 26),  # 64M positions: ten times the longest context offered
    "n_positions": (1, 1 << 26),
    "num_local_experts": EXPERTS,
    "num_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
}
MAX_EXPERT_BLOCKS = 65_536  # layers x experts: DeepSeek-V3 has 61 x 256 = 15,616
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


class ImplausibleConfig(ValueError):
    """A config value no real model has; the message names the key, its value and the plausible range."""


def check_model_config(config: dict, where: str = "config.json") -> None:
    """Raise ImplausibleConfig for the first size in `config` (or its text_config) outside LIMITS."""
    for part, prefix in ((config, ""), (config.get("text_config"), "text_config.")):
        if not isinstance(part, dict):
            continue
        # a config that says it is dense (Doge's is_moe false) builds no experts, whatever its expert count says
        # (transformers' default DogeConfig keeps num_experts 16,384 for its retrieval experts, which it leaves out)
        dense = part.get("is_moe") is False
        for key, (lo, hi) in LIMITS.items():
            value = part.get(key)
            if dense and key in EXPERT_KEYS:
                continue
            if value is None or isinstance(value, (list, dict)):  # per-layer sizes (Gemma 3n) are the model's
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ImplausibleConfig(
                    f"{where}: {prefix}{key} is {json.dumps(value)[:40]}, not a number; fix that file or point at "
                    "the right model folder."
                )
            if not lo <= value <= hi:
                raise ImplausibleConfig(
                    f"{where}: {prefix}{key} is {_num(value)}, which no real model has (plausible: {lo:,} to "
                    f"{hi:,}); fix that file or point at the right model folder."
                )
        layers = _first_int(part, ("num_hidden_layers", "n_layer", "num_layers"))
        experts = None if dense else _first_int(part, EXPERT_KEYS)
        if layers and experts and layers * experts > MAX_EXPERT_BLOCKS:
            raise ImplausibleConfig(
                f"{where}: {prefix}{layers:,} layers x {experts:,} experts is {layers * experts:,} expert blocks, "
                f"which no real model has (plausible: up to {MAX_EXPERT_BLOCKS:,}); fix that file or point at the "
                "right model folder."
            )


def _first_int(part: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = part.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _num(value) -> str:
    try:
        return f"{value:,}" if abs(value) < 1e18 else f"{value:.3g}"
    except (TypeError, ValueError, OverflowError):
        return repr(value)
