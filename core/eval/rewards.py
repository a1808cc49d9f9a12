"""The held-out figures of a run that learns from reward functions (eval_kind "rewards": GRPO): greedy answers of
the base and of the tuned model to held-out prompts, scored by the run's own reward functions (core.recipe.rewards,
weighted by training.reward_weights) and, next to them, by exact match against the prompts' answer column.

The reward functions are those the run trained with, built as its trainer builds them: a `python` reward runs the
user's file here too (this is an evaluation process, never the app's, and the run config ticked trust_code). A
completion is what TRL hands a reward: the text, or an assistant message for conversational prompts; its token ids
are the answer's, for the length preset. core.demo's GRPO demo scores its held-out prompts with `heldout_scores`.
"""

from __future__ import annotations

from core import generate
from core.eval import scores
from core.recipe import rewards as reward_specs
from core.recipe.data import user_text
from core.recipe.prompts import prompt_ids

NOT_COLUMNS = (
    "prompt",
    "row",
)  # a held-out row's own keys; every other column goes to the rewards as TRL passes it


def answer_prompts(
    model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 32, on_batch=None
):
    """The greedy answer to each row's prompt (rendered as GRPOTrainer renders it)."""
    ids = [prompt_ids(r["prompt"], tokenizer) for r in rows]
    return generate.greedy(model, tokenizer, ids, max_new_tokens, batch_size, on_batch=on_batch)


def answer_column(specs: list, rows: list[dict]) -> str | None:
    """The column exact match compares with: the first match reward's, else `answer` when the rows have one."""
    columns = reward_specs.answer_columns(specs)
    if columns:
        return columns[0]
    return reward_specs.DEFAULT_COLUMN if rows and reward_specs.DEFAULT_COLUMN in rows[0] else None


def score_answers(
    rows: list[dict], answers: list[str], specs: list, weights: list | None, tokenizer=None, allow_code=False
) -> list[dict]:
    """Per row: each reward function's score {name: float or None}, "reward" (their weighted mean, on the presets'
    0-1 scale) and "exact_match" (None without an answer column)."""
    names = reward_specs.names(specs)
    weights = list(weights) if weights else [1.0] * len(specs)
    completions = [
        [{"role": "assistant", "content": a}] if isinstance(r["prompt"], list) else a
        for r, a in zip(rows, answers, strict=True)
    ]
    ids = (
        [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
        if tokenizer is not None
        else None
    )
    columns = {k: [r.get(k) for r in rows] for k in rows[0] if k not in NOT_COLUMNS} if rows else {}
    functions = reward_specs.build(specs, allow_code=allow_code)
    given = [
        fn(prompts=[r["prompt"] for r in rows], completions=completions, completion_ids=ids, **columns)
        for fn in functions
    ]
    reference = answer_column(specs, rows)
    out = []
    for i, row in enumerate(rows):
        got = {name: (None if s[i] is None else float(s[i])) for name, s in zip(names, given, strict=True)}
        scored = [(w, got[n]) for w, n in zip(weights, names, strict=True) if got[n] is not None]
        total = sum(w for w, _ in scored)
        got["reward"] = sum(w * v for w, v in scored) / total if scored and total else None
        answer = row.get(reference) if reference else None
        got["exact_match"] = (
            None if answer is None else scores.exact_match(answers[i], reward_specs.completion_text(answer))
        )
        out.append(got)
    return out


def evaluate_rewards(rows, cfg, model, tuned, tokenizer, max_new_tokens, batch_size, report):
    """(per-row table, summary, `eval:` lines) of a reward run on its held-out prompts, base against tuned."""
    specs, weights = cfg["rewards"], cfg["training"].get("reward_weights")
    names = reward_specs.names(specs)
    reference = answer_column(specs, rows)
    prompts = [r["prompt"] for r in rows]
    out = [
        {
            "row": r["row"],
            "prompt": user_text(p) if isinstance(p, list) else p,
            "reference": reward_specs.completion_text(r.get(reference)) if reference else None,
        }
        for r, p in zip(rows, prompts, strict=True)
    ]
    for side, m, ctx in generate.sides(model, tuned):
        with ctx:
            said = answer_prompts(
                m,
                tokenizer,
                rows,
                max_new_tokens,
                batch_size,
                on_batch=lambda k, s=side: report(phase=f"{s} answers", done=k, total=len(rows)),
            )
        for row, text, got in zip(
            out, said, score_answers(rows, said, specs, weights, tokenizer, True), strict=True
        ):
            row[f"{side}_answer"] = text
            row.update({f"{side}_{key}": value for key, value in got.items()})
    for row in out:
        b, a = row["base_reward"], row["tuned_reward"]
        row["change"] = None if a is None or b is None else a - b
    summary = {
        "reward": _figure(out, "reward", "mean reward", "num"),
        "exact_match": _figure(out, "exact_match", "exact match", "pct"),
        **{f"reward_{n}": _figure(out, n, f"reward {n}", "num") for n in names},
        "weights": dict(zip(names, weights or [1.0] * len(names), strict=True)),
    }
    return out, summary, _lines(summary, names)


def _figure(rows: list[dict], key: str, label: str, kind: str) -> dict:
    return {
        "base": scores.mean(r[f"base_{key}"] for r in rows),
        "tuned": scores.mean(r[f"tuned_{key}"] for r in rows),
        "label": label,
        "kind": kind,
    }


def _lines(summary: dict, names: list[str]) -> list[str]:
    f = scores.fmt_value
    lines = []
    for key in ("reward", "exact_match", *(f"reward_{n}" for n in names)):
        fig = summary[key]
        if key == "exact_match" and fig["base"] is None:
            continue  # no answer column to compare with
        lines.append(f"eval: {fig['label']} {f(fig['base'], fig['kind'])} -> {f(fig['tuned'], fig['kind'])}")
    if len(names) > 1:
        weights = ", ".join(f"{n} {w:g}" for n, w in summary["weights"].items())
        lines[0] += f" (weighted mean: {weights})"
    return lines


def heldout_scores(
    model, tokenizer, rows: list[dict], specs: list, max_new_tokens: int = 8
) -> tuple[float, float]:
    """(mean reward, exact match) of `model`'s greedy answers to held-out prompts (the GRPO demo's before/after)."""
    scored = score_answers(
        rows, answer_prompts(model, tokenizer, rows, max_new_tokens), specs, None, tokenizer
    )
    return scores.mean(s["reward"] for s in scored) or 0.0, scores.mean(
        s["exact_match"] for s in scored
    ) or 0.0
