"""Training data: load rows with `datasets`, format them (alpaca, chat, raw text), tokenize, mask the prompt.

Every row becomes a list of text segments, each trainable or not; the segments are tokenized one by one and
concatenated, so the label mask follows the text exactly (prompt tokens get -100, answers keep their ids).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from core.files import quiet_datasets
from core.fmt import error_line
from core.hub import ids as hub_ids
from core.recipe import image_column

IGNORE_INDEX = -100

# A short Alpaca template (no preamble): the preamble only costs tokens and every model learns the markers.
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"

FORMAT_COLUMNS = {
    "alpaca": ("instruction", "output"),  # "input" is optional
    "chat": ("messages",),
    "text": ("text",),
}
_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """A data problem the user can fix; the message says what and where."""


# ---- loading ------------------------------------------------------------------------------------------------


def _as_paths(path: str | list[str]) -> list[Path]:
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    return [Path(p).expanduser() for p in paths]


def load_rows(data_cfg: dict):
    """The raw rows as a `datasets.Dataset`, with `data.columns` renamed to the expected names. A Hub dataset id
    (ORG/NAME[@REVISION], data.subset, data.split): the whole split when downloaded (a run fetches it first),
    else a streamed sample of its first rows (core.hub.rows.is_sample tells)."""
    ref = hub_ids.parse(data_cfg["path"], "dataset")
    ds = _hub_rows(ref, data_cfg) if ref is not None else _file_rows(data_cfg)
    renames = {user: expected for expected, user in (data_cfg.get("columns") or {}).items()}
    for user, expected in renames.items():
        if user in ds.column_names and user != expected:
            if expected in ds.column_names:
                ds = ds.remove_columns(expected)
            ds = ds.rename_column(user, expected)
    return image_column.undecoded(ds)  # images decoded batch by batch, a broken one named by preflight


def _hub_rows(ref, data_cfg: dict):
    from core.hub import rows

    try:
        return rows.load(ref, data_cfg)
    except hub_ids.HubError as exc:
        text = str(exc)
        if text.startswith("data."):
            raise DataError(text) from None
        raise DataError(
            f"data.path: {ref} is not a file or folder here (relative to {Path.cwd()}), and {text}"
        ) from None


def _file_rows(data_cfg: dict):
    import datasets

    paths = _as_paths(data_cfg["path"])
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise DataError(
            f"data.path: {', '.join(missing)} does not exist; check the path (relative to {Path.cwd()})."
        )
    if len(paths) == 1 and paths[0].is_dir():
        try:
            ds = datasets.load_from_disk(str(paths[0]))
        except Exception as exc:
            raise DataError(
                f"data.path {paths[0]} is a folder but not a datasets save_to_disk folder ({exc}); "
                "give a file or a folder written by Dataset.save_to_disk."
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            split = data_cfg.get("split", "train")
            if split not in ds:
                raise DataError(
                    f"data.split {split!r} is not in {paths[0]}: it has the splits {', '.join(ds)}."
                )
            ds = ds[split]
    else:
        kinds = {_LOADERS.get(p.suffix.lower()) for p in paths}
        if None in kinds or len(kinds) != 1:
            raise DataError(
                f"data.path: cannot read {', '.join(p.name for p in paths)}; use .json, .jsonl, .csv or .parquet "
                "files (all of one kind) or a save_to_disk folder."
            )
        kind = kinds.pop()
        for path in paths:  # a FIFO or a device would block the reader for ever (or feed it without end)
            if not path.is_file():
                raise DataError(
                    f"data.path: {path} is not a regular file (a pipe, a device or a socket); give a data file."
                )
            size = path.stat().st_size
            if size == 0 or (size < (1 << 20) and not path.read_bytes().strip()):
                raise DataError(f"data.path: {path} is empty; give a file with training rows.")
        if kind in ("json", "csv"):  # pyarrow keeps invalid UTF-8 as it is and fails on the row much later
            for path in paths:
                check_utf8(path)
        try:
            with quiet_datasets():
                ds = datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train")
        except Exception as exc:
            if kind == "json":
                for path in paths:
                    _check_json_lines(path)  # names the line; the loader's own error does not
            first = error_line(_root_cause(exc))
            raise DataError(f"data.path: could not read {', '.join(map(str, paths))}: {first}") from None
    return ds


def _root_cause(exc: BaseException) -> BaseException:
    """The library error under datasets' own "An error occurred while generating the dataset" (the parser's)."""
    seen = 0
    while (exc.__cause__ or exc.__context__) is not None and seen < 10:
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return exc


def check_utf8(path: Path, block: int = 1 << 20) -> None:
    """A text data file that is not UTF-8 (a Latin-1 or Windows-1252 export): DataError naming the first line
    that is not, read block by block (memory stays at one block, whatever the file's size)."""
    line, carry = 1, b""
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(block)
                data = carry + chunk
                cut = len(data) if not chunk else data.rfind(b"\n") + 1  # whole lines; the rest waits
                body, carry = data[:cut], data[cut:]
                try:
                    body.decode("utf-8")
                except UnicodeDecodeError as exc:
                    at = line + body.count(b"\n", 0, exc.start)
                    raise DataError(
                        f"data.path: line {at} of {path} is not UTF-8 text (byte 0x{body[exc.start]:02x}): save the "
                        "file as UTF-8 (an editor's 'save with encoding', or iconv -f latin1 -t utf-8), or fix that "
                        "line."
                    ) from None
                line += body.count(b"\n")
                if not chunk:
                    return
    except OSError as exc:
        raise DataError(f"data.path: {path} cannot be read ({exc.strerror}).") from None


JSON_ARRAY_CHECK_BYTES = 512 << 20  # the loader has just held a file this size in memory, and failed


def _check_json_lines(path: Path, max_lines: int = 2_000_000) -> None:
    """A .jsonl file line by line: the first line that is not a JSON object, by number. A .json file holding one
    array is parsed whole, for the line and column of its first error (the loader says "position 70")."""
    import json

    try:
        with open(path, "rb") as fh:
            head = fh.read(1024).lstrip()
            if head.startswith(b"["):
                if path.stat().st_size <= JSON_ARRAY_CHECK_BYTES:
                    fh.seek(0)
                    _check_json_array(path, fh.read())
                return
            fh.seek(0)
            for n, line in enumerate(fh, 1):
                if n > max_lines or not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    raise DataError(
                        f"data.path: line {n} of {path} is not valid JSON (a JSON Lines file has one object per "
                        "line): fix or remove that line."
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"data.path: line {n} of {path} is not a JSON object ({{...}}): fix that line."
                    )
    except OSError as exc:
        raise DataError(f"data.path: {path} cannot be read ({exc.strerror}).") from None


def _check_json_array(path: Path, data: bytes) -> None:
    import json

    try:
        json.loads(data)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"data.path: {path} is not valid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg}): fix the "
            "file there."
        ) from None
    except (ValueError, RecursionError):
        return  # the loader's own error says it


