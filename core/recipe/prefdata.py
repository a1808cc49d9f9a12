"""Preference data for DPO: pairs of a better (`chosen`) and a worse (`rejected`) answer to one prompt.

Two formats, read from the same files as SFT data (core.recipe.data.load_rows: .jsonl, .json, .csv, .parquet or a
save_to_disk folder, with `data.columns` renames):

  standard        {"prompt": str, "chosen": str, "rejected": str}: the texts exactly as the model sees them
                  (DPOTrainer tokenizes prompt + answer as plain text and appends EOS to each answer).
  conversational  "chosen" and "rejected" are lists of {"role", "content"} messages, rendered with the
                  tokenizer's chat template. "prompt" (messages, or one text taken as the user turn) is optional:
                  without it the messages both conversations start with are the prompt (TRL's "implicit prompt",
                  split with trl.extract_prompt).

`normalize_pairs` turns rows into what trl.DPOTrainer (1.16) accepts: one dict per pair with exactly the keys
prompt, chosen and rejected, all strings or all message lists, so DPOTrainer does no prompt extraction of its own.
`check_pairs` reports problems as core.train.preflight Findings with 1-based row numbers; `pair_token_ids`
tokenizes a pair the way DPOTrainer does, so the length checks count the tokens training will see.
"""

from __future__ import annotations

import reprlib
from typing import Any

from core.fmt import error_line
from core.recipe.data import DataError, load_rows, split_eval
from core.recipe.findings import (
    Finding,
    format_rows,
    is_blank,
    load_tokenizer_and_config,
    max_length_findings,
    model_limits,
    token_findings,
)

PREF_FORMATS = ("standard", "conversational")
PAIR_KEYS = ("prompt", "chosen", "rejected")
_DETECT_ROWS = 1000  # rows looked at to tell the format (the first with a usable 'chosen' decides)

_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40
_short.maxlevel = 2
_short.maxlist = _short.maxdict = _short.maxtuple = 3


class _RowProblem(ValueError):
    """One row cannot become a pair: `check` is the Finding id, the message one sentence naming the row."""

    def __init__(self, check: str, message: str):
        super().__init__(message)
        self.check = check


def load_pref_rows(data_cfg: dict):
    """The raw rows of a preference data file (core.recipe.data.load_rows: same files, renames, errors)."""
    return load_rows(data_cfg)


# ---- format -------------------------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    """What a value is, in words, with a short safe excerpt (huge, nested or binary values stay short)."""
    if value is None:
        return "empty (null)"
    if isinstance(value, bool):
        return f"a true/false value ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({_short.repr(value)})"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"binary data ({len(value):,} bytes)"
    if isinstance(value, str):
        return f"text ({_short.repr(value)})"
    if isinstance(value, dict):
        return f"an object ({_short.repr(value)})"
    if isinstance(value, (list, tuple)):
        return f"a list ({_short.repr(value)})"
    return f"a {type(value).__name__}"


def _columns(rows) -> list[str]:
    names = getattr(rows, "column_names", None)
    if names is not None:
        return list(names)
    seen: dict[str, None] = {}
    for i, row in enumerate(rows):
        if i >= _DETECT_ROWS:
            break
        if isinstance(row, dict):
            seen.update((str(k), None) for k in row)
    return list(seen)


