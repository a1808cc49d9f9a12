"""Tiny, local, deterministic models and tokenizers (tests, demo, benchmarks). Nothing is downloaded.

The tokenizer is character level over printable ASCII with a chat template, built with `tokenizers` and
saved as a normal transformers tokenizer folder, so every loading path is the real one.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out_dir: str | os.PathLike | None = None, chat_template: bool = True):
    """A character-level fast tokenizer (99 tokens + role markers); saved to `out_dir` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    roles = ["<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(SPECIALS + roles + list(string.printable[:95]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=roles,
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


# Mixture-of-experts families (transformers 5 stores their experts as fused 3-D parameters): a few small experts,
# two of them per token, and every layer sparse
MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
}


def tiny_config(arch: str = "llama", vocab_size: int = 102, **overrides):
    """A small config of a real architecture. `arch`: llama, qwen2, mistral, gemma2, phi3, gpt2, or one of the
    mixture-of-experts families in MOE (qwen3_moe, mixtral, gpt_oss)."""
    from transformers import AutoConfig

    if arch == "gpt2":
        base = dict(
            vocab_size=vocab_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        base = dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        if arch == "gemma2":
            base["head_dim"] = 16
        base.update(MOE.get(arch, {}))
        if arch == "gpt_oss":  # full attention in every layer (its default alternates with a sliding window)
            layers = overrides.get("num_hidden_layers", base["num_hidden_layers"])
            base["layer_types"] = ["full_attention"] * layers
            base["rope_parameters"] = {
                "rope_type": "default",
                "rope_theta": 150000.0,
            }  # no YaRN at 256 tokens
    base.update(overrides)
    return AutoConfig.for_model(arch, **base)


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    dtype=None,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Save a randomly initialised tiny model (and the char tokenizer) to `out_dir`; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    if tokenizer:
        build_tokenizer(out)
    return out
