"""`python -m core.eval`: the base against the tuned model on held-out rows; prints `eval: <metric> B -> A`.

Exit status: 0 done, 2 bad input (one sentence on stderr, no traceback), 1 anything else.
"""

from __future__ import annotations

import argparse
import sys

from core.eval.heldout import EvalError
from core.fmt import command
from core.recipe.data import DataError


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(
        prog=command("eval"),
        description="The base against the tuned model on held-out rows; prints `eval: <metric> B -> A` lines.",
    )
    p.add_argument(
        "--run", help="run folder or run name (its adapter, or its newest checkpoint while it trains)"
    )
    p.add_argument(
        "--data",
        help="data file to evaluate on (alpaca, chat or question/answer; a DPO / KTO run's pairs or rated answers; a "
        "GRPO run's prompts with their answer column; default: the run's own eval split)",
    )
    p.add_argument(
        "--workspace",
        help="where --run NAME is looked up, under runs/ (default: $LORA_COCKPIT_WORKSPACE, else ./workspace)",
    )
    p.add_argument("--adapter", help="an adapter folder (default: the run's)")
    p.add_argument("--model", help="a merged export or full model folder, compared with its base")
    p.add_argument("--base", help="the base model folder (default: the run config's model.path)")
    p.add_argument("--name", help="result folder name under <run>/eval/ (default: from the data)")
    p.add_argument("--limit", type=int, help="evaluate the first N rows only")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="answer length (default: longest reference + 8 tokens; a GRPO run: its max_completion_length)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", help="cpu or cuda (default: the GPU when there is one)")
    p.add_argument("--force", action="store_true", help="evaluate again even when stored with these settings")
    p.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="also run lm-evaluation-harness tasks (comma-separated "
        "names or task YAML files; needs `pip install lm-eval`)",
    )
    p.add_argument(
        "--rows", type=int, default=0, help="print this many rows of the table (largest change first)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for flag in ("limit", "max_new_tokens", "batch_size", "rows"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "rows" else 1):
            print(f"error: --{flag.replace('_', '-')} must be at least 1 (got {value}).", file=sys.stderr)
            return 2
    try:
        from core.eval.run import evaluate

        result = evaluate(
            args.run,
            data=args.data,
            adapter=args.adapter,
            model=args.model,
            base=args.base,
            name=args.name,
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            device=args.device,
            force=args.force,
            workspace=args.workspace,
            progress=_progress,
        )
        lm_lines = []
        if args.lm_eval:
            from core.eval.harness import run_tasks

            lm_lines = run_tasks(result, args.lm_eval)
    except (EvalError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a CLI prints the sentence, not a traceback (a bug still says what it was)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(file=sys.stderr)
    if result.note:
        print(result.note)
    n = result.summary.get("rows")
    said = "stored earlier with these settings" if result.reused else f"{n} rows"
    print(
        f"evaluated {result.settings.get('what')} on {result.settings.get('data')} ({said}): {result.folder}"
    )
    for line in [*result.lines, *lm_lines]:
        print(line)
    if args.rows and result.rows:
        top = sorted(result.rows, key=lambda r: -abs(r.get("change") or 0))[: args.rows]
        for r in top:
            print(
                f"row {r['row']}: {r['prompt']!r} ref {r.get('reference')!r} base {r.get('base_answer')!r} "
                f"tuned {r.get('tuned_answer')!r}"
            )
    return 0


def _progress(**fields) -> None:
    if fields.get("total"):
        print(
            f"\r{fields.get('phase')}: {fields.get('done')}/{fields['total']}   ",
            end="",
            file=sys.stderr,
            flush=True,
        )