def detect_format(columns: list[str], requested: str = "auto") -> str:
    """The data format: the requested one, or the first whose columns are present (chat, alpaca, text)."""
    if requested != "auto":
        return requested
    for fmt in ("chat", "alpaca", "text"):
        if all(c in columns for c in FORMAT_COLUMNS[fmt]):
            return fmt
    raise DataError(
        f"Cannot tell the data format from the columns {', '.join(columns) or '(none)'}: expected 'messages' "
        "(chat), 'instruction' + 'output' (alpaca) or 'text'. Rename columns with data.columns, e.g. "
        "{output: answer}, or set data.format."
    )


def missing_columns(columns: list[str], fmt: str) -> list[str]:
    return [c for c in FORMAT_COLUMNS[fmt] if c not in columns]


# ---- formatting ---------------------------------------------------------------------------------------------


def _chat_segments(messages: list[dict], tokenizer) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, is_assistant) using the template on growing prefixes."""

    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages)
    segments, cur = [], 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start, end = len(render(messages[:i], gen=True)), len(render(messages[: i + 1]))
        if not (cur <= start <= end <= len(full)):
            raise DataError(
                "the chat template does not render conversations prefix by prefix; use data.format text"
            )
        segments += [(full[cur:start], False), (full[start:end], True)]
        cur = end
    segments.append((full[cur:], False))
    return [s for s in segments if s[0]]


def row_segments(row: dict, fmt: str, tokenizer) -> list[tuple[str, bool]]:
    """The row as text segments, each (text, trainable). EOS is appended to what the model must learn to end."""
    eos = tokenizer.eos_token or ""
    if fmt == "alpaca":
        extra = row.get("input")
        template = ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT
        prompt = template.format(instruction=row.get("instruction") or "", input=extra or "")
        return [(prompt, False), (str(row.get("output") or "") + eos, True)]
    if fmt == "chat":
        messages = row.get("messages")
        ok = isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        # an empty or malformed conversation is an empty row: preflight reports it with its row number
        return _chat_segments(messages, tokenizer) if ok and messages else []
    if fmt == "text":
        return [(str(row.get("text") or "") + eos, True)]
    raise DataError(f"data.format {fmt!r} is unknown: use alpaca, chat or text.")


def tokenize_row(row: dict, fmt: str, tokenizer, max_length: int, mask_prompt: bool = True) -> dict:
    """input_ids/labels (truncated to max_length) plus `length`, the token count before truncation."""
    ids: list[int] = []
    labels: list[int] = []
    # Chat templates usually write BOS themselves; for the others add it like the tokenizer would.
    if fmt != "chat" and tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
        labels.append(IGNORE_INDEX)
    for text, trainable in row_segments(row, fmt, tokenizer):
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        labels += seg if (trainable or not mask_prompt) else [IGNORE_INDEX] * len(seg)
    return {"input_ids": ids[:max_length], "labels": labels[:max_length], "length": len(ids)}


def last_answer_span(labels: list[int]) -> tuple[int, int] | None:
    """(start, end) of the last run of trained tokens in a row's labels (its last answer), or None: what an
    evaluation asks (the tokens before it) and scores (the answer itself)."""
    end = next((i + 1 for i in range(len(labels) - 1, -1, -1) if labels[i] != IGNORE_INDEX), None)
    if end is None:
        return None
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start, end


def tokenize_dataset(ds, fmt: str, tokenizer, max_length: int, mask_prompt: bool = True):
    return ds.map(
        lambda row: tokenize_row(row, fmt, tokenizer, max_length, mask_prompt),
        remove_columns=ds.column_names,
        keep_in_memory=True,  # no cache files next to the user's data
        desc="tokenizing",
    )


def prepare_datasets(cfg: dict, tokenizer):
    """(train, eval or None) tokenized datasets for the run config; raises DataError on unusable data."""
    data = cfg["data"]
    ds = load_rows(data)
    fmt = detect_format(ds.column_names, data["format"])
    if missing_columns(ds.column_names, fmt):
        raise DataError(
            f"data: format {fmt} needs the columns {', '.join(missing_columns(ds.column_names, fmt))}."
        )
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.format is chat but the tokenizer has no chat template: use a chat model or text."
        )
    tok = tokenize_dataset(ds, fmt, tokenizer, cfg["training"]["max_length"], data["mask_prompt"])
    tok = tok.filter(lambda r: any(label != IGNORE_INDEX for label in r["labels"]), keep_in_memory=True)
    if len(tok) == 0:
        raise DataError("data: no row has a token left to learn after masking and truncation; run preflight.")
    return split_eval(tok, cfg)


def split_eval(ds, cfg: dict):
    """(train, held-out or None): data.eval_split of the rows held out with training.seed (at least 4 rows)."""
    share = cfg["data"]["eval_split"]
    if share > 0 and len(ds) >= 4:
        parts = ds.train_test_split(test_size=share, seed=cfg["training"]["seed"])
        return parts["train"], parts["test"]
    return ds, None


class Collator:
    """Right-pads a batch (labels with -100) and counts the real tokens it hands to the model (for tokens/s)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id
        self.tokens_seen = 0
        self.samples_seen = 0

    def __call__(self, features: list[dict]) -> dict:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        n = len(features)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, f in enumerate(features):
            k = len(f["input_ids"])
            input_ids[i, :k] = torch.tensor(f["input_ids"], dtype=torch.long)
            labels[i, :k] = torch.tensor(f["labels"], dtype=torch.long)
            attention[i, :k] = 1
        if not features[0].get("is_eval"):
            self.tokens_seen += int(attention.sum())
            self.samples_seen += n
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