def detect_pref_format(rows, requested: str = "auto") -> str:
    """'standard' (prompt/chosen/rejected texts) or 'conversational' (message lists), from the columns and the
    first row whose 'chosen' is text or a list; raises DataError with one sentence when neither fits."""
    if requested != "auto":
        if requested not in PREF_FORMATS:
            raise DataError(
                f"data.format {requested!r} is not a preference format: use auto, standard or conversational."
            )
        return requested
    columns = _columns(rows)
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise DataError(
            f"Cannot use these rows as preference pairs: the column(s) {', '.join(missing)} are missing (the data has "
            f"{', '.join(columns[:20]) or 'no columns'}). Preference data needs 'chosen' and 'rejected' (and "
            "'prompt' for plain text); rename yours with data.columns, e.g. {chosen: better, rejected: worse}."
        )
    for i, row in enumerate(rows):
        if i >= _DETECT_ROWS:
            break
        value = row.get("chosen") if isinstance(row, dict) else None
        if isinstance(value, list):
            return "conversational"
        if isinstance(value, str):
            if "prompt" not in columns:
                raise DataError(
                    "The pairs are plain text but there is no 'prompt' column: add the prompt each answer replies "
                    "to (or map your column with data.columns, e.g. {prompt: question}), or give 'chosen' and "
                    "'rejected' as lists of {role, content} messages that start with the same user turn."
                )
            return "standard"
    raise DataError(
        f"Cannot tell the preference format: no row among the first {_DETECT_ROWS:,} has a 'chosen' that is text or "
        "a list of {role, content} messages. Give 'chosen' and 'rejected' as strings (with a 'prompt' column) or "
        "as message lists."
    )


# ---- one row -> one pair ------------------------------------------------------------------------------------


def _text(row: dict, key: str, n: int) -> str:
    value = row.get(key)
    if value is None:
        raise _RowProblem(
            "missing_keys",
            f"Row {n} has no '{key}': give every row a '{key}' text (or map your column to it with data.columns).",
        )
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # a CSV column of numbers
    if not isinstance(value, str):
        raise _RowProblem("wrong_types", f"Row {n}: '{key}' is {_kind(value)}, not text: make it a string.")
    return value


def _messages(row: dict, key: str, n: int) -> list[dict]:
    value = row.get(key)
    if value is None:
        raise _RowProblem(
            "missing_keys",
            f"Row {n} has no '{key}': give every row a '{key}' list of {{role, content}} messages (or map your "
            "column to it with data.columns).",
        )
    if not isinstance(value, (list, tuple)):
        raise _RowProblem(
            "wrong_types",
            f"Row {n}: '{key}' is {_kind(value)}, not a list of {{role, content}} messages like the other rows: "
            "make it one.",
        )
    out = []
    for j, m in enumerate(value, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"].strip()):
            raise _RowProblem(
                "wrong_types",
                f"Row {n}: message {j} of '{key}' is {_kind(m)}, not a {{role, content}} message with a role: "
                "give each message a 'role' (user, assistant, ...) and a text 'content'.",
            )
        content = m.get("content")
        if not isinstance(content, str):
            raise _RowProblem(
                "wrong_types",
                f"Row {n}: the content of message {j} of '{key}' is {_kind(content)}, not text: make it a string "
                "(multimodal content parts are not supported).",
            )
        out.append({"role": m["role"], "content": content})
    return out


def _strip_shared(prompt: list[dict], chosen: list[dict], rejected: list[dict]):
    """A prompt the conversations repeat is cut from them, or DPOTrainer would render it twice."""
    k = len(prompt)
    if k and chosen[:k] == prompt and rejected[:k] == prompt:
        return chosen[k:], rejected[k:]
    return chosen, rejected


def _normalize_row(row: Any, fmt: str, n: int) -> dict:
    if not isinstance(row, dict):
        raise _RowProblem(
            "row_type",
            f"Row {n} is {_kind(row)}, not a record with prompt/chosen/rejected: fix or remove that row.",
        )
    if fmt == "standard":
        return {key: _text(row, key, n) for key in PAIR_KEYS}
    if fmt != "conversational":
        raise DataError(f"data.format {fmt!r} is not a preference format: use standard or conversational.")
    chosen, rejected = _messages(row, "chosen", n), _messages(row, "rejected", n)
    prompt = row.get("prompt")
    if prompt is not None and not (isinstance(prompt, str) and not prompt.strip()):
        if isinstance(prompt, (list, tuple)):
            prompt = _messages(row, "prompt", n)
            chosen, rejected = _strip_shared(prompt, chosen, rejected)
        elif isinstance(prompt, str):
            starts_with_user = bool(chosen) and chosen[0]["role"] != "assistant"
            if not starts_with_user:  # answers only: the prompt text is the user's turn
                prompt = [{"role": "user", "content": prompt}]
                return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            prompt = None  # the conversations hold the prompt themselves (like trl.maybe_extract_prompt)
        else:
            raise _RowProblem(
                "wrong_types",
                f"Row {n}: 'prompt' is {_kind(prompt)}, not text or a list of {{role, content}} messages: fix it.",
            )
    if isinstance(prompt, list) and prompt:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if not chosen or not rejected:  # nothing to split; check_pairs reports the empty side
        return {"prompt": [], "chosen": chosen, "rejected": rejected}
    if chosen == rejected:  # what extract_prompt gives too, but also for one message; check_pairs reports it
        return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}
    from trl import extract_prompt  # the implicit prompt exactly as TRL splits it

    pair = extract_prompt({"chosen": chosen, "rejected": rejected})
    if not pair["prompt"]:
        raise _RowProblem(
            "no_prompt",
            f"Row {n}: 'chosen' and 'rejected' differ from their first message, so there is no shared prompt: start "
            "both with the same user message(s) or add a 'prompt' column.",
        )
    return {
        "prompt": list(pair["prompt"]),
        "chosen": list(pair["chosen"]),
        "rejected": list(pair["rejected"]),
    }


