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
`pair_token_ids` tokenizes a pair the way DPOTrainer does, so the length checks count the tokens training will
see. The checks of the pairs before a run (check_pairs, the DPO preflight) are core.recipe.prefcheck's.
"""

from __future__ import annotations

import reprlib
from typing import Any

from core.recipe.data import DataError, load_rows, split_eval

PREF_FORMATS = ("standard", "conversational")
PAIR_KEYS = ("prompt", "chosen", "rejected")
_DETECT_ROWS = 1000  # rows looked at to tell the format (the first with a usable 'chosen' decides)

_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40
_short.maxlevel = 2
_short.maxlist = _short.maxdict = _short.maxtuple = 3


class RowProblem(ValueError):
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
        raise RowProblem(
            "missing_keys",
            f"Row {n} has no '{key}': give every row a '{key}' text (or map your column to it with data.columns).",
        )
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # a CSV column of numbers
    if not isinstance(value, str):
        raise RowProblem("wrong_types", f"Row {n}: '{key}' is {_kind(value)}, not text: make it a string.")
    return value


def _messages(row: dict, key: str, n: int) -> list[dict]:
    value = row.get(key)
    if value is None:
        raise RowProblem(
            "missing_keys",
            f"Row {n} has no '{key}': give every row a '{key}' list of {{role, content}} messages (or map your "
            "column to it with data.columns).",
        )
    if not isinstance(value, (list, tuple)):
        raise RowProblem(
            "wrong_types",
            f"Row {n}: '{key}' is {_kind(value)}, not a list of {{role, content}} messages like the other rows: "
            "make it one.",
        )
    out = []
    for j, m in enumerate(value, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"].strip()):
            raise RowProblem(
                "wrong_types",
                f"Row {n}: message {j} of '{key}' is {_kind(m)}, not a {{role, content}} message with a role: "
                "give each message a 'role' (user, assistant, ...) and a text 'content'.",
            )
        content = m.get("content")
        if not isinstance(content, str):
            raise RowProblem(
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


def normalize_row(row: Any, fmt: str, n: int) -> dict:
    if not isinstance(row, dict):
        raise RowProblem(
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
            raise RowProblem(
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
        raise RowProblem(
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
            pair = normalize_row(row, fmt, i + 1)
        except RowProblem as exc:
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
            pair = normalize_row(row, fmt, i + 1)
        except RowProblem as exc:
            entry["problem"] = str(exc)
        else:
            entry.update({k: _shorten(_as_text(pair[k]), width) for k in PAIR_KEYS})
        out.append(entry)
    return out
