"""Unpaired feedback for KTO: one answer to a prompt with a thumbs up or down (`label` true / false).

The data people actually have: rated answers, not pairs. Read from the same files as SFT data
(core.recipe.data.load_rows, with `data.columns` renames), in two formats:

  standard        {"prompt": str, "completion": str, "label": bool}: texts exactly as the model sees them
                  (KTOTrainer appends EOS to each completion).
  conversational  "prompt" and "completion" as lists of {"role", "content"} messages (chat template).

Preference pairs (prompt / chosen / rejected, core.recipe.prefdata) are read too: each pair becomes a desirable and
an undesirable row, as trl.unpair_preference_dataset does. A label is a boolean, 0/1, or "true"/"false".
"""

from __future__ import annotations

from typing import Any

from core.recipe.data import DataError, load_rows, split_eval
from core.recipe.findings import (
    Finding,
    format_rows,
    is_blank,
    max_length_findings,
    model_limits,
    token_findings,
)
from core.recipe.prefcheck import check_rows_with_tokenizer
from core.recipe.prefdata import normalize_pairs, pair_token_ids

FEEDBACK_KEYS = ("prompt", "completion", "label")
_LABELS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def is_pairs(rows) -> bool:
    return len(rows) > 0 and {"chosen", "rejected"} <= set(
        rows.column_names if hasattr(rows, "column_names") else rows[0]
    )


