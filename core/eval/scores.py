"""The scores of a generated answer against its reference, per row and over a set: exact match, token F1,
ROUGE-L (rouge-score) and chrF (sacrebleu), and the summary lines `eval: <metric> B -> A`.

One rule for every score (NORMALIZATION): the text as the model wrote it, case and punctuation counting ("lpjwx"
is not "LPJWX"), the way core.demo's held-out accuracy judges. Exact match compares the stripped strings; token F1
is SQuAD's overlap of whitespace tokens; ROUGE-L is rouge-score's longest-common-subsequence F-measure over the same
whitespace tokens (its own tokenizer would lower-case and keep ASCII words only, so a base answering in the wrong
case scored 1 there and 0 everywhere else); chrF (sacrebleu) compares characters, case-sensitive. Scores are
fractions (0..1); the lines show percentages.
"""

from __future__ import annotations

import math
from collections import Counter

# (key, label, kind): kind "pct" is a 0..1 share shown as a percentage, "num" a plain number (lower is better)
METRICS = (
    ("exact_match", "exact match", "pct"),
    ("token_f1", "token F1", "pct"),
    ("rouge_l", "ROUGE-L", "pct"),
    ("chrf", "chrF", "pct"),
)
LOSS_METRICS = (("answer_loss", "answer loss", "num"), ("perplexity", "perplexity", "num"))
NORMALIZATION = (
    "Every score reads the answer as written: case and punctuation count; exact match on the stripped text, token F1 "
    "and ROUGE-L on whitespace tokens, chrF on characters."
)
LABELS = {key: label for key, label, _ in (*METRICS, *LOSS_METRICS)}
KINDS = {key: kind for key, _, kind in (*METRICS, *LOSS_METRICS)}


def exact_match(answer: str, reference: str) -> float:
    return float(answer.strip() == reference.strip())


def token_f1(answer: str, reference: str) -> float:
    """Harmonic mean of token precision and recall (whitespace tokens, multiset overlap); 1.0 when both empty."""
    a, r = answer.split(), reference.split()
    if not a or not r:
        return float(a == r)
    common = sum((Counter(a) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(r)
    return 2 * precision * recall / (precision + recall)


_ROUGE = None


class _WhitespaceTokens:
    """rouge-score's tokenizer interface: token F1's tokens (whitespace-separated, as written)."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


def rouge_l(answer: str, reference: str) -> float:
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WhitespaceTokens())
    return float(_ROUGE.score(reference, answer)["rougeL"].fmeasure)


def chrf(answer: str, reference: str) -> float:
    from sacrebleu.metrics import CHRF

    return float(CHRF().sentence_score(answer, [reference]).score) / 100.0


SCORERS = {"exact_match": exact_match, "token_f1": token_f1, "rouge_l": rouge_l, "chrf": chrf}


def score(answer: str, reference: str) -> dict[str, float]:
    """Every metric of one answer: {key: 0..1}."""
    return {key: fn(answer, reference) for key, fn in SCORERS.items()}


def mean(values) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict], sides: tuple[str, ...] = ("base", "tuned")) -> dict[str, dict]:
    """{metric: {side: mean over rows}} from rows holding `<side>_<metric>` fields; answer loss as the mean per
    token over all answer tokens (`<side>_loss_sum` / `n_answer_tokens`), perplexity its exp."""
    out: dict[str, dict] = {}
    for key, _, _ in METRICS:
        out[key] = {side: mean(r.get(f"{side}_{key}") for r in rows) for side in sides}
    tokens = sum(r.get("n_answer_tokens") or 0 for r in rows)
    if tokens and all(r.get(f"{sides[0]}_loss_sum") is not None for r in rows):
        loss = {side: sum(r[f"{side}_loss_sum"] for r in rows) / tokens for side in sides}
        out["answer_loss"] = loss
        out["perplexity"] = {side: math.exp(min(v, 700.0)) for side, v in loss.items()}
    return out


def fmt_value(value: float | None, kind: str) -> str:
    """A summary figure as the lines show it: "97.5%" (no ".0" on whole numbers: "0% -> 100%"), "0.0412"."""
    if value is None:
        return "–"
    if kind == "pct":
        pct = round(100.0 * value, 1)
        return f"{pct:.0f}%" if pct == int(pct) else f"{pct:.1f}%"
    return f"{value:.4g}"


def summary_lines(summary: dict[str, dict], before: str = "base", after: str = "tuned") -> list[str]:
    """`eval: <metric> B -> A` for each metric in the summary (base, then the adapter)."""
    lines = []
    for key, label, kind in (*METRICS, *LOSS_METRICS):
        if key in summary:
            fig = summary[key]
            lines.append(
                f"eval: {label} {fmt_value(fig.get(before), kind)} -> {fmt_value(fig.get(after), kind)}"
            )
    return lines


def change(row: dict, metric: str = "chrf") -> float | None:
    """How much the adapter changed one row's score (tuned - base): what the table sorts by."""
    b, a = row.get(f"base_{metric}"), row.get(f"tuned_{metric}")
    return None if a is None or b is None else a - b