def normalize_pairs(rows, fmt: str = "auto") -> list[dict]:
    """One {prompt, chosen, rejected} dict per row, as trl.DPOTrainer 1.16 takes them: all three strings
    (standard) or all three lists of {role, content} messages (conversational, prompt split off). Raises
    DataError naming the first row that cannot be a pair; run check_pairs for all of them."""
    fmt = detect_pref_format(rows, fmt)
    pairs = []
    for i, row in enumerate(rows):
        try:
            pair = _normalize_row(row, fmt, i + 1)
        except _RowProblem as exc:
            raise DataError(str(exc)) from None
        if fmt == "conversational":
            empty = [k for k in PAIR_KEYS if not pair[k]]
            if empty:
                raise DataError(
                    f"Row {i + 1}: '{empty[0]}' has no messages (a pair needs a prompt and two answers): fill or "
                    "remove that row."
                )
        pairs.append(pair)
    return pairs


def pairs_dataset(pairs: list[dict]):
    """The pairs as a `datasets.Dataset` with the columns prompt, chosen and rejected (DPOTrainer's input)."""
    import datasets

    return datasets.Dataset.from_list([{k: p[k] for k in PAIR_KEYS} for p in pairs])


def prepare_pair_datasets(cfg: dict):
    """(train, eval or None) pair datasets of a `method: dpo` run config: its data read and normalized, the
    data.eval_split share held out with training.seed, as core.recipe.data.prepare_datasets does for SFT."""
    data = cfg["data"]
    pairs = normalize_pairs(load_pref_rows(data), data["format"])
    if not pairs:
        raise DataError(f"data: {data['path']} has no preference pairs.")
    return split_eval(pairs_dataset(pairs), cfg)


def check_rows_with_tokenizer(
    cfg: dict, read_rows, check, tokenizer=None, model_config=None
) -> list[Finding]:
    """The preflight of a method whose rows are checked against the tokenizer and the model config: the rows
    read by `read_rows(data_cfg)` (a data error is the one finding), then `check(rows, tokenizer, max_length,
    model_config, format)`. Loads the tokenizer and config when not given."""
    try:
        rows = read_rows(cfg["data"])
    except DataError as exc:
        return [Finding("error", "data", str(exc), "")]  # the data error says how to fix it
    if tokenizer is None or model_config is None:
        tok, conf = load_tokenizer_and_config(cfg["model"])
        tokenizer, model_config = tokenizer or tok, model_config or conf
    return check(rows, tokenizer, cfg["training"]["max_length"], model_config, cfg["data"]["format"])


