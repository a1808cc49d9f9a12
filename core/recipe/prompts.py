"""Prompts for GRPO: each row a prompt the model answers, with whatever columns its reward functions read.

Read from the same files as every method's data (core.recipe.data.load_rows, with `data.columns` renames):

  standard        {"prompt": str, ...}: the text exactly as the model continues it
  conversational  {"prompt": [{"role", "content"}, ...], ...}: rendered with the model's chat template

Every other column (an `answer`, a `solution`, test cases) stays in the row: trl.GRPOTrainer passes it to the
reward functions as a keyword argument, one value per completion. A prompt longer than
`training.max_prompt_length` tokens is left out (TRL 1.16 no longer cuts prompts; the planner plans that bound).
"""

from __future__ import annotations

import json
from typing import Any

from core.recipe import reward_code
from core.recipe import rewards as reward_specs
from core.recipe.data import DataError, load_rows, split_eval, user_text
from core.recipe.findings import Finding, format_rows, is_blank, model_limits

DEFAULT_MAX_PROMPT_LENGTH = 512
CHECKED_ROWS = 8  # rows whose own answer every match reward must score at its maximum


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "standard"
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    ):
        return "conversational"
    return "other"


def normalize_prompts(rows, fmt: str = "auto") -> tuple[list[dict], dict[str, list[int]]]:
    """(usable rows, {problem: 1-based rows}): rows whose prompt is missing, empty or neither a text nor a list of
    messages are left out and named."""
    out, _, problems = usable_prompts(rows, fmt)
    return out, problems


def usable_prompts(rows, fmt: str = "auto") -> tuple[list[dict], list[int], dict[str, list[int]]]:
    """normalize_prompts with the data's row number (from 1) of each usable row, for findings that name rows."""
    problems: dict[str, list[int]] = {}
    out, numbers, kinds = [], [], set()
    for i, row in enumerate(rows):
        n = i + 1
        if not isinstance(row, dict) or "prompt" not in row:
            problems.setdefault("missing_prompt", []).append(n)
            continue
        kind = _kind(row["prompt"])
        if kind == "other":
            problems.setdefault(
                "empty_prompt" if row["prompt"] in (None, [], "") else "wrong_types", []
            ).append(n)
            continue
        if is_blank(user_text(row["prompt"])) and (
            kind == "standard" or all(is_blank(m.get("content")) for m in row["prompt"])
        ):
            problems.setdefault("empty_prompt", []).append(n)
            continue
        kinds.add(kind)
        out.append(dict(row))
        numbers.append(n)
    if len(kinds) > 1:
        raise DataError(
            "data: some prompts are texts and some are message lists: use one format (standard or conversational)."
        )
    if fmt in ("standard", "conversational") and kinds and kinds != {fmt}:
        raise DataError(
            f"data.format is {fmt} but the prompts are {kinds.pop()}: set data.format auto or fix it."
        )
    return out, numbers, problems


_WHAT = {
    "missing_prompt": (
        "have no prompt column",
        "Name the prompt column: data.columns {prompt: your_column}.",
    ),
    "empty_prompt": ("have an empty prompt", "Fill in or drop those rows."),
    "wrong_types": (
        "have a prompt that is neither a text nor a list of {role, content} messages",
        "Give each prompt as a string or a list of messages.",
    ),
}


