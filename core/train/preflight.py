"""Preflight: check the data against the tokenizer and the model config before any GPU work.

Loads only the tokenizer and the model's config (no weights), so it takes seconds and can run from the UI.
Each finding names the rows (counted from 1, the first record of the data being row 1) and the fix.

CLI: python -m core.preflight run.yaml   (exit 1 when there is an error)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from core.train.data import (
    FORMAT_COLUMNS,
    IGNORE_INDEX,
    DataError,
    detect_format,
    load_rows,
    missing_columns,
    tokenize_row,
)

SHOW_ROWS = 20


@dataclass
class Finding:
    level: str  # "error" blocks the run, "warning" does not
    check: str  # short id: data, columns, chat_template, empty_rows, vocab, position_limit, truncation, ...
    message: str
    fix: str
    rows: list[int] = field(default_factory=list)  # 1-based row numbers

    def __str__(self) -> str:
        return f"{self.level.upper()} [{self.check}] {self.message} Fix: {self.fix}"


def format_rows(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:SHOW_ROWS]))
    return f"{shown} and {len(rows) - SHOW_ROWS} more" if len(rows) > SHOW_ROWS else shown


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model_folder(path, need_weights: bool = True) -> str | None:
    """None when `path` is a usable local model folder (or a hub id in the local cache); else one sentence: what
    is wrong, where, how to fix it. Checks config.json and each safetensors header without loading weights."""
    import json

    if not isinstance(path, str) or not path.strip():
        return "model.path is empty: give the folder of a local model (config.json + weights)."
    folder = Path(path).expanduser()
    if not folder.is_dir():
        cached = _cached_hub_folder(path)
        if cached is None:
            return (
                f"model.path: the folder {folder} does not exist. Nothing is downloaded here: give the folder of a "
                "local model (config.json, weights and tokenizer files), e.g. one saved with save_pretrained."
            )
        folder = cached
    config = folder / "config.json"
    if not config.is_file():
        return f"model.path: {folder} has no config.json, so it is not a transformers model folder."
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return f"model.path: {config} is not valid JSON: restore it from the model's original files."
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        return f"model.path: {config} has no model_type: restore it from the model's original files."
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
        for shard in weights:
            problem = _safetensors_problem(shard) if shard.suffix == ".safetensors" else None
            if problem:
                return f"model.path: {shard} is {problem}: download or copy that file again."
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                return f"model.path: {index} is not a valid shard index: download or copy it again."
            missing = sorted(f for f in files if not (folder / f).is_file())
            if missing:
                return f"model.path: {folder} lacks the shard(s) {', '.join(missing[:3])}: the download is incomplete."
    return None


def _cached_hub_folder(repo_id: str):
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # not a valid repo id, no cache
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def _safetensors_problem(path: Path) -> str | None:
    """'truncated' / 'not a safetensors file' from the header alone (8-byte length + JSON), else None."""
    import json
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return "truncated (shorter than a safetensors header)"
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                return "not a valid safetensors file (its header length is wrong)"
            header = json.loads(fh.read(n))
    except (OSError, ValueError, RecursionError):
        return "not a valid safetensors file (unreadable header)"
    if not isinstance(header, dict):
        return "not a valid safetensors file (unreadable header)"
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__"
        and isinstance(v, dict)
        and isinstance(v.get("data_offsets"), list)
        and len(v["data_offsets"]) == 2
    ]
    if ends and 8 + n + max(ends) > size:
        return f"truncated ({size:,} bytes, its header describes {8 + n + max(ends):,})"
    return None


def load_tokenizer_and_config(model_cfg: dict):
    from transformers import AutoConfig, AutoTokenizer

    kw = {"trust_remote_code": model_cfg.get("trust_remote_code", False)}
    return AutoTokenizer.from_pretrained(model_cfg["path"], **kw), AutoConfig.from_pretrained(
        model_cfg["path"], **kw
    )


def _text_config(model_config):
    getter = getattr(model_config, "get_text_config", None)
    return getter() if getter else model_config


def _is_blank(v) -> bool:
    return v is None or (isinstance(v, str) and not v.strip())


def _empty_rows(ds, fmt: str) -> list[int]:
    bad = []
    for i, row in enumerate(ds):
        if fmt == "chat":
            msgs = row.get("messages") or []
            blank = (
                not isinstance(msgs, list)
                or not msgs
                or not all(isinstance(m, dict) for m in msgs)  # a message that is not {role, content}
                or any(_is_blank(m.get("content")) for m in msgs)
                or not any(m.get("role") == "assistant" for m in msgs)
            )
        else:
            blank = any(_is_blank(row.get(c)) for c in FORMAT_COLUMNS[fmt])
        if blank:
            bad.append(i + 1)
    return bad


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


def run_preflight(cfg: dict, tokenizer=None, model_config=None) -> list[Finding]:
    """All findings for a validated run config; an empty list means the data is ready."""
    if cfg.get("method") == "dpo":
        from core.train.prefdata import run_pair_preflight

        return run_pair_preflight(cfg, tokenizer, model_config)
    data = cfg["data"]
    try:
        ds = load_rows(data)
    except DataError as exc:
        return [Finding("error", "data", str(exc), "Point data.path at a readable dataset.")]
    if len(ds) == 0:
        return [
            Finding("error", "data", f"{data['path']} has no rows.", "Give a dataset with at least one row.")
        ]
    try:
        fmt = detect_format(ds.column_names, data["format"])
    except DataError as exc:
        return [Finding("error", "columns", str(exc), "Rename columns with data.columns or set data.format.")]
    missing = missing_columns(ds.column_names, fmt)
    if missing:
        return [
            Finding(
                "error",
                "columns",
                f"Format {fmt} needs the column(s) {', '.join(missing)}; the data has {', '.join(ds.column_names)}.",
                f"Map your columns in data.columns, e.g. {{{missing[0]}: <your column>}}, or set data.format.",
                rows=list(range(1, len(ds) + 1)),
            )
        ]
    if tokenizer is None or model_config is None:
        tok, conf = load_tokenizer_and_config(cfg["model"])
        tokenizer, model_config = tokenizer or tok, model_config or conf
    findings: list[Finding] = []
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        findings.append(
            Finding(
                "error",
                "chat_template",
                f"The data is in chat format (messages) but the tokenizer of {cfg['model']['path']} has no chat "
                "template, so conversations cannot be rendered.",
                "Use an instruct/chat model's tokenizer, set tokenizer.chat_template, or convert rows to text.",
            )
        )
        return findings

    empty = _empty_rows(ds, fmt)
    if empty:
        findings.append(
            Finding(
                "error",
                "empty_rows",
                f"{len(empty)} row(s) are empty or whitespace only (or have no assistant turn): rows "
                f"{format_rows(empty)}.",
                "Remove or fill those rows.",
                rows=empty,
            )
        )

    vocab, max_pos = model_limits(model_config)
    max_length = cfg["training"]["max_length"]
    findings += max_length_findings(max_length, max_pos)

    over_vocab, over_pos, truncated, nothing_to_learn = [], [], [], []
    for i, row in enumerate(ds):
        try:
            enc = tokenize_row(row, fmt, tokenizer, 10**9, data["mask_prompt"])  # untruncated
        except DataError as exc:
            findings.append(Finding("error", "format", f"Row {i + 1}: {exc}.", "Fix or remove the row."))
            continue
        n = enc["length"]
        if vocab and any(t >= vocab or t < 0 for t in enc["input_ids"]):
            over_vocab.append(i + 1)
        if max_pos and n > max_pos:
            over_pos.append(i + 1)
        if n > max_length:
            truncated.append(i + 1)
        if (i + 1) not in empty and all(label == IGNORE_INDEX for label in enc["labels"][:max_length]):
            nothing_to_learn.append(i + 1)

    findings += token_findings(over_vocab, vocab, len(tokenizer), over_pos, max_pos, max_length)
    if truncated:
        pct = 100.0 * len(truncated) / len(ds)
        findings.append(
            Finding(
                "warning",
                "truncation",
                f"{len(truncated)} of {len(ds)} rows ({pct:.1f}%) would be truncated at training.max_length "
                f"{max_length}: rows {format_rows(truncated)}.",
                "Raise training.max_length (memory grows with it) or shorten those rows.",
                rows=truncated,
            )
        )
    if nothing_to_learn:
        findings.append(
            Finding(
                "warning",
                "no_labels",
                f"{len(nothing_to_learn)} row(s) have no answer tokens left within training.max_length {max_length} "
                f"(the prompt fills it): rows {format_rows(nothing_to_learn)}. They are skipped.",
                "Raise training.max_length or shorten those prompts.",
                rows=nothing_to_learn,
            )
        )
    return findings


def main(argv: list[str] | None = None) -> int:
    import argparse

    from core.train.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m core.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="run config YAML")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        problem = check_model_folder(
            cfg["model"]["path"], need_weights=False
        )  # the tokenizer and config only
        if problem:
            raise ConfigError(problem)
        findings = run_preflight(cfg)
    except (ConfigError, DataError, OSError, ValueError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: {text}", file=sys.stderr)
        return 2
    for f in findings:
        print(f, file=sys.stderr if f.level == "error" else sys.stdout)
    if not findings:
        print("preflight: no problems found")
    return 1 if has_errors(findings) else 0


if __name__ == "__main__":
    sys.exit(main())
