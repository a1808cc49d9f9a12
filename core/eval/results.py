"""Stored evaluations: <run>/eval/<name>/ with settings.json, rows.jsonl and summary.json (core.eval.run writes
them), read back for the Evaluate page, the Runs page's comparison and the CSV export. Light: no torch here."""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path

from core.eval.scores import KINDS, LABELS, fmt_value
from core.files import iter_jsonl_objects, read_json_object

EVAL_DIR = "eval"
SETTINGS, ROWS, SUMMARY = "settings.json", "rows.jsonl", "summary.json"
# the per-row table's first columns, in this order (the rest follow as stored)
LEADING = (
    "row",
    "prompt",
    "reference",
    "chosen",
    "rejected",
    "answer",
    "label",
    "base_answer",
    "tuned_answer",
    "change",
)


# What an evaluation scores, by the run's method's eval_kind (the Evaluate page says it for the chosen run)
SCORED = {
    "answers": "Greedy answers to held-out questions, scored against their reference answers: exact match, token "
    "F1, ROUGE-L, chrF and the answers' loss.",
    "pairs": "Held-out preference pairs: does each model rank the chosen answer above the rejected one (preference "
    "accuracy), the reward margins, and is its greedy answer in the preferred style.",
    "rated": "Held-out rated answers: the reward's sign against each rating, the margin of good over bad answers, "
    "and whether the greedy answer is in the good answers' style.",
    "rewards": "Greedy answers to held-out prompts (a prompts file with its answer column, or the run's eval split), "
    "scored by the run's own reward functions, weighted as it trained, and by exact match against the answer "
    "column.",
}


@dataclass
class Result:
    folder: Path
    settings: dict
    summary: dict
    lines: list[str]
    rows: list[dict] | None = None
    reused: bool = False
    note: str = ""

    @property
    def name(self) -> str:
        return self.folder.name


def read_result(folder: str | os.PathLike, with_rows: bool = True) -> Result | None:
    """A stored evaluation (None when the folder holds none)."""
    folder = Path(folder)
    settings, summary = read_json_object(folder / SETTINGS), read_json_object(folder / SUMMARY)
    if settings is None or summary is None:
        return None
    rows = list(iter_jsonl_objects(folder / ROWS)) if with_rows and (folder / ROWS).is_file() else None
    return Result(folder, settings, summary.get("summary") or {}, summary.get("lines") or [], rows)


def list_results(run_dir: str | os.PathLike) -> list[Result]:
    """The run's stored evaluations, newest first (without their rows)."""
    root = Path(run_dir) / EVAL_DIR
    if not root.is_dir():
        return []
    found = [r for d in root.iterdir() if d.is_dir() and (r := read_result(d, with_rows=False))]
    return sorted(found, key=lambda r: r.summary.get("finished") or 0, reverse=True)


def table(rows: list[dict], by: str = "change", descending: bool = True) -> list[dict]:
    """The per-row table: leading columns first, sorted by `by` (rows without a value last)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    order = [k for k in LEADING if k in keys] + [k for k in keys if k not in LEADING]
    shaped = [{k: r.get(k) for k in order} for r in rows]
    have = [r for r in shaped if isinstance(r.get(by), (int, float))]
    rest = [r for r in shaped if not isinstance(r.get(by), (int, float))]
    return sorted(have, key=lambda r: r[by], reverse=descending) + rest


def rows_csv(rows: list[dict]) -> str:
    """The per-row table as CSV text (the Evaluate page's download)."""
    shaped = table(rows)
    out = io.StringIO()
    if shaped:
        writer = csv.DictWriter(out, fieldnames=list(shaped[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(shaped)
    return out.getvalue()


def figures(result: Result) -> list[dict]:
    """[{"metric", "base", "tuned", "change"}] as text: the summary as a small table."""
    out = []
    for key, fig in result.summary.items():
        if isinstance(fig, dict) and "base" in fig and "tuned" in fig:
            kind = fig.get("kind") or KINDS.get(
                key, "pct"
            )  # a figure may say how it reads (a reward: a number)
            b, a = fig.get("base"), fig.get("tuned")
            delta = None if a is None or b is None else a - b
            out.append(
                {
                    "metric": fig.get("label") or LABELS.get(key, key.replace("_", " ")),
                    "base": fmt_value(b, kind),
                    "tuned": fmt_value(a, kind),
                    "change": "–" if delta is None else ("+" if delta >= 0 else "") + fmt_value(delta, kind),
                }
            )
    return out


def headline(run_dir: str | os.PathLike) -> str | None:
    """The newest evaluation's first line without its `eval: ` ("exact match 0% -> 100%"), or None."""
    found = list_results(run_dir)
    if not found or not found[0].lines:
        return None
    return found[0].lines[0].removeprefix("eval: ")


def compare_rows(run_dirs: list[str | os.PathLike]) -> list[dict]:
    """For the Runs page: each run's newest evaluation, one row per run and figure (base, tuned, data)."""
    out = []
    for run_dir in run_dirs:
        found = list_results(run_dir)
        if not found:
            continue
        newest = found[0]
        for fig in figures(newest):
            out.append(
                {
                    "run": Path(run_dir).name,
                    "evaluation": newest.name,
                    **fig,
                    "data": newest.settings.get("data"),
                }
            )
    return out
