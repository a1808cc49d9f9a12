"""The held-out rows of an answer evaluation: prompt and reference, tokenized the way the run trained.

Two sources: the run's own eval split (data.eval_split of its data, the very rows the trainer held out: same
tokenization, same filter, same seed) or a data file in any format the Train page reads (alpaca, chat; a
`question`/`answer` file reads as alpaca). Each row is rendered in the run's own format (a chat run's prompts
through the chat template, an alpaca run's through the Alpaca template), whatever the file's format: the adapter
is asked the way it was taught. The reference is the last answer of the row; the answer tokens are those the
trainer would have trained on (the reference with its end of turn), which the answer loss scores.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from core.recipe.data import (
    IGNORE_INDEX,
    DataError,
    detect_format,
    last_answer_span,
    load_rows,
    missing_columns,
    tokenize_dataset,
    tokenize_row,
)

ALIASES = {"question": "instruction", "answer": "output"}  # core.demo's heldout.jsonl, many QA sets


class EvalError(ValueError):
    """Bad input for an evaluation; the message is one sentence that says what and how to fix it."""


@dataclass(frozen=True)
class DataInput:
    """How a message names the data file to evaluate on, so that it names what its reader can set: the CLI's
    flag, or the Evaluate page's own field (its job passes PAGE_DATA)."""

    name: str  # a data error about the file starts with it (in place of the run config's data.path)
    give: str  # where to give one


CLI_DATA = DataInput("--data", "--data FILE")
PAGE_DATA = DataInput("Data file", "Held-out rows: A data file")


@dataclass
class EvalRow:
    row: int  # 1-based row number in its source
    prompt: str  # what was asked, as a person would read it
    reference: str
    prompt_ids: list[int]
    answer_ids: list[int]


def _question_answer(row: dict, fmt: str) -> tuple[list[dict], str] | None:
    """(the conversation before the last answer, that answer) of a raw row; None when it has no answer."""
    if fmt == "chat":
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            return None
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
        if last is None or not isinstance(msgs[last].get("content"), str):
            return None
        return [dict(m) for m in msgs[:last]], msgs[last]["content"]
    if fmt == "alpaca":
        question = str(row.get("instruction") or "")
        if row.get("input"):
            question += f"\n\n{row['input']}"
        answer = row.get("output")
        if answer is None or not question.strip():
            return None
        return [{"role": "user", "content": question}], str(answer)
    return None


def _user(context: list[dict]) -> str:
    return next((str(m.get("content")) for m in reversed(context) if m.get("role") == "user"), "")


