"""The held-out figures of a preference run (a method whose eval_kind is "pairs" or "rated": DPO, KTO).

Pairs (prompt, chosen, rejected): the preference accuracy by likelihood (log p(chosen) > log p(rejected)) of the
base (the adapter off: the run's reference) and of the tuned model; the implicit reward of each answer,
beta * (log p_tuned - log p_reference), its accuracy (chosen rewarded above rejected) and mean margin; and how
often each model's greedy answer is in the preferred style (closer, by chrF, to the chosen answer than to the
rejected one). Rated answers (prompt, completion, label): the reward's sign against the label, the mean reward of
good minus bad answers, and the greedy answer's style against the prompt's good and bad answers.
"""

from __future__ import annotations

from core import generate
from core.eval import scores
from core.recipe.data import user_text
from core.recipe.prefdata import pair_token_ids

DEFAULT_BETA = 0.1  # TRL's DPOConfig / KTOConfig default


def _text(answer) -> str:
    return "".join(m["content"] for m in answer) if isinstance(answer, list) else str(answer)


def evaluate_prefs(rows, method, cfg, model, tuned, tokenizer, max_new_tokens, batch_size, report):
    """(per-row table, summary, `eval:` lines) of a preference run."""
    rated = method.eval_kind == "rated"
    beta = float(cfg["training"].get("beta") or DEFAULT_BETA)
    prompts, good, bad = [], [], []
    for r in rows:
        if rated:
            p, a, _ = pair_token_ids(
                {"prompt": r["prompt"], "chosen": r["completion"], "rejected": ""}, tokenizer
            )
            prompts.append(p), good.append(a)
        else:
            p, c, j = pair_token_ids(r, tokenizer)
            prompts.append(p), good.append(c), bad.append(j)
    out = [{"row": r["row"], "prompt": user_text(r["prompt"])} for r in rows]
    for row, r in zip(out, rows, strict=True):
        if rated:
            row.update(answer=_text(r["completion"]), label=bool(r["label"]))
        else:
            row.update(chosen=_text(r["chosen"]), rejected=_text(r["rejected"]))
    targets = [good, bad] if bad else [good]
    for side, (said, losses) in generate.both_sides(
        model, tuned, tokenizer, prompts, targets, max_new_tokens, batch_size, report
    ).items():
        lp_good = [-x for x in losses[0]]
        lp_bad = [-x for x in losses[1]] if bad else None
        for i, row in enumerate(out):
            row[f"{side}_answer"] = said[i]
            if rated:
                row[f"{side}_logp"] = lp_good[i]
            else:
                row[f"{side}_logp_chosen"], row[f"{side}_logp_rejected"] = lp_good[i], lp_bad[i]
    return (_rated if rated else _pairs)(out, beta)


def _style(answer: str, good: list[str], bad: list[str]) -> float | None:
    """1 when the answer is closer (chrF) to the best-matching good answer than to any bad one; None without both."""
    if not good or not bad:
        return None
    return float(max(scores.chrf(answer, g) for g in good) > max(scores.chrf(answer, b) for b in bad))


def _pairs(out: list[dict], beta: float):
    for row in out:
        for side in ("base", "tuned"):
            row[f"{side}_prefers_chosen"] = float(row[f"{side}_logp_chosen"] > row[f"{side}_logp_rejected"])
            row[f"{side}_style"] = _style(row[f"{side}_answer"], [row["chosen"]], [row["rejected"]])
        rc = beta * (row["tuned_logp_chosen"] - row["base_logp_chosen"])
        rr = beta * (row["tuned_logp_rejected"] - row["base_logp_rejected"])
        row.update(reward_chosen=rc, reward_rejected=rr, reward_margin=rc - rr, change=rc - rr)
    mean = scores.mean
    summary = {
        "preference_accuracy": {s: mean(r[f"{s}_prefers_chosen"] for r in out) for s in ("base", "tuned")},
        "preferred_style": {s: mean(r[f"{s}_style"] for r in out) for s in ("base", "tuned")},
        "reward_accuracy": mean(float(r["reward_margin"] > 0) for r in out),
        "reward_margin": mean(r["reward_margin"] for r in out),
        "beta": beta,
    }
    return out, summary, _lines(summary, "preference accuracy")


def _rated(out: list[dict], beta: float):
    by_prompt: dict[str, dict[bool, list[str]]] = {}
    for row in out:
        by_prompt.setdefault(row["prompt"], {True: [], False: []})[row["label"]].append(row["answer"])
        row["reward"] = beta * (row["tuned_logp"] - row["base_logp"])
        row["change"] = row["reward"] if row["label"] else -row["reward"]
    for row in out:
        group = by_prompt[row["prompt"]]
        for side in ("base", "tuned"):
            row[f"{side}_style"] = _style(row[f"{side}_answer"], group[True], group[False])
    mean = scores.mean
    good = [r["reward"] for r in out if r["label"]]
    bad = [r["reward"] for r in out if not r["label"]]
    summary = {
        "preferred_style": {s: mean(r[f"{s}_style"] for r in out) for s in ("base", "tuned")},
        "reward_accuracy": mean(float((r["reward"] > 0) == r["label"]) for r in out),
        "reward_margin": (mean(good) - mean(bad)) if good and bad else None,
        "beta": beta,
    }
    return out, summary, _lines(summary, None)


def _lines(summary: dict, likelihood: str | None) -> list[str]:
    f = scores.fmt_value
    lines = []
    if likelihood:
        acc = summary["preference_accuracy"]
        lines.append(f"eval: {likelihood} {f(acc['base'], 'pct')} -> {f(acc['tuned'], 'pct')}")
    style = summary["preferred_style"]
    lines.append(
        f"eval: greedy answer in the preferred style {f(style['base'], 'pct')} -> {f(style['tuned'], 'pct')}"
    )
    lines.append(
        f"eval: reward accuracy {f(summary['reward_accuracy'], 'pct')}, reward margin "
        f"{f(summary['reward_margin'], 'num')} (against the reference, beta {summary['beta']:g})"
    )
    return lines
