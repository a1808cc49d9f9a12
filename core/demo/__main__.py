"""`python -m core.demo`: build the demo (a tiny local model + a chat dataset) and, on request, train it: the SFT
run, the DPO or KTO run on top of it, or the GRPO run from a warm start."""

import json
import sys
from pathlib import Path

from core.demo.build import (
    PRETRAIN_STEPS,
    NotADemoFolder,
    build_demo,
    demo_config,
    demo_dir,
    heldout_accuracy,
    train_demo_run,
    write_run_config,
)
from core.demo.prefs import (
    PREFERENCE_DEMOS,
    chosen_accuracy,
    ensure_pref_data,
    preference_accuracy,
    read_pairs,
)
from core.fmt import command, summary
from core.workspace import default_workspace


def preference_demo(out: Path, sft_adapter: Path, method: str) -> tuple[float, float]:
    """Merge the SFT adapter into the demo base, train the method's demo run (DPO or KTO, core.demo.prefs) on top
    of it, and compare the held-out preference accuracy (core.demo.prefs.preference_accuracy) before and after."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, heldout_path = ensure_pref_data(out)
    merged = _merged_sft(out, sft_adapter)
    heldout = read_pairs(heldout_path)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    sft_model = AutoModelForCausalLM.from_pretrained(merged)
    before = preference_accuracy(sft_model, tokenizer, heldout)
    run_dir = train_demo_run(out, f"example-{method}-run", PREFERENCE_DEMOS[method](out, merged))
    model = PeftModel.from_pretrained(sft_model, str(run_dir / "adapter"))  # on the model measured before
    after = preference_accuracy(model, tokenizer, heldout)
    says = chosen_accuracy(model, tokenizer, heldout)
    print(f"held-out answers in the preferred style after {method.upper()}: {says:.0%}", flush=True)
    print(f"{method} demo: held-out preference accuracy {before:.0%} -> {after:.0%}", flush=True)
    return before, after


def grpo_demo(out: Path) -> tuple[float, float]:
    """GRPO from the warm start (core.demo.grpo): held-out mean reward and exact match before and after."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.demo.grpo import (
        REWARDS,
        ensure_grpo_data,
        grpo_demo_config,
        heldout_scores,
        warm_base,
        warm_start_line,
    )

    _, heldout_path = ensure_grpo_data(out)
    heldout = [json.loads(line) for line in heldout_path.read_text(encoding="utf-8").splitlines() if line]
    start = warm_base(out)
    if said := warm_start_line(start):
        print(said, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(start)
    model = AutoModelForCausalLM.from_pretrained(start)
    reward_before, exact_before = heldout_scores(model, tokenizer, heldout, REWARDS)
    run_dir = train_demo_run(out, "example-grpo-run", grpo_demo_config(out, start))
    tuned = PeftModel.from_pretrained(model, str(run_dir / "adapter"))
    reward_after, exact_after = heldout_scores(tuned, tokenizer, heldout, REWARDS)
    print(f"grpo demo: held-out exact match {exact_before:.0%} -> {exact_after:.0%}", flush=True)
    print(f"grpo demo: held-out mean reward {reward_before:.2f} -> {reward_after:.2f}", flush=True)
    return reward_before, reward_after


def _merged_sft(out: Path, sft_adapter: Path) -> Path:
    """The SFT adapter merged into the demo base, in a new folder (the preference demos train on top of it)."""
    from core.merge.export import merge_at

    merged, n = out / "sft-merged", 2
    while merged.exists():
        merged, n = out / f"sft-merged-{n}", n + 1
    merge_at(out / "base", sft_adapter, merged, dtype="fp32")
    return merged


def argument_problem(args) -> str | None:
    """What is wrong with the command line, in one sentence, or None."""
    if args.run and args.adapter:
        return (
            "--run trains a new adapter and --adapter names one already trained: give one of them (--adapter "
            "with --run-dpo or --run-kto builds on that adapter instead of training one)."
        )
    if args.adapter:
        from core.merge.adapter import check_adapter  # the merge's own reading of an adapter folder
        from core.merge.errors import MergeError

        try:
            check_adapter(args.adapter)
        except MergeError as exc:
            return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=command("demo"), description=summary(__doc__))
    parser.add_argument("--out", help="demo folder (default: <workspace>/demo)")
    parser.add_argument(
        "--workspace",
        help="the workspace whose demo/ folder to build (default: $LORA_COCKPIT_WORKSPACE, else ./workspace)",
    )
    parser.add_argument("--run", action="store_true", help="also train the default demo run and compare")
    parser.add_argument(
        "--adapter",
        help="report held-out accuracy of this adapter folder (e.g. RUN/adapter); with --run-dpo / --run-kto: "
        "the SFT adapter they build on (instead of training it again)",
    )
    parser.add_argument(
        "--run-dpo",
        action="store_true",
        help="train the demo run, merge it, then a DPO run on top of it that prefers 'HELLO!' over 'HELLO'",
    )
    parser.add_argument(
        "--run-kto",
        action="store_true",
        help="train the demo run, merge it, then a KTO run on top of it from rated answers ('HELLO!' good, "
        "'HELLO' bad)",
    )
    parser.add_argument(
        "--run-grpo",
        action="store_true",
        help="GRPO from a warm start (the SFT demo run's first steps, merged) with an exact-match reward; prints "
        "the held-out mean reward and exact match before -> after",
    )
    parser.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS)
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else demo_dir(default_workspace(args.workspace))
    problem = argument_problem(args)
    if problem:  # found before the demo builds, loads or trains anything (minutes of work)
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        build_demo(out, pretrain_steps=args.pretrain_steps)
        run_yaml = write_run_config(out)
        print(f"demo run config: {run_yaml} ({command('train')} {run_yaml} --run-dir RUN_DIR)", flush=True)
        before = heldout_accuracy(out)
        print(f"held-out accuracy before training: {before:.0%}", flush=True)
        adapter = Path(args.adapter) if args.adapter else None
        # the preference demos build on the SFT run: --adapter names one already trained, else it is trained here
        if args.run or ((args.run_dpo or args.run_kto) and adapter is None):
            run_dir = train_demo_run(out, "example-run", demo_config(out=out))
            adapter = run_dir / "adapter"
        if adapter is not None:
            after = heldout_accuracy(out, adapter)
            print(f"held-out accuracy after training: {after:.0%} (before {before:.0%})", flush=True)
        if args.run_dpo:
            preference_demo(out, adapter, "dpo")
        if args.run_kto:
            preference_demo(out, adapter, "kto")
        if args.run_grpo:
            grpo_demo(out)
    except OSError as exc:  # the folder cannot be written: bad input, not a failure of the demo
        print(
            f"error: cannot write the demo into {out} ({exc.strerror or exc}): give a folder you can write.",
            file=sys.stderr,
        )
        return 2
    except NotADemoFolder as exc:  # bad input: nothing was built
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a CLI prints the sentence, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