def run_pair_preflight(cfg: dict, tokenizer=None, model_config=None) -> list[Finding]:
    """The preflight of a `method: dpo` config: the rows read, then check_pairs."""
    return check_rows_with_tokenizer(cfg, load_pref_rows, check_pairs, tokenizer, model_config)


# ---- tokens, as DPOTrainer makes them -----------------------------------------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def pair_token_ids(pair: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, chosen_ids, rejected_ids) of a normalized pair, as trl.DPOTrainer 1.16 tokenizes it:
    messages through the chat template (the prompt with the generation prompt), text through the tokenizer with
    EOS appended to each answer; the answers start where the prompt's tokens and prompt+answer's diverge."""
    prompt, chosen, rejected = pair["prompt"], pair["chosen"], pair["rejected"]
    if isinstance(prompt, list):

        def enc(messages, gen=False):
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=gen
            )
            return list(out["input_ids"])

        p, pc, pr = enc(prompt, True), enc(prompt + chosen), enc(prompt + rejected)
    else:
        eos = tokenizer.eos_token
        if eos is None:
            raise DataError(
                "The tokenizer has no eos_token, which DPOTrainer appends to every plain-text answer: use a "
                "tokenizer with one (or conversational pairs)."
            )

        def enc(text):
            return list(tokenizer(text=text)["input_ids"])

        p = enc(prompt)
        pc = enc(prompt + (chosen if chosen.endswith(eos) else chosen + eos))
        pr = enc(prompt + (rejected if rejected.endswith(eos) else rejected + eos))
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    return p[:n], pc[n:], pr[n:]


# ---- checks -------------------------------------------------------------------------------------------------

_STRUCTURE_FIXES = {
    "row_type": "Make every row a record (a JSON object) with prompt, chosen and rejected.",
    "missing_keys": "Fill those keys, or map your columns with data.columns (e.g. {chosen: better}).",
    "wrong_types": "Make chosen and rejected (and prompt) strings, or lists of {role, content} messages.",
    "no_prompt": "Start chosen and rejected with the same user message(s), or add a 'prompt' column.",
    "format": "Fix or remove those rows.",
}
_STRUCTURE_WHAT = {
    "row_type": "are not records",
    "missing_keys": "lack a key",
    "wrong_types": "have a value of the wrong type",
    "no_prompt": "have no shared prompt",
    "format": "cannot be rendered or tokenized",
}


def _blank(value) -> bool:
    if isinstance(value, list):
        return not value or all(is_blank(m.get("content")) for m in value)
    return is_blank(value)


def check_pairs(rows, tokenizer, max_length: int, model_config=None, fmt: str = "auto") -> list[Finding]:
    """Findings (core.recipe.findings.Finding, 1-based rows) for preference rows; an empty list means ready.

    Errors: no rows, unknown format, rows that are not records or lack/mistype a key, no chat template for
    messages, no EOS for text, an empty chosen or rejected, a prompt of max_length tokens or more (DPOTrainer
    drops it: nothing left to compare), every pair identical, token ids beyond the model's vocab_size, max_length
    beyond max_position_embeddings. Warnings: some pairs identical, pairs cut at max_length (or cut to the same
    tokens), pairs longer than max_position_embeddings."""
    try:
        n_rows = len(rows)
    except TypeError:
        rows = list(rows)
        n_rows = len(rows)
    if n_rows == 0:
        return [Finding("error", "data", "The preference data has no rows.", "Give at least one pair.")]
    try:
        fmt = detect_pref_format(rows, fmt)
    except DataError as exc:
        return [Finding("error", "columns", str(exc), "Rename columns with data.columns or set data.format.")]
    blocker = _tokenizer_problem(tokenizer, fmt)
    if blocker:
        return [blocker]
    vocab, max_pos = model_limits(model_config)
    tally = _scan_pairs(rows, fmt, tokenizer, max_length, vocab, max_pos)
    return max_length_findings(max_length, max_pos) + _pair_findings(
        tally, n_rows, max_length, vocab, max_pos, len(tokenizer)
    )


def _tokenizer_problem(tokenizer, fmt: str) -> Finding | None:
    """What stops a format from being tokenized at all: no chat template for messages, no EOS for texts."""
    if fmt == "conversational" and not getattr(tokenizer, "chat_template", None):
        return Finding(
            "error",
            "chat_template",
            "The pairs are conversations (message lists) but the tokenizer has no chat template, so they cannot "
            "be rendered.",
            "Use an instruct/chat model's tokenizer, set tokenizer.chat_template, or give plain-text pairs.",
        )
    if fmt == "standard" and getattr(tokenizer, "eos_token", None) is None:
        return Finding(
            "error",
            "eos",
            "The tokenizer has no eos_token, which DPOTrainer appends to every plain-text answer.",
            "Use a tokenizer with an EOS token, or give the pairs as conversations.",
        )

    return None


def _scan_pairs(rows, fmt: str, tokenizer, max_length: int, vocab, max_pos) -> dict:
    """Every row normalized and tokenized as DPOTrainer does: the rows of each problem, by kind."""
    structure: dict[str, tuple[list[int], str]] = {}
    empty, identical, long_prompt, truncated, cut_same, over_vocab, over_pos = [], [], [], [], [], [], []
    n_pairs = 0
    for i, row in enumerate(rows):
        n = i + 1
        try:
            pair = _normalize_row(row, fmt, n)
        except _RowProblem as exc:
            structure.setdefault(exc.check, ([], str(exc)))[0].append(n)
            continue
        n_pairs += 1
        if _blank(pair["chosen"]) or _blank(pair["rejected"]):
            empty.append(n)
            continue
        if pair["chosen"] == pair["rejected"]:
            identical.append(n)
            if isinstance(pair["prompt"], list) and not pair["prompt"]:
                continue  # one identical message each: nothing to tokenize as a pair
        try:
            p, c, r = pair_token_ids(pair, tokenizer)
        except Exception as exc:  # a chat template that raises on this conversation, an odd tokenizer
            first = error_line(exc, 200)
            structure.setdefault("format", ([], f"Row {n} cannot be rendered or tokenized: {first}."))[
                0
            ].append(n)
            continue
        if vocab and any(t >= vocab or t < 0 for t in (*p, *c, *r)):
            over_vocab.append(n)
        longest = len(p) + max(len(c), len(r))
        if max_pos and longest > max_pos:
            over_pos.append(n)
        if len(p) >= max_length:
            long_prompt.append(n)
        elif longest > max_length:
            truncated.append(n)
            room = max_length - len(p)
            if c != r and c[:room] == r[:room]:
                cut_same.append(n)
    return dict(
        structure=structure,
        empty=empty,
        identical=identical,
        long_prompt=long_prompt,
        truncated=truncated,
        cut_same=cut_same,
        over_vocab=over_vocab,
        over_pos=over_pos,
        n_pairs=n_pairs,
    )


def _pair_findings(t: dict, n_rows: int, max_length: int, vocab, max_pos, vocab_len: int) -> list[Finding]:
    """The tally of _scan_pairs as findings, errors first."""
    structure, empty, identical, n_pairs = t["structure"], t["empty"], t["identical"], t["n_pairs"]
    long_prompt, truncated, cut_same = t["long_prompt"], t["truncated"], t["cut_same"]
    findings: list[Finding] = []
    for check, (bad, first) in structure.items():
        findings.append(
            Finding(
                "error",
                check,
                f"{len(bad)} row(s) {_STRUCTURE_WHAT[check]}: rows {format_rows(bad)}. {first}",
                _STRUCTURE_FIXES[check],
                rows=bad,
            )
        )
    if empty:
        findings.append(
            Finding(
                "error",
                "empty_pairs",
                f"{len(empty)} row(s) have an empty or whitespace-only chosen or rejected answer: rows "
                f"{format_rows(empty)}.",
                "Fill or remove those rows: a pair needs two real answers to compare.",
                rows=empty,
            )
        )
    if identical:
        every = len(identical) == n_pairs
        findings.append(
            Finding(
                "error" if every else "warning",
                "identical_pairs",
                f"{len(identical)} row(s) have a chosen answer identical to the rejected one"
                f"{' (all of them)' if every else ''}: rows {format_rows(identical)}. Such a pair teaches nothing "
                "(its DPO loss is a constant).",
                "Check the columns (is 'rejected' a copy of 'chosen'?) and remove pairs that do not differ.",
                rows=identical,
            )
        )
    if long_prompt:
        findings.append(
            Finding(
                "error",
                "prompt_too_long",
                f"{len(long_prompt)} row(s) have a prompt of training.max_length {max_length} tokens or more: rows "
                f"{format_rows(long_prompt)}. Nothing of their answers is left to compare (DPOTrainer drops them).",
                "Raise training.max_length (memory grows with it) or shorten those prompts.",
                rows=long_prompt,
            )
        )
    findings += token_findings(t["over_vocab"], vocab, vocab_len, t["over_pos"], max_pos, max_length)
    if truncated:
        pct = 100.0 * len(truncated) / n_rows
        findings.append(
            Finding(
                "warning",
                "truncation",
                f"{len(truncated)} of {n_rows} pairs ({pct:.1f}%) would be cut at training.max_length {max_length} "
                f"(prompt + the longer answer): rows {format_rows(truncated)}. Only the kept start of each answer "
                "is compared.",
                "Raise training.max_length (memory grows with it) or shorten those rows.",
                rows=truncated,
            )
        )
    if cut_same:
        findings.append(
            Finding(
                "warning",
                "truncated_identical",
                f"{len(cut_same)} pair(s) differ only after training.max_length {max_length}, so what is kept of "
                f"chosen and rejected is the same: rows {format_rows(cut_same)}. They teach nothing.",
                "Raise training.max_length or shorten the prompts of those rows.",
                rows=cut_same,
            )
        )
    return findings


# ---- preview for the UI -------------------------------------------------------------------------------------


def _shorten(text: str, width: int) -> str:
    text = "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd" for ch in text[: 4 * width])
    if len(text) <= width:
        return text
    head = max(1, (width - 3) * 2 // 3)
    return text[:head] + " … " + text[-max(1, width - 3 - head) :]


def _as_text(value) -> str:
    if isinstance(value, list):
        return "\n".join(f"{m['role']}: {m['content']}" for m in value)
    return value


def preview_pairs(rows, n: int = 5, fmt: str = "auto", width: int = 300) -> list[dict]:
    """The first `n` rows side by side, as DPOTrainer will get them: [{"row", "prompt", "chosen", "rejected",
    "problem"}], texts shortened to about `width` characters (start and end kept), messages as "role: content"
    lines. `problem` is None, or the sentence saying why that row is not a pair. Raises DataError when the format
    cannot be told."""
    fmt = detect_pref_format(rows, fmt)
    out = []
    for i, row in enumerate(rows):
        if i >= n:
            break
        entry = {"row": i + 1, "prompt": "", "chosen": "", "rejected": "", "problem": None}
        try:
            pair = _normalize_row(row, fmt, i + 1)
        except _RowProblem as exc:
            entry["problem"] = str(exc)
        else:
            entry.update({k: _shorten(_as_text(pair[k]), width) for k in PAIR_KEYS})
        out.append(entry)
    return out