# ---- preview for the UI -------------------------------------------------------------------------------------


def preview_dataset(
    data_cfg: dict, tokenizer, n: int = 5, length_rows: int = 5000, max_length: int = 512
) -> dict[str, Any]:
    """The first `n` rows as the model will see them, and token lengths (first `length_rows`) for a histogram.

    Returns {"format", "rows": [{"row", "prompt", "completion", "n_tokens", "n_trained"}], "lengths",
    "max_length", "truncated", "total_rows"}. `prompt` is the masked text, `completion` the trained text.
    """
    ds = load_rows(data_cfg)
    fmt = detect_format(ds.column_names, data_cfg.get("format", "auto"))
    missing = missing_columns(ds.column_names, fmt)
    if missing:
        raise DataError(
            f"data: format {fmt} needs the columns {', '.join(missing)} (have {', '.join(ds.column_names)})."
        )
    rows = []
    for i in range(min(n, len(ds))):
        segs = row_segments(ds[i], fmt, tokenizer)
        enc = tokenize_row(ds[i], fmt, tokenizer, max_length, data_cfg.get("mask_prompt", True))
        rows.append(
            {
                "row": i + 1,
                "prompt": "".join(t for t, trainable in segs if not trainable),
                "completion": "".join(t for t, trainable in segs if trainable),
                "n_tokens": enc["length"],
                "n_trained": sum(label != IGNORE_INDEX for label in enc["labels"]),
            }
        )
    sample = ds.select(range(min(length_rows, len(ds))))
    lengths = [tokenize_row(r, fmt, tokenizer, max_length)["length"] for r in sample]
    from core.hub.rows import is_sample

    return {
        "format": fmt,
        "rows": rows,
        "lengths": lengths,
        "max_length": max_length,
        "truncated": sum(n_tok > max_length for n_tok in lengths),
        "total_rows": len(ds),
        "sample": is_sample(
            ds
        ),  # a Hub dataset not downloaded: 'a streamed sample of the first N rows of ...'
    }