def prompt_ids(prompt, tokenizer) -> list[int]:
    """The prompt's tokens as trl.GRPOTrainer makes them (the chat template with the generation prompt)."""
    if isinstance(prompt, list):
        return list(
            tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    return list(tokenizer(text=prompt)["input_ids"])


def max_prompt_length(cfg: dict) -> int:
    return cfg["training"].get("max_prompt_length", DEFAULT_MAX_PROMPT_LENGTH)


def prepare_prompt_datasets(cfg: dict, tokenizer):
    """(train, eval or None) of a `method: grpo` run config: its prompts normalized, those longer than
    training.max_prompt_length tokens left out (said on stdout), data.eval_split held out with training.seed."""
    import datasets

    data = cfg["data"]
    rows, problems = normalize_prompts(load_rows(data), data["format"])
    if problems:
        first, bad = next(iter(problems.items()))
        raise DataError(f"data: {len(bad)} row(s) {_WHAT[first][0]}: rows {format_rows(bad)}.")
    limit = max_prompt_length(cfg)
    kept = [r for r in rows if len(prompt_ids(r["prompt"], tokenizer)) <= limit]
    if len(kept) < len(rows):
        print(f"data: {len(rows) - len(kept)} prompt(s) longer than {limit} tokens left out", flush=True)
    if not kept:
        raise DataError(
            f"data: every prompt of {data['path']} is longer than training.max_prompt_length {limit}: raise it."
        )
    return split_eval(datasets.Dataset.from_list(kept), cfg)


def row_finder(rows: list[dict]):
    """where_of(prompt) -> "row N of the data" for the reward functions' failures (rows counted from 1)."""
    index: dict[str, int] = {}
    for i, row in enumerate(rows):
        index.setdefault(_key(row.get("prompt")), i + 1)

    def where_of(prompt) -> str | None:
        n = index.get(_key(prompt))
        return f"row {n} of the data" if n else None

    return where_of


def _key(prompt) -> str:
    return json.dumps(prompt, sort_keys=True, default=str)


# ---- preflight ---------------------------------------------------------------------------------------------------


def run_prompt_preflight(
    cfg: dict, tokenizer=None, model_config=None, in_trainer: bool = False
) -> list[Finding]:
    """The data and the reward functions of a GRPO run, checked before launch: prompts, answer columns, lengths,
    and every match reward scored on the first rows with the row's own answer as the completion (it must score
    its maximum: a mis-mapped column or extraction is caught here, not after an hour of zero rewards). The user's
    own reward code is called in the trainer process only (in_trainer); outside it, its file is checked for the
    function (reward_code.code_problem), so a wrong name stops the launch, not the first step."""
    data, specs = cfg["data"], cfg.get("rewards") or []
    code = {} if in_trainer else _code_findings(specs)  # the trainer's score_check imports the file itself
    try:
        raw = load_rows(data)
        rows, numbers, problems = usable_prompts(raw, data["format"])
    except DataError as exc:
        return [Finding("error", "data", str(exc), ""), *code.values()]
    found = [*code.values()] + [
        Finding(
            "error",
            "prompts",
            f"{len(bad)} row(s) {_WHAT[what][0]}: rows {format_rows(bad)}.",
            _WHAT[what][1],
            bad,
        )
        for what, bad in problems.items()
    ]
    if not rows:
        return found or [Finding("error", "data", f"data.path: {data['path']} has no prompts.", "")]
    columns = list(raw.column_names)
    found += _answer_findings(specs, rows, numbers, columns)
    if tokenizer is not None:
        found += _length_findings(cfg, rows, numbers, tokenizer, model_config)
    if not any(f.level == "error" and f.check in ("answers", "reward_column") for f in found):
        found += score_check(specs, rows, numbers, allow_code=in_trainer)
    return found


def _code_findings(specs: list) -> dict[int, Finding]:
    """{index: finding} for each python reward whose file does not give its function (nothing is called)."""
    out = {}
    for i, spec in enumerate(specs):
        if spec.get("type") == "python":
            problem = reward_code.code_problem(spec, i)
            if problem is not None:
                out[i] = Finding(problem[0], "reward", problem[1], "")  # the sentence says how to fix it
    return out


def _answer_findings(specs: list, rows: list[dict], numbers: list[int], columns: list[str]) -> list[Finding]:
    out = []
    for i, spec in enumerate(specs):
        if spec.get("type") != "match":
            continue
        column = spec.get("column", reward_specs.DEFAULT_COLUMN)
        if column not in columns:
            out.append(
                Finding(
                    "error",
                    "reward_column",
                    f"rewards[{i}] compares against the column {column!r}, which the data does not have (its columns: "
                    f"{', '.join(columns)}).",
                    f"Set rewards[{i}].column to the column that holds the answers.",
                )
            )
            continue
        empty = [
            n
            for n, r in zip(numbers, rows, strict=True)
            if is_blank(reward_specs.completion_text(r.get(column)))
        ]
        if empty:
            out.append(
                Finding(
                    "error",
                    "answers",
                    f"{len(empty)} row(s) have no {column!r} for rewards[{i}] to compare with: rows {format_rows(empty)}.",
                    "Fill in or drop those rows: a row without an answer can only ever score 0.",
                    empty,
                )
            )
    return out


def _length_findings(
    cfg: dict, rows: list[dict], numbers: list[int], tokenizer, model_config
) -> list[Finding]:
    if isinstance(rows[0]["prompt"], list) and not getattr(tokenizer, "chat_template", None):
        return [
            Finding(
                "error",
                "chat_template",
                "The prompts are message lists but the model's tokenizer has no chat template.",
                "Use a model folder with a chat template, or give the prompts as plain texts.",
            )
        ]
    limit, completion = max_prompt_length(cfg), cfg["training"].get("max_completion_length", 512)
    lengths = [len(prompt_ids(r["prompt"], tokenizer)) for r in rows]
    out = []
    long = [n for n, length in zip(numbers, lengths, strict=True) if length > limit]
    if long:
        level = "error" if len(long) == len(rows) else "warning"
        out.append(
            Finding(
                level,
                "prompt_length",
                f"{len(long)} of {len(rows)} prompt(s) are longer than training.max_prompt_length {limit} tokens and "
                f"are left out: rows {format_rows(long)}.",
                f"Raise training.max_prompt_length (the longest prompt has {max(lengths)} tokens) or shorten them.",
                long,
            )
        )
    _, max_pos = model_limits(model_config)
    if max_pos and min(limit, max(lengths)) + completion > max_pos:
        out.append(
            Finding(
                "error",
                "position_limit",
                f"A prompt of {min(limit, max(lengths))} tokens plus training.max_completion_length {completion} is "
                f"longer than the model's max_position_embeddings {max_pos}.",
                "Lower training.max_completion_length or training.max_prompt_length.",
            )
        )
    return out


def score_check(specs: list, rows: list[dict], numbers: list[int], allow_code: bool = False) -> list[Finding]:
    """Each match reward on the first rows, with the row's own answer as the completion: it must score 1 (its
    maximum). With allow_code, the user's functions are called on the same completions: one that raises or
    returns something other than numbers is named before training starts."""
    out = []
    sample = rows[:CHECKED_ROWS]
    for i, spec in enumerate(specs):
        if spec.get("type") == "python" and not allow_code:
            continue
        column = spec.get("column", reward_specs.DEFAULT_COLUMN)
        answers = [r.get(column) for r in sample]
        completions = [
            _as_completion(r["prompt"], reward_specs.ideal_completion(a, spec))
            for r, a in zip(sample, answers, strict=True)
        ]
        kwargs = {k: [r.get(k) for r in sample] for k in rows[0] if k != "prompt"}
        name = reward_specs.name_of(spec, i, specs)
        try:
            fn = reward_specs.build_one(specs, i, allow_code=allow_code, where_of=row_finder(sample))
            scores = fn(
                prompts=[r["prompt"] for r in sample], completions=completions, completion_ids=None, **kwargs
            )
        except reward_code.RewardCodeError as exc:  # the file lacks the function: its sentence says the fix
            out.append(Finding("error", "reward", str(exc), ""))
            continue
        except reward_specs.RewardError as exc:
            fix = f"Correct {reward_code.label(i)} so that it scores these rows."
            out.append(Finding("error", "reward", str(exc), fix))
            continue
        if spec.get("type") != "match":
            continue
        low = [i for i, s in enumerate(scores) if (s or 0) < 1.0]
        if low:
            shown = reward_specs.completion_text(answers[low[0]])
            low = [numbers[i] for i in low]
            out.append(
                Finding(
                    "error",
                    "reward",
                    f"rewards[{i}] ({name}) scores less than 1 on row(s) {format_rows(low)} even when the completion is "
                    f"the row's own {column!r} ({shown[:60]!r}): it would reward nothing.",
                    f"Check rewards[{i}].column, extract and numeric against what the column holds.",
                    low,
                )
            )
    return out


def _as_completion(prompt, text: str):
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def preview_prompts(
    rows, n: int = 5, fmt: str = "auto", specs: list | None = None, width: int = 300
) -> list[dict]:
    """The first n prompts as the page shows them: the prompt (its user turn) and the columns the rewards read."""
    usable, _ = normalize_prompts(
        rows.select(range(min(len(rows), n))) if hasattr(rows, "select") else rows[:n], fmt
    )
    shown = reward_specs.answer_columns(specs or []) or [
        c for c in ("answer", "solution") if usable and c in usable[0]
    ]
    out = []
    for row in usable:
        item = {
            "prompt": _shorten(
                user_text(row["prompt"]) if isinstance(row["prompt"], list) else row["prompt"], width
            )
        }
        for column in shown:
            item[column] = _shorten(reward_specs.completion_text(row.get(column)), width)
        out.append(item)
    return out


def _shorten(text: str, width: int) -> str:
    text = str(text or "")
    return text if len(text) <= width else text[: width - 1] + "…"
