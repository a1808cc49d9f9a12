"""What a model folder holds beside its weights, as the merge reads and copies it: the tokenizer and processor
files, the auto class its config builds, the tokenizer itself. Imports no torch (transformers on first use)."""

from __future__ import annotations

from pathlib import Path

from core.files import read_json_object

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    # a vision-language model's processor (image processor settings, image token): a merged VLM needs it to see
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


def auto_model_class(config: dict):
    """The transformers auto class of a model's config.json: a vision-language model (a vision_config beside its
    language model) is built whole, vision tower and all, with AutoModelForImageTextToText; the rest are causal LMs."""
    import transformers  # seconds to import: only when a model is built

    vlm = isinstance(config.get("vision_config"), dict)
    return transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM


def is_vision_model(folder) -> bool:
    """The model folder's config.json has a vision_config (a VLM: Try it can ask about an image)."""
    config = read_json_object(Path(folder) / "config.json")  # bounded, never a FIFO
    return isinstance((config or {}).get("vision_config"), dict)


def tokenizer_source(adapter_dir: Path, base_dir: Path) -> Path:
    # A run's adapter folder carries the tokenizer it trained with (maybe with added tokens): prefer it.
    return adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir


def load_tokenizer(path: Path):
    # transformers takes seconds to import; this module is part of the light `python -m core.merge --help`
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
