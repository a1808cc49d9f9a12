"""Small shared pieces: sizes, the error type, progress records, tokenizer files. Imports no torch, so the
package (and `python -m core.merge --help`) stays light until a merge actually runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.files import FileTooLarge, NotRegularFile, read_bounded
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


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in `path`; a broken file is a MergeError naming it and `fix` (how to repair it)."""
    try:
        # a regular file of sane size only: a FIFO would block, /dev/zero never ends
        data = json.loads(read_bounded(path))
    except (NotRegularFile, FileTooLarge) as e:
        raise MergeError(f"{e}: {fix}") from None
    except OSError as e:
        raise MergeError(f"{path} cannot be read ({e.strerror or e}): {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise MergeError(f"{path} is not valid JSON ({e}): {fix}") from None
    except RecursionError:
        raise MergeError(f"{path} is nested too deeply to be a config: {fix}") from None
    if not isinstance(data, dict):
        kinds = {list: "a list", str: "a string", bool: "true/false", type(None): "null"}
        kind = kinds.get(type(data), "a number")
        raise MergeError(f"{path} does not hold a JSON object (it holds {kind}): {fix}")
    return data


def auto_model_class(config: dict):
    """The transformers auto class of a model's config.json: a vision-language model (a vision_config beside its
    language model) is built whole, vision tower and all, with AutoModelForImageTextToText; the rest are causal LMs."""
    import transformers  # seconds to import: only when a model is built

    vlm = isinstance(config.get("vision_config"), dict)
    return transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM


def is_vision_model(folder) -> bool:
    """The model folder's config.json has a vision_config (a VLM: Try it can ask about an image)."""
    try:
        return isinstance(
            json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("vision_config"), dict
        )
    except (OSError, ValueError, AttributeError):
        return False


def gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / MB:.1f} MB"


def tokenizer_source(adapter_dir: Path, base_dir: Path) -> Path:
    # A run's adapter folder carries the tokenizer it trained with (maybe with added tokens): prefer it.
    return adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir


def load_tokenizer(path: Path):
    # transformers takes seconds to import; this module is part of the light `python -m core.merge --help`
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
