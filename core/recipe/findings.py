"""What every method's preflight shares: the Finding, the model-folder checks, the model's limits and the token
checks. Each training method (core.recipe.methods) builds its own data checks from these; core.train.preflight
runs the run's method.

Loads only the tokenizer and the model's config (no weights). Each finding names the rows (counted from 1, the
first record of the data being row 1) and the fix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from core.files import (
    MAX_TOKENIZER_JSON_BYTES,
    BadFile,
    load_json_object,
    read_bounded,
    read_json_object,
    read_safetensors_header,
)
from core.hub import ids as hub_ids
from core.hub.fetch import complete_folder, folder_for_checks, readable
from core.plausible import ImplausibleConfig, check_model_config

SHOW_ROWS = 20


@dataclass
class Finding:
    level: str  # "error" blocks the run, "warning" does not
    check: str  # short id: data, columns, chat_template, empty_rows, vocab, position_limit, truncation, ...
    message: str
    fix: str
    rows: list[int] = field(default_factory=list)  # 1-based row numbers

    def __str__(self) -> str:
        fix = f" Fix: {self.fix}" if self.fix else ""  # a message that already says how to fix it has none
        return f"{self.level.upper()} [{self.check}] {self.message}{fix}"


def format_rows(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:SHOW_ROWS]))
    return f"{shown} and {len(rows) - SHOW_ROWS} more" if len(rows) > SHOW_ROWS else shown


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model_folder(path, need_weights: bool = True) -> str | None:
    """None when `path` is a usable local model folder (or a Hub id, cached or on the Hub); else one sentence: what
    is wrong, where, how to fix it. Checks config.json and each safetensors header without loading weights."""

    if not isinstance(path, str) or not path.strip():
        return "model.path is empty: give the folder of a local model (config.json + weights)."
    folder = Path(path).expanduser()
    if not folder.is_dir():
        ref = hub_ids.parse(path)
        if ref is None:
            return (
                f"model.path: the folder {folder} does not exist. Nothing is downloaded here: give the folder of a "
                "local model (config.json, weights and tokenizer files), e.g. one saved with save_pretrained."
            )
        try:  # a Hub id: its cached snapshot, or (online) its config and tokenizer; the weights come at launch
            folder, need_weights = folder_for_checks(ref, need_weights)
        except hub_ids.HubError as exc:
            return f"model.path: {exc}"
    config = folder / "config.json"
    if not config.is_file():
        return f"model.path: {folder} has no config.json, so it is not a transformers model folder."
    try:  # bounded, and never blocks on a FIFO
        data = load_json_object(config)
    except BadFile as exc:
        return f"model.path: {config} {exc.why}: restore it from the model's original files."
    if not isinstance(data.get("model_type"), str):
        return f"model.path: {config} has no model_type: restore it from the model's original files."
    try:  # before transformers builds the model from it: a lying size would allocate gigabytes
        check_model_config(data, f"model.path: {config}")
    except ImplausibleConfig as exc:
        return str(exc)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"model.path: {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): save the "
            "tokenizer next to the weights (tokenizer.save_pretrained)."
        )
    if need_weights:
        weights = [p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
        if not weights:
            return (
                f"model.path: {folder} has no weights (*.safetensors or *.bin): the download is incomplete."
            )
        shapes: dict[str, list] = {}
        for shard in weights:
            problem = _safetensors_problem(shard, shapes) if shard.suffix == ".safetensors" else None
            if problem:
                return f"model.path: {shard} {problem}: download or copy that file again."
        problem = _contradiction(shapes, data)
        if problem:
            return f"model.path: {folder}: {problem}"
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = set(load_json_object(index)["weight_map"].values())
            except (BadFile, KeyError, TypeError, AttributeError):
                return f"model.path: {index} is not a valid shard index: download or copy it again."
            missing = sorted(f for f in files if not (folder / f).is_file())
            if missing:
                return f"model.path: {folder} lacks the shard(s) {', '.join(missing[:3])}: the download is incomplete."
    return None


def model_folder(path: str) -> Path | None:
    """The local folder `path` names: the folder itself, or a Hub id's complete snapshot in the local cache (the
    weights of one not downloaded yet come at launch); None if neither."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    ref = hub_ids.parse(path)
    try:
        return complete_folder(ref) if ref is not None else None
    except hub_ids.HubError:
        return None


def loaded_weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers loads from `folder`: the shards its index lists, else model.safetensors
    (a stray copy or an adapter beside them is never loaded, so it is not the model's)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (read_json_object(index) or {}).get("weight_map")
        names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        return sorted(folder / n for n in names if isinstance(n, str) and (folder / n).is_file())
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


MISMATCH_FIX = (
    "the weights belong to another model, or config.json was edited: put the matching config.json back."
)
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
_LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def _contradiction(shapes: dict[str, list], config: dict) -> str | None:
    """The weights against config.json, from the safetensors headers alone: the embedding's rows and width (vocab
    x hidden) and the number of layers. Training would otherwise fail at load with a size-mismatch traceback, after
    --dry-run passed."""
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size", config.get("n_embd"))
    fix = MISMATCH_FIX
    sizes_known = isinstance(vocab, int) and isinstance(hidden, int)
    for name, shape in shapes.items():
        if sizes_known and name.endswith(EMBEDDINGS) and len(shape) == 2 and shape != [vocab, hidden]:
            return (
                f"the weights' {name} is {shape[0]:,} x {shape[1]:,}, config.json says vocab_size {vocab:,} x "
                f"hidden_size {hidden:,}: {fix}"
            )
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.search(name))}
    n = config.get("num_hidden_layers", config.get("n_layer"))
    if layers and isinstance(n, int) and max(layers) + 1 != n:
        return f"the weights hold {max(layers) + 1} layers, config.json says num_hidden_layers {n}: {fix}"
    return None


