"""Every model type transformers knows, planned from its default config alone (`python -m core.estimate --model
DIR`, in this process): how many causal and vision-language types plan, how many are refused in one sentence, and
which end in a traceback (none may). What "any model from its config" means, measured rather than claimed; the
refusals grouped by their reason show what to model next.

Default configs are the library's own (AutoConfig.for_model): some lack fields a published config.json has, so a
refusal here may be the default's ("transformers cannot build ... from this config.json") rather than the planner's.

    python benchmarks/model_coverage.py [--tuning lora] [--show-refusals] [--quick]

Also checked for every planned causal type: the saved config.json plans as the config transformers made in memory,
and the planner reads it as AutoConfig.from_pretrained does (transformers' own float encoding, nested configs), and which layer kinds are still
planned as attention. Last line `planner_tracebacks: N (goal 0)`; exit 1 on a traceback or a misread config.
`--quick` (the suite's check that the script runs): QUICK_TYPES only; a miss does not fail it, an error does.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUICK_TYPES = ("llama", "qwen3_5_text", "llava")  # a causal LM, a hybrid decoder, a vision-language model


def model_types() -> dict[str, str]:
    """model_type -> "causal" or "vision" (image-text-to-text), as transformers' auto classes map them."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    kinds = {t: "vision" for t in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
    kinds.update({t: "causal" for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES})
    return dict(sorted(kinds.items()))


def plan_one(folder: Path, tuning: str) -> tuple[str, str]:
    """("planned" | "refused" | "traceback", the sentence or the exception)."""
    from core.estimate.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--model", str(folder), "--tuning", tuning, "--gpu-gb", "24"])
    except SystemExit as exc:
        rc = exc.code
    except Exception as exc:  # what the planner must never do
        return "traceback", "".join(traceback.format_exception_only(exc)).strip()
    said = (err.getvalue().strip() or out.getvalue().strip()).splitlines()
    if rc == 0:
        return "planned", ""
    if "Traceback" in err.getvalue():
        return "traceback", said[-1] if said else ""
    return "refused", said[-1] if said else f"exit {rc}, nothing said"


def config_differs(folder: Path, model_type: str) -> str:
    """ "" when a config.json transformers saved plans as the config it made in memory (the same spec) and the
    planner reads it as AutoConfig.from_pretrained does (every field, nested text / vision configs included);
    else the first difference."""
    import dataclasses

    from transformers import AutoConfig

    from core.estimate.model_config import load_model_config
    from core.estimate.specs import _build_spec, load_spec

    def fields(config) -> dict:
        d = config.to_dict()
        d.pop("transformers_version", None)
        d.pop("_name_or_path", None)
        return d

    ours, theirs = fields(load_model_config(str(folder))), fields(AutoConfig.from_pretrained(folder))
    for key in sorted(set(ours) | set(theirs), key=str):
        if ours.get(key) != theirs.get(key):
            return f"{key}: read {str(ours.get(key))[:60]}, from_pretrained {str(theirs.get(key))[:60]}"
    saved = dataclasses.asdict(load_spec(str(folder)))
    in_memory = dataclasses.asdict(_build_spec(str(folder), AutoConfig.for_model(model_type)))
    for key in saved.keys() - {"model_id", "config_json"}:
        if saved[key] != in_memory[key]:
            return f"the plan's {key}: {str(saved[key])[:60]} saved, {str(in_memory[key])[:60]} in memory"
    return ""


def layer_kinds_not_modelled(folder: Path) -> list[str]:
    """The token-mixer kinds of a planned model that the planner counts as attention (it warns)."""
    from core.estimate.layer_kinds import ATTENTION, kinds_of
    from core.estimate.mixer_terms import MIXERS
    from core.estimate.specs import load_spec

    kinds = kinds_of(load_spec(str(folder)))
    return sorted({m for mixers, _ in kinds for m in mixers if m != ATTENTION and m not in MIXERS})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tuning", default="lora", choices=["lora", "qlora", "full"])
    p.add_argument("--show-refusals", action="store_true", help="every refused type with its sentence")
    p.add_argument("--quick", action="store_true", help="QUICK_TYPES only (goal not judged)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers import AutoConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    kinds = model_types()
    if args.quick:
        kinds = {t: kinds[t] for t in QUICK_TYPES}
    results: dict[str, tuple[str, str, str]] = {}
    misread: dict[
        str, str
    ] = {}  # planned types whose saved config.json reads other than the in-memory config
    unmodelled: dict[str, list[str]] = {}  # planned types with layers planned as attention (with a warning)
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, kind in kinds.items():
            folder = Path(tmp) / model_type
            try:
                AutoConfig.for_model(model_type).save_pretrained(folder)
            except Exception as exc:  # the library cannot make its own default: not the planner's to plan
                results[model_type] = (kind, "no default", str(exc).splitlines()[0][:100])
                continue
            results[model_type] = (kind, *plan_one(folder, args.tuning))
            if kind == "causal" and results[model_type][1] == "planned":
                if differs := config_differs(folder, model_type):
                    misread[model_type] = differs
                if odd := layer_kinds_not_modelled(folder):
                    unmodelled[model_type] = odd
    counts = collections.Counter((kind, outcome) for kind, outcome, _ in results.values())
    for kind, label in (("causal", "causal LM"), ("vision", "image-text-to-text only")):
        total = sum(n for (k, _), n in counts.items() if k == kind)
        print(
            f"{label:<23} {total:>4} types: {counts[kind, 'planned']:>4} planned, {counts[kind, 'refused']:>4} refused "
            f"in one sentence, {counts[kind, 'no default']:>3} without a default config, "
            f"{counts[kind, 'traceback']:>3} tracebacks"
        )
    reasons = collections.Counter()
    for _kind, outcome, said in results.values():
        if outcome == "refused":
            reasons[re.sub(r"^error: |/\S+|\(.*", "", said)[:110]] += 1
    print("\nthe commonest refusals:")
    for reason, n in reasons.most_common(8):
        print(f"{n:>4}  {reason}")
    if args.show_refusals:
        for model_type, (kind, outcome, said) in results.items():
            if outcome == "refused":
                print(f"{model_type} ({kind}): {said}")
    print(
        f"\nplanned causal types with a layer kind not modelled (planned as attention, warned): {len(unmodelled)}"
    )
    for model_type, kinds in unmodelled.items():
        print(f"  {model_type}: {', '.join(kinds)}")
    print(f"planned causal types whose saved config.json plans or reads other than in memory: {len(misread)}")
    for model_type, differs in misread.items():
        print(f"  {model_type}: {differs}")
    tracebacks = {t: said for t, (_, outcome, said) in results.items() if outcome == "traceback"}
    for model_type, said in tracebacks.items():
        print(f"TRACEBACK {model_type}: {said}")
    print(f"planner_tracebacks: {len(tracebacks)} (goal 0{'; --quick: not judged' if args.quick else ''})")
    return 1 if (tracebacks or misread) and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