def encode(context: list[dict], answer: str, run_fmt: str, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one question/answer in the run's format, split where the trainer's label mask
    starts its last answer (core.recipe.data.tokenize_row)."""
    if run_fmt == "chat":
        row = {"messages": [*context, {"role": "assistant", "content": answer}]}
    elif run_fmt == "alpaca":
        row = {"instruction": _user(context), "output": answer}
    else:  # plain text: the question as text, the answer as its continuation
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        prompt = bos + tokenizer(_user(context), add_special_tokens=False)["input_ids"]
        eos = tokenizer.eos_token or ""
        return prompt, tokenizer(" " + answer + eos, add_special_tokens=False)["input_ids"]
    enc = tokenize_row(row, run_fmt, tokenizer, 10**9, mask_prompt=True)
    span = last_answer_span(enc["labels"])
    if span is None:
        raise DataError("the row has no answer tokens")
    return enc["input_ids"][: span[0]], enc["input_ids"][span[0] : span[1]]


def _rows_from(ds, indices, src_fmt: str, run_fmt: str, tokenizer) -> list[EvalRow]:
    out = []
    for i in indices:
        qa = _question_answer(ds[int(i)], src_fmt)
        if qa is None or not qa[1].strip():
            continue
        context, answer = qa
        try:
            prompt_ids, answer_ids = encode(context, answer, run_fmt, tokenizer)
        except (ValueError, DataError):
            continue  # a conversation the template cannot render: preflight names it in training
        out.append(EvalRow(int(i) + 1, _user(context), answer, prompt_ids, answer_ids))
    return out


def run_format(cfg: dict, tokenizer) -> str:
    """The format the run trained in (its data.format, or what its data's columns say)."""
    fmt = cfg["data"].get("format", "auto")
    if fmt == "auto":
        try:
            fmt = detect_format(load_rows(cfg["data"]).column_names)
        except DataError:
            fmt = "chat" if getattr(tokenizer, "chat_template", None) else "alpaca"
    return fmt


def split_rows(cfg: dict, tokenizer, asked: DataInput = CLI_DATA) -> list[EvalRow]:
    """The run's eval split: the rows core.recipe.data.split_eval held out, in the run's format."""
    import datasets

    data = cfg["data"]
    share = data.get("eval_split") or 0
    if share <= 0:
        raise EvalError(
            f"The run holds out no rows (data.eval_split is 0): give a data file to evaluate on ({asked.give})."
        )
    try:
        ds = load_rows(data)
        fmt = detect_format(ds.column_names, data.get("format", "auto"))
    except DataError as exc:
        raise EvalError(f"The run's data cannot be read again: {exc}") from None
    if fmt == "text":
        raise EvalError(
            "The run trained on plain text, which has no prompts and answers: evaluate on a file of "
            f"questions and answers ({asked.give}, alpaca or chat)."
        )
    tok = tokenize_dataset(ds, fmt, tokenizer, cfg["training"]["max_length"], data.get("mask_prompt", True))
    keep = [i for i, labels in enumerate(tok["labels"]) if any(x != IGNORE_INDEX for x in labels)]
    if len(keep) < 4:
        raise EvalError(
            f"The run's data has fewer than 4 usable rows, so it held none out: evaluate on a data file ({asked.give})."
        )
    # the same permutation split_eval drew: it depends only on the row count and the seed
    idx = datasets.Dataset.from_dict({"i": keep}).train_test_split(
        test_size=share, seed=cfg["training"]["seed"]
    )
    return _rows_from(ds, idx["test"]["i"], fmt, fmt, tokenizer)


def file_rows(
    path: str,
    run_fmt: str,
    tokenizer,
    columns: dict | None = None,
    split: str = "train",
    asked: DataInput = CLI_DATA,
) -> list[EvalRow]:
    """The rows of a data file (any format the Train page reads), rendered in the run's format."""
    try:
        ds = load_rows({"path": path, "columns": columns or {}, "split": split})
    except DataError as exc:
        raise EvalError(str(exc).replace("data.path", asked.name, 1)) from None
    renames = {a: b for a, b in ALIASES.items() if a in ds.column_names and b not in ds.column_names}
    for a, b in renames.items():
        ds = ds.rename_column(a, b)
    try:
        fmt = detect_format(ds.column_names)
    except DataError as exc:
        raise EvalError(str(exc)) from None
    if fmt == "text" or missing_columns(ds.column_names, fmt):
        raise EvalError(
            f"{path} holds plain text: evaluation needs questions with reference answers (alpaca "
            "instruction/output, chat messages, or question/answer columns)."
        )
    return _rows_from(ds, range(len(ds)), fmt, run_fmt, tokenizer)


def heldout_config(cfg: dict, data: str | None = None, asked: DataInput = CLI_DATA) -> dict:
    """The run's config reading the rows to evaluate: its own held-out split, or every row of `data` (EvalError
    when the run held none out and no file is given)."""
    c = copy.deepcopy(cfg)
    if data:
        c["data"].update(path=data, eval_split=0.0, format="auto", columns={})
        c["data"].pop("sources", None)  # the file given is the one source read
        c["data"].pop("mix", None)
    elif c["data"].get("sources"):  # issue #50 item 3: the mix's held-out rows, drawn again, are not read yet
        raise EvalError(
            f"The run mixes several data.sources, whose held-out rows are not evaluated yet: give a data file to "
            f"evaluate on ({asked.give})."
        )
    elif not c["data"].get("eval_split"):
        raise EvalError(
            f"The run holds out no rows (data.eval_split is 0): give a data file to evaluate on ({asked.give})."
        )
    return c


def method_rows(
    cfg: dict, method, tokenizer, data: str | None = None, asked: DataInput = CLI_DATA
) -> list[dict]:
    """The held-out rows of a method with its own data (preference pairs, rated answers, prompts): its own eval
    split, or every row of a data file, as its trainer takes them."""
    c = heldout_config(cfg, data, asked)
    try:
        train, held = method.datasets(c, tokenizer)
    except DataError as exc:
        raise EvalError(str(exc).replace("data.path", asked.name if data else "data.path", 1)) from None
    ds = train if data else held
    if ds is None:
        raise EvalError(
            f"The run's data has too few rows to hold any out: evaluate on a data file ({asked.give})."
        )
    return [{**r, "row": i + 1} for i, r in enumerate(ds)]
