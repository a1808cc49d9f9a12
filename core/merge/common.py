"""Small shared pieces: sizes, the error type, progress records, tokenizer files. Imports no torch, so the
package (and `python -m core.merge --help`) stays light until a merge actually runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.files import BadFile, load_json_object, read_json_object
from core.fmt import disk

GB = 1024**3
MB = 1024**2

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


class MergeError(ValueError):
    """A user-facing problem with a merge; the message says what is wrong and how to fix it."""


@dataclass
class MergeProgress:
    phase: str  # "merge", "verify", "done"
    tensors_done: int
    tensors_total: int
    bytes_written: int
    bytes_total: int
    key: str = ""


ProgressFn = Callable[[MergeProgress], None]


def progress_sentence(progress: dict) -> str:
    """A merge job's progress (core.jobs' run_merge report) in words; before anything is counted it says what it
    is doing, never '0/0 tensors, 0 B of 0 B written'."""
    total, done = progress.get("total") or 0, progress.get("done") or 0
    label = {"merge": "Merging", "verify": "Verifying", "done": "Done"}.get(progress.get("phase"))
    if progress.get("phase") == "preflight":
        return "Preflight passed: the merge starts…"
    if label is None or not total:
        return "Preflight: reading the adapter and the base, checking RAM and disk…"
    return (
        f"{label}: {done}/{total} tensors, {disk(progress.get('bytes_done') or 0)} of "
        f"{disk(progress.get('bytes_total') or 0)} written"
    )


def load_json(path: Path, fix: str) -> dict:
    """The JSON object in `path` (core.files.load_json_object: bounded, regular files only, so a FIFO never
    blocks); a broken file is a MergeError naming it and `fix` (how to repair it)."""
    try:
        return load_json_object(path)
    except BadFile as e:
        raise MergeError(f"{path} {e.why}: {fix}") from None


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