def sample_prompts(data_cfg: dict, n: int = 3) -> list[str]:
    """The first `n` prompts of SFT data as a user would type them (the instruction, the first user message, or
    the start of a text row): what "Try it" should ask an adapter trained on this data."""
    try:
        ds = load_rows(data_cfg)
        fmt = detect_format(ds.column_names, data_cfg.get("format", "auto"))
    except DataError:
        return []
    out: list[str] = []
    for row in ds.select(range(min(len(ds), 50))):
        if fmt == "alpaca":
            text = str(row.get("instruction") or "") + (f"\n\n{row['input']}" if row.get("input") else "")
        elif fmt == "chat":
            messages = row.get("messages") if isinstance(row.get("messages"), list) else []
            text = next(
                (m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"), ""
            )
            if isinstance(text, list):  # an image conversation's entries: its text ones
                text = " ".join(str(c.get("text") or "") for c in text if isinstance(c, dict))
        else:
            text = str(row.get("text") or "")[:60]
        if add_unique(out, text, n):
            break
    return out


def add_unique(out: list[str], text, n: int) -> bool:
    """Append `text` (stripped) to `out` unless empty or there already; True once `out` holds n."""
    text = str(text or "").strip()
    if text and text not in out:
        out.append(text)
    return len(out) >= n


# The user turn inside a prompt already rendered with a chat template (demo/Llama-2 style, ChatML, Llama 3)
_RENDERED_USER = re.compile(
    r"(?:<\|user\|>|<\|im_start\|>user\n|<\|start_header_id\|>user<\|end_header_id\|>)\s*(.*?)"
    r"(?:</s>|<\|im_end\|>|<\|eot_id\|>|<\|end\|>)",
    re.S,
)


def user_text(prompt) -> str:
    """What the user typed in a preference row's prompt: its user message, or the user turn inside a prompt
    already rendered with a chat template, or the text itself."""
    if isinstance(prompt, list):
        return next((m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"), "")
    users = _RENDERED_USER.findall(prompt or "")
    return users[-1] if users else (prompt or "")
