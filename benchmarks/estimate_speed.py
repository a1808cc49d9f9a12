"""How fast the planner answers once a model's spec is loaded: one estimate (goal <=20 ms) and the fit search
(goal <=300 ms), for several presets and plans. Medians over repeated runs; exits non-zero on a miss.

    python benchmarks/estimate_speed.py [--quick]

`--quick` (the suite's check that the script runs): the first plan, few repeats; headline printed, exit 0 on a miss.
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from core.estimate.bill import estimate  # noqa: E402
from core.estimate.fit import fit_search  # noqa: E402
from core.estimate.levers import what_would_fit  # noqa: E402
from core.estimate.plan import Plan  # noqa: E402
from core.estimate.specs import load_spec, lora_targets, normalize_targets  # noqa: E402

ESTIMATE_GOAL_MS = 20.0
FIT_GOAL_MS = 300.0
PLANS = [
    Plan(model="meta-llama/Llama-2-7b-hf", tuning="lora", batch_size=4, seq_len=2048),
    Plan(
        model="meta-llama/Llama-3.1-8B", tuning="qlora", batch_size=2, seq_len=4096, optim="paged_adamw_8bit"
    ),
    Plan(model="Qwen/Qwen2.5-32B", tuning="qlora", gradient_checkpointing=True, gpu_gb=48),
    Plan(model="meta-llama/Llama-3.1-70B", tuning="full", load_dtype="bf16", gpu_gb=141),
]


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first plan, few repeats (goal not judged)")
    args = ap.parse_args(argv)
    plans, repeat = (PLANS[:1], 1) if args.quick else (PLANS, 5)
    worst_est = worst_fit = 0.0
    for plan in plans:
        t = time.perf_counter()
        spec = load_spec(plan.model)  # the one-off part: meta build + peft on meta, cached afterwards
        if plan.tuning != "full":
            lora_targets(plan.model, normalize_targets(plan.target_modules))
        load_s = time.perf_counter() - t
        est_ms = median_ms(lambda p=plan, s=spec: estimate(p, s), 10 * repeat)
        fit_ms = median_ms(lambda p=plan, s=spec: fit_search(p, s), repeat)
        advice_ms = median_ms(lambda p=plan, s=spec: what_would_fit(replace(p), s), repeat)
        worst_est, worst_fit = max(worst_est, est_ms), max(worst_fit, fit_ms)
        print(
            f"{plan.model:<34} {plan.tuning:<5} spec load {load_s:6.2f} s | estimate {est_ms:6.2f} ms "
            f"({est_ms / ESTIMATE_GOAL_MS:.2f}x goal) | fit search {fit_ms:7.1f} ms ({fit_ms / FIT_GOAL_MS:.2f}x goal)"
            f" | advice {advice_ms:6.1f} ms"
        )
    ok = worst_est <= ESTIMATE_GOAL_MS and worst_fit <= FIT_GOAL_MS
    print(
        f"estimate_speed: {worst_est:.2f} ms per estimate, {worst_fit:.1f} ms per fit search, worst of "
        f"{len(plans)} plans (goal <= {ESTIMATE_GOAL_MS:.0f} ms and <= {FIT_GOAL_MS:.0f} ms"
        + ("; --quick: not judged)" if args.quick else ")")
    )
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
