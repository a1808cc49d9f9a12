"""Evaluation speed: `core.eval` on 100 held-out demo rows (one model load, base and tuned answers in batches,
answer losses, four scores per answer, results written) against a plain transformers loop that only generates
the same 100 answers with the base and with the adapter, one prompt at a time. Goal: ratio <= 2.

Both sides load the base and the adapter themselves (inside the timed region) and generate greedily with the
same number of new tokens. Sides alternate (A B, B A, ...); the ratio is the median over pairs of wall-clock
time, with CPU time of this process printed beside it (on a shared machine the wall clock swings with other
people's jobs). torch runs with one thread on both sides.

    python benchmarks/eval_speed.py [--run RUN_DIR] [--pairs 3] [--rows 100] [--quick]

Without --run the demo is built in a temporary folder and a short demo run (60 steps) trained first.
`--quick` (the suite's check that the script runs): a demo pretrained 20 steps, a 4-step run, 4 rows, 1 pair;
headline printed, exit 0 even on a goal miss, non-zero on an error or when the sides answer differently.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL = 2.0


def demo_run(root: Path, quick: bool = False) -> tuple[Path, Path]:
    """(demo folder, a finished short demo run); `quick`: a barely pretrained demo and a 4-step run."""
    from core.demo.build import PRETRAIN_STEPS, build_demo, demo_config, train_demo_run

    demo = build_demo(root / "demo", pretrain_steps=20 if quick else PRETRAIN_STEPS, log=lambda _m: None)
    cfg = demo_config(out=demo)
    steps = 4 if quick else 60
    cfg["training"].update(max_steps=steps, eval_steps=steps // 2, save_steps=steps)
    return demo, train_demo_run(demo, "bench-run", cfg)


def heldout_file(run_dir: Path, rows: int) -> Path:
    """The demo's held-out words as a question/answer file of `rows` rows (cycled when more are asked)."""
    from core.recipe.config import load_config

    demo = Path(load_config(run_dir / "config.yaml")["model"]["path"]).parent
    lines = [json.loads(x) for x in (demo / "heldout.jsonl").read_text().splitlines() if x.strip()]
    path = run_dir.parent / f"bench-heldout-{rows}.jsonl"
    path.write_text("".join(json.dumps(lines[i % len(lines)]) + "\n" for i in range(rows)))
    return path


def run_core(run_dir: Path, data: Path, i: int) -> tuple[float, float, int, dict]:
    from core.eval.run import evaluate

    w0, c0 = time.perf_counter(), time.process_time()
    result = evaluate(run_dir, data=str(data), name=f"bench-{i}", force=True)
    w, c = time.perf_counter() - w0, time.process_time() - c0
    return w, c, result.settings["max_new_tokens"], result.summary["exact_match"]


def run_plain(run_dir: Path, data: Path, new_tokens: int) -> tuple[float, float, dict]:
    """Load the base, put the adapter on, and generate each answer alone with model.generate (base and tuned)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.recipe.config import load_config

    w0, c0 = time.perf_counter(), time.process_time()
    base = load_config(run_dir / "config.yaml")["model"]["path"]
    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), str(run_dir / "adapter")
    ).eval()
    rows = [json.loads(x) for x in data.read_text().splitlines() if x.strip()]
    correct = {"base": 0, "tuned": 0}
    with torch.no_grad():
        for side in ("base", "tuned"):
            for r in rows:
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": r["question"]}],
                    add_generation_prompt=True,
                    return_tensors="pt",
                    return_dict=True,
                )
                if side == "base":
                    with model.disable_adapter():
                        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
                else:
                    out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
                text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
                correct[side] += text == r["answer"]
    w, c = time.perf_counter() - w0, time.process_time() - c0
    return w, c, {k: v / len(rows) for k, v in correct.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a finished demo run folder (default: build one in a temporary folder)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument(
        "--quick", action="store_true", help="a tiny demo run, 4 rows, 1 pair (goal not judged)"
    )
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.rows = 1, 4

    import datasets
    import torch
    import transformers

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run).resolve() if args.run else demo_run(Path(tmp), args.quick)[1]
        data = heldout_file(run_dir, args.rows)
        _, _, new_tokens, _ = run_core(run_dir, data, -1)  # warm-up: lazy imports, caches
        run_plain(run_dir, data, new_tokens)
        wall, cpu = [], []
        for i in range(args.pairs):
            times = {}
            for side in ("core", "plain") if i % 2 == 0 else ("plain", "core"):
                if side == "core":
                    w, c, _, em = run_core(run_dir, data, i)
                    times[side] = (w, c)
                else:
                    w, c, plain_em = run_plain(run_dir, data, new_tokens)
                    times[side] = (w, c)
            if em != plain_em:  # the same answers on both sides, or the comparison is void
                print(f"the sides answered differently: core.eval {em} vs plain {plain_em}", file=sys.stderr)
                return 2
            wall.append(times["core"][0] / times["plain"][0])
            cpu.append(times["core"][1] / times["plain"][1])
            print(
                f"pair {i + 1}: core.eval {times['core'][0]:.2f} s ({times['core'][1]:.2f} CPU-s), plain loop "
                f"{times['plain'][0]:.2f} s ({times['plain'][1]:.2f} CPU-s): ratio {wall[-1]:.3f} wall, "
                f"{cpu[-1]:.3f} CPU",
                flush=True,
            )
        print(
            f"rows {args.rows} (base and tuned: {2 * args.rows} answers), {new_tokens} new tokens, exact match {em}"
        )
        print(f"median CPU-time ratio: {statistics.median(cpu):.3f}")
    ratio = statistics.median(wall)
    print(
        f"eval_speed core.eval / plain generate loop, {args.rows} demo rows: {ratio:.3f}x (goal <= {GOAL:g}x"
        + ("; --quick: not judged)" if args.quick else ")")
    )
    return 0 if ratio <= GOAL or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
