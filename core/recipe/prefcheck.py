"""The checks of preference pairs before a DPO run (its preflight): every row normalized and tokenized as
DPOTrainer does (core.recipe.prefdata), and what would fail or silently spoil training reported as Findings with
1-based row numbers -- rows that are no pair, empty or identical answers, prompts or pairs cut by max_length,
token ids beyond the vocabulary or positions beyond the model's. `check_rows_with_tokenizer` is the shared frame
of the preflights that check rows against the tokenizer and model config (DPO here, KTO in core.recipe.feedback).
"""

from __future__ import annotations

from core.fmt import error_line
from core.recipe.data import DataError
from core.recipe.findings import (
    Finding,
    format_rows,
    is_blank,
    load_tokenizer_and_config,
    max_length_findings,
    model_limits,
    token_findings,
)
from core.recipe.prefdata import RowProblem, detect_pref_format, load_pref_rows, normalize_row, pair_token_ids


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
            pair = normalize_row(row, fmt, n)
        except RowProblem as exc:
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