def label_of(value: Any) -> bool | None:
    """True / False for a usable label, None otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return _LABELS.get(value.strip().lower())
    return None


def _kind_of(value: Any) -> str:
    if isinstance(value, str):
        return "standard"
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return "conversational"
    return "other"


def normalize_feedback(rows, fmt: str = "auto") -> tuple[list[dict], dict[str, list[int]]]:
    """({prompt, completion, label} rows as trl.KTOTrainer 1.16 takes them, {problem: 1-based rows}). Pairs are
    unpaired (chosen: true, rejected: false); rows that cannot be used are left out and named in the problems."""
    if is_pairs(rows):
        out = []
        for pair in normalize_pairs(rows, "auto" if fmt not in ("standard", "conversational") else fmt):
            out.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
            out.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
        return out, {}
    problems: dict[str, list[int]] = {}
    out = []
    kinds = set()
    for i, row in enumerate(rows):
        n = i + 1
        if not isinstance(row, dict) or any(key not in row for key in FEEDBACK_KEYS):
            problems.setdefault("missing_keys", []).append(n)
            continue
        label = label_of(row["label"])
        if label is None:
            problems.setdefault("bad_label", []).append(n)
            continue
        prompt, completion = row["prompt"], row["completion"]
        kind = _kind_of(completion)
        prompt_kind = kind if prompt in (None, "", []) else _kind_of(prompt)
        if kind == "other" or prompt_kind != kind:
            problems.setdefault("wrong_types", []).append(n)
            continue
        blank = not completion if kind == "conversational" else is_blank(completion)
        if blank or (kind == "conversational" and all(is_blank(m.get("content")) for m in completion)):
            problems.setdefault("empty_completion", []).append(n)
            continue
        kinds.add(kind)
        out.append({"prompt": prompt, "completion": completion, "label": label})
    if len(kinds) > 1:
        raise DataError(
            "data: some rows are texts and some are message lists: use one format (standard or conversational)."
        )
    if fmt in ("standard", "conversational") and kinds and kinds != {fmt}:
        raise DataError(
            f"data.format is {fmt} but the rows are {kinds.pop()}: set data.format auto or fix it."
        )
    return out, problems


def prepare_feedback_datasets(cfg: dict):
    """(train, eval or None) datasets of a `method: kto` run config: its rows read and normalized, the
    data.eval_split share held out with training.seed."""
    import datasets

    data = cfg["data"]
    rows, problems = normalize_feedback(load_rows(data), data["format"])
    if problems:
        first, bad = next(iter(problems.items()))
        raise DataError(
            f"data: {len(bad)} row(s) are not usable feedback ({first}): rows {format_rows(bad)}."
        )
    if not rows:
        raise DataError(f"data: {data['path']} has no feedback rows.")
    return split_eval(datasets.Dataset.from_list(rows), cfg)


_WHAT = {
    "missing_keys": (
        "lack prompt, completion or label",
        "Give every row prompt, completion and label, or map your columns with data.columns.",
    ),
    "bad_label": (
        "have a label that is not true/false (or 1/0)",
        "Write label as true (a good answer) or false (a bad one).",
    ),
    "wrong_types": (
        "mix texts and message lists, or hold something else",
        "Make prompt and completion both texts, or both lists of {role, content} messages.",
    ),
    "empty_completion": ("have an empty completion", "Fill or remove those rows."),
}


def check_feedback(rows, tokenizer, max_length: int, model_config=None, fmt: str = "auto") -> list[Finding]:
    """Findings for KTO rows, with 1-based row numbers: unusable rows, one-sided labels, and the token checks
    (vocabulary, positions, truncation at max_length) on prompt + completion as KTOTrainer tokenizes them."""
    try:
        normalized, problems = normalize_feedback(rows, fmt)
    except DataError as exc:
        return [Finding("error", "format", str(exc), "Fix the rows named, or set data.format.")]
    findings = [
        Finding(
            "error",
            check,
            f"{len(bad)} row(s) {_WHAT[check][0]}: rows {format_rows(bad)}.",
            _WHAT[check][1],
            bad,
        )
        for check, bad in problems.items()
    ]
    if not normalized:
        if not findings:
            findings.append(
                Finding("error", "data", "The data has no rows.", "Give at least two rated answers.")
            )
        return findings
    labels = {r["label"] for r in normalized}
    if len(labels) < 2:
        side = "desirable (true)" if True in labels else "undesirable (false)"
        findings.append(
            Finding(
                "warning",
                "one_sided",
                f"Every row is {side}: KTO learns most from both kinds of answer.",
                "Add rated answers of the other kind, or use SFT for good answers only.",
            )
        )
    vocab, max_pos = model_limits(model_config)
    findings += max_length_findings(max_length, max_pos)
    over_vocab, over_pos, truncated, long_prompt = [], [], [], []
    for i, row in enumerate(normalized):
        n = i + 1
        pair = {
            "prompt": row["prompt"] or ("" if isinstance(row["completion"], str) else []),
            "chosen": row["completion"],
        }
        pair["rejected"] = pair["chosen"]
        try:
            p, c, _ = pair_token_ids(pair, tokenizer)
        except DataError as exc:
            return [*findings, Finding("error", "tokenizer", str(exc), "Use a tokenizer with an eos_token.")]
        if vocab and any(t >= vocab or t < 0 for t in (*p, *c)):
            over_vocab.append(n)
        if max_pos and len(p) + len(c) > max_pos:
            over_pos.append(n)
        if len(p) >= max_length:
            long_prompt.append(n)
        elif len(p) + len(c) > max_length:
            truncated.append(n)
    findings += token_findings(over_vocab, vocab, len(tokenizer), over_pos, max_pos, max_length)
    if long_prompt:
        findings.append(
            Finding(
                "error",
                "prompt_too_long",
                f"{len(long_prompt)} row(s) have a prompt of training.max_length {max_length} tokens or more, "
                f"leaving no room for the completion: rows {format_rows(long_prompt)}.",
                "Raise training.max_length or shorten those prompts.",
                rows=long_prompt,
            )
        )
    if truncated:
        findings.append(
            Finding(
                "warning",
                "truncation",
                f"{len(truncated)} of {len(normalized)} rows would be cut at training.max_length {max_length}: rows "
                f"{format_rows(truncated)}.",
                "Raise training.max_length (memory grows with it) or shorten those rows.",
                rows=truncated,
            )
        )
    return findings


def run_feedback_preflight(cfg: dict, tokenizer=None, model_config=None) -> list[Finding]:
    """The preflight of a `method: kto` config: the rows read, then check_feedback."""
    return check_rows_with_tokenizer(cfg, load_rows, check_feedback, tokenizer, model_config)


def preview_feedback(rows, n: int = 5, fmt: str = "auto", width: int = 300) -> tuple[int, list[dict]]:
    """(rows, the first n as prompt / completion / good?) for the Train page."""

    def text(value) -> str:
        if isinstance(value, list):
            value = " | ".join(f"{m.get('role')}: {m.get('content')}" for m in value if isinstance(m, dict))
        value = "" if value is None else str(value)
        return value if len(value) <= width else value[: width - 1] + "…"

    normalized, _ = normalize_feedback(rows, fmt)
    shown = [
        {"prompt": text(r["prompt"]), "completion": text(r["completion"]), "good": r["label"]}
        for r in normalized[:n]
    ]
    return len(normalized), shown