def safetensors_header(path: Path) -> dict | None:
    """The header of a safetensors file (tensor name -> dtype, shape, data_offsets), None where
    check_model_folder finds the file unreadable."""
    try:
        return read_safetensors_header(path).header
    except (BadFile, OSError):
        return None


def _safetensors_problem(path: Path, shapes: dict) -> str | None:
    """What is wrong with a weights file, from its header alone (core.files' one reader: "is truncated (...)",
    "is not a valid safetensors file (...)"), else None; the tensors' shapes go into `shapes`."""
    try:
        header = read_safetensors_header(path)
    except BadFile as exc:
        return exc.why
    except OSError as exc:  # a FIFO, a folder, unreadable
        return f"cannot be read ({exc.strerror or 'not a regular file'})"
    shapes.update((k, v["shape"]) for k, v in header.tensors.items())
    return None


class TokenizerError(ValueError):
    """The model folder's tokenizer does not load; the message names the file when one is damaged."""


TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def load_tokenizer_and_config(model_cfg: dict):
    """The tokenizer and config of model_cfg's folder; TokenizerError (one sentence) when the tokenizer fails."""
    from transformers import AutoConfig, AutoTokenizer

    kw = {"trust_remote_code": model_cfg.get("trust_remote_code", False)}
    path = readable(model_cfg["path"])  # a Hub id: its config and tokenizer from the cache (no weights)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    except (
        Exception
    ) as exc:  # the json, tokenizers or sentencepiece library's own error: a property of the folder
        raise TokenizerError(tokenizer_problem(path, exc)) from None
    return tokenizer, AutoConfig.from_pretrained(path, **kw)


def tokenizer_problem(path: str, exc: Exception) -> str:
    """Why the tokenizer of `path` did not load, as one sentence: the damaged JSON file by name when there is one
    (the loader's own error names none), else the loader's first line."""
    from core.fmt import error_line

    fix = "copy the tokenizer files again from the original model (or save them with tokenizer.save_pretrained)."
    folder = model_folder(path) or Path(path)
    for name in TOKENIZER_JSON:
        file = folder / name
        if not file.exists():
            continue
        try:
            json.loads(read_bounded(file, MAX_TOKENIZER_JSON_BYTES))
        except (OSError, ValueError, RecursionError) as bad:
            why = "it is empty" if file.is_file() and file.stat().st_size == 0 else error_line(bad, 120)
            return f"model.path: the tokenizer file {file} is not valid JSON ({why}): {fix}"
    return f"model.path: the tokenizer in {folder} does not load ({error_line(exc, 200)}): {fix}"


def _text_config(model_config):
    getter = getattr(model_config, "get_text_config", None)
    return getter() if getter else model_config


def is_blank(v) -> bool:
    return v is None or (isinstance(v, str) and not v.strip())


def model_limits(model_config) -> tuple[int | None, int | None]:
    """(vocab_size, max positions) of a model config (its text config for multimodal ones), None where absent."""
    text_conf = _text_config(model_config) if model_config is not None else None
    vocab = getattr(text_conf, "vocab_size", None)
    max_pos = getattr(text_conf, "max_position_embeddings", None) or getattr(text_conf, "n_positions", None)
    return vocab, max_pos


def max_length_findings(max_length: int, max_pos: int | None) -> list[Finding]:
    """training.max_length beyond the model's positions: an error, for SFT and DPO alike."""
    if not (max_pos and max_length > max_pos):
        return []
    return [
        Finding(
            "error",
            "position_limit",
            f"training.max_length {max_length} is longer than the model's max_position_embeddings {max_pos}.",
            f"Set training.max_length to {max_pos} or less.",
        )
    ]


def token_findings(
    over_vocab: list[int], vocab: int, tokenizer_size: int, over_pos: list[int], max_pos: int, max_length: int
) -> list[Finding]:
    """The token checks SFT and DPO data share: ids beyond the model's vocabulary (an error: a device-side assert
    on the GPU), rows longer than its positions (a warning: they are cut at max_length)."""
    out = []
    if over_vocab:
        out.append(
            Finding(
                "error",
                "vocab",
                f"{len(over_vocab)} row(s) contain token ids >= the model's vocab_size {vocab} (the tokenizer has "
                f"{tokenizer_size} tokens): rows {format_rows(over_vocab)}.",
                "Use the model's own tokenizer, or resize the model's embeddings to the tokenizer before training.",
                rows=over_vocab,
            )
        )
    if over_pos:
        out.append(
            Finding(
                "warning",
                "position_limit",
                f"{len(over_pos)} row(s) are longer than max_position_embeddings {max_pos}: rows "
                f"{format_rows(over_pos)}. They are cut at training.max_length {max_length}.",
                "Shorten or split those rows if their ends matter.",
                rows=over_pos,
            )
        )
    return out
