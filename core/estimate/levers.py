"""Every memory lever the engine has: what it saves (which term of the bill), what it costs, where it runs, and the
library code its planner term is derived from. The Estimate page's toggles, `python -m core.estimate`'s flags and
per-lever savings, "What would make it fit" and the "Fitting more" table of docs/planner.md all read one list
(core.estimate.lever_table); a generating method's own changes (GRPO's) come from core.estimate.generation_levers.
"""

from __future__ import annotations

from dataclasses import replace

from core.estimate.bill import estimate
from core.estimate.fit import eval_unit, largest, largest_eval_batch
from core.estimate.generation_levers import rollout_candidates, shrink
from core.estimate.lever_table import BOUND_LEVERS, BY_FIELD, LEVERS, Lever
from core.estimate.moe_levers import moe_candidates, moe_lever_rows
from core.estimate.plan import Plan, PlanError, generates
from core.estimate.specs import ModelSpec, SpecError, load_spec
from core.estimate.vlm_levers import vlm_candidates


def with_every_lever(plan: Plan) -> Plan:
    """`plan` with every lever of BOUND_LEVERS on that applies to it ("every lever on")."""
    changes = {}
    for field in BOUND_LEVERS:
        lever = BY_FIELD[field]
        if lever.applies(plan) and not lever.is_on(plan):
            changes[field] = lever.on
    return replace(plan, **changes)


def lever_savings(plan: Plan, spec: ModelSpec | None = None) -> list[dict]:
    """For each lever that applies to `plan`: the device-total bytes it saves (its plan off minus its plan on,
    everything else as `plan` has it), whether it is on now, and what it costs."""
    spec = spec or load_spec(plan.model)
    out = []
    for lever in LEVERS:
        if not lever.applies(plan):
            continue
        try:
            on = estimate(replace(plan, **{lever.field: lever.on}), spec)
            off = estimate(replace(plan, **{lever.field: lever.off_value(plan)}), spec)
        except (PlanError, SpecError):
            continue
        out.append(
            {
                "lever": lever.field,
                "label": lever.label,
                "on": lever.is_on(plan),
                "saves_bytes": int(off.device_total_bytes - on.device_total_bytes),
                "cpu_pinned_bytes": int(on.cpu_pinned_bytes),
                "config_key": lever.config_key,
                "costs": lever.costs,
                "runs_on": lever.runs_on,
                "measured": lever.measured,
                "term": lever.term,
                "source": lever.source,
            }
        )
    return out + moe_lever_rows(plan, spec, estimate)


def _evaluation(plan: Plan, spec: ModelSpec) -> list[tuple[str, dict, str, bool]]:
    """A smaller eval batch (the largest that fits) and fewer sample answers: they lower only an evaluation, so they
    save bytes only where it is the peak (the first evaluation is where such a run runs out of memory)."""
    out = []
    unit = eval_unit(plan)
    if plan.eval_batch_size > unit:
        e = min(largest_eval_batch(plan, spec) or unit, plan.eval_batch_size - unit)
        out.append(
            (
                f"per_device_eval_batch_size {e}",
                {"eval_batch_size": e},
                "more, smaller evaluation steps (a slower evaluation; the same eval loss)",
                True,
            )
        )
    if plan.eval_samples:
        out.append(
            (
                "no sample answers at each evaluation (training.eval_samples 0)",
                {"eval_samples": 0},
                "the Monitor shows no greedy answers to held-out prompts",
                True,
            )
        )
    return out


def _candidates(plan: Plan, spec: ModelSpec) -> list[tuple[str, dict, str, bool]]:
    """(label, plan change, cost, keeps what is trained) for every single change that could lower the bill. A
    smaller batch or length is the largest that fits (not a halving that gives away what would fit)."""
    out = []
    for lever in LEVERS:
        if lever.applies(plan) and not lever.is_on(plan):
            out.append((f"{lever.label} ({lever.setting})", {lever.field: lever.on}, lever.costs, True))
    if plan.tuning == "full":
        out.append(
            (
                "train a LoRA adapter instead of all weights",
                {"tuning": "lora"},
                "an adapter, not all weights",
                False,
            )
        )
    if plan.tuning == "lora":
        out.append(
            (
                "QLoRA: the base in 4-bit NF4",
                {"tuning": "qlora", "quant_type": "nf4"},
                "slower matmuls (dequantized on the fly); a 4-bit base",
                False,
            )
        )
    if plan.tuning == "qlora" and not plan.double_quant:
        out.append(("double quantization of the 4-bit constants", {"double_quant": True}, "none", True))
    if plan.optim != "paged_adamw_8bit" and plan.device == "cuda":
        out.append(
            (
                "paged 8-bit AdamW (paged_adamw_8bit)",
                {"optim": "paged_adamw_8bit"},
                "states can be evicted to CPU RAM under pressure",
                True,
            )
        )
    out += _sharding(plan, spec) + moe_candidates(plan, spec) + vlm_candidates(plan, spec, estimate)
    out += _evaluation(plan, spec)
    if generates(plan):  # GRPO: its batch keeps the generation batch, its length is the completion's
        return out + rollout_candidates(plan, spec)
    if plan.batch_size > 1:
        batch = largest(plan, spec, "batch_size", plan.batch_size - 1) or plan.batch_size // 2
        steps = -(-plan.batch_size // batch)
        effective = (
            "same effective batch"
            if batch * steps == plan.batch_size
            else f"effective batch {batch * steps} for {plan.batch_size}"
        )
        out.append(
            (
                f"batch size {batch} with gradient_accumulation_steps x{steps} ({effective})",
                {"batch_size": batch, "batch_tokens": 0},
                "more, smaller steps (slower on a GPU with room to spare)",
                True,
            )
        )
    if plan.seq_len > 64:
        seq = largest(plan, spec, "seq_len", plan.seq_len - 1, step=64) or max(64, plan.seq_len // 2)
        out.append(
            (
                f"shorter sequences: {seq} tokens",
                {"seq_len": seq, "batch_tokens": 0},
                "longer rows truncated",
                False,
            )
        )
    return out


SHARDING_COST = (
    "every layer is all-gathered each step (DDP is faster when one card holds the model); the effective batch "
    "grows with the GPUs (or lower gradient_accumulation_steps)"
)


def _other_cards(change: dict) -> bool:
    """Does this change ask for other hardware (more GPUs, or sharding them) rather than a setting of this card?"""
    return "gpus" in change or "strategy" in change


def _more_gpus(change: dict) -> bool:
    """Does this change ask for GPUs the plan does not have (FSDP over the ones it has does not)?"""
    return "gpus" in change


def _sharding(plan: Plan, spec: ModelSpec) -> list[tuple[str, dict, str, bool]]:
    """FSDP on the GPUs the plan has (when it asks for DDP), and more GPUs with FSDP: the fewest of 2x, 4x, 8x
    that fits, else 8x (what one card cannot hold, FSDP spreads: docs/design/multi-gpu.md)."""
    if plan.device != "cuda" or plan.strategy == "deepspeed_zero3":
        return []
    out = []
    if plan.gpus > 1 and plan.strategy == "ddp":
        out.append(
            (
                f"FSDP over the {plan.gpus} GPUs (distributed.strategy: fsdp)",
                {"strategy": "fsdp"},
                SHARDING_COST,
                True,
            )
        )
    counts = [plan.gpus * k for k in (2, 4, 8)]
    chosen = counts[-1]
    for n in counts:
        try:
            if estimate(replace(plan, gpus=n, strategy="fsdp"), spec).verdict == "fits":
                chosen = n
                break
        except (PlanError, SpecError):
            return out
    machine = "" if chosen <= 8 else " (several machines: distributed.num_machines)"
    out.append(
        (
            f"{chosen} GPUs with FSDP (distributed.gpus: {chosen}, strategy: fsdp){machine}",
            {"gpus": chosen, "strategy": "fsdp"},
            f"needs {chosen} GPUs; " + SHARDING_COST,
            True,
        )
    )
    return out


def what_would_fit(plan: Plan, spec: ModelSpec | None = None) -> list[dict]:
    """Changes that lower the device total, each re-estimated with the bytes it saves and what it costs: first what
    the GPUs the plan has can do (largest saving first), more GPUs last (largest saving first too), however much
    they save: a user asks what fits the card they own before buying more. When no single change that keeps what
    is trained fits, the first entry combines them: the levers that keep what is trained (largest saving first),
    then smaller batches, then shorter sequences, until the plan fits."""
    spec = spec or load_spec(plan.model)
    base = estimate(plan, spec)
    out = []
    for label, change, cost, keeps in _candidates(plan, spec):
        try:
            new = estimate(replace(plan, **change), spec)
        except (PlanError, SpecError):
            continue
        saved = base.device_total_bytes - new.device_total_bytes
        if saved > 0:
            out.append(_advice(label, change, cost, saved, new, keeps))
    out.sort(key=lambda c: (_more_gpus(c["settings"]), -c["saves_bytes"]))
    # no single change that keeps what is trained fits: lead with a combination of them (a shorter length
    # alone may fit, but it truncates the data)
    # (more GPUs fitting does not spare a one-card recipe: they are offered beside it)
    if base.verdict != "fits" and not any(
        c["verdict"] == "fits" and c["keeps_training"] and not _other_cards(c["settings"]) for c in out
    ):
        combo = _combined(plan, spec, base)
        if combo:
            out.insert(0, combo)
    return out


def _advice(label, change, cost, saved, new, keeps, combined=False) -> dict:
    return {
        "change": label,
        "settings": change,
        "saves_bytes": int(saved),
        "device_total_bytes": new.device_total_bytes,
        "cpu_pinned_bytes": new.cpu_pinned_bytes,
        "verdict": new.verdict,
        "costs": cost,
        "keeps_training": keeps,
        "combined": combined,
    }


def _combined(plan: Plan, spec: ModelSpec, base) -> dict | None:
    """Greedy: add the keeping change that saves most, re-estimate, repeat; then halve the batch, then the length;
    then drop every change the plan still fits without (the last added, smallest, first): a short list to act on."""

    def total(steps):
        p = plan
        for _, change, _ in steps:
            p = replace(p, **change)
        return estimate(p, spec)

    steps: list[tuple[str, dict, str]] = []
    current, est = plan, base

    def apply(label, change, cost) -> bool:
        nonlocal current, est
        try:
            new = estimate(replace(current, **change), spec)
        except (PlanError, SpecError):
            return False
        if new.device_total_bytes >= est.device_total_bytes:
            return False
        current, est = replace(current, **change), new
        steps.append((label, change, cost))
        return True

    while est.verdict != "fits":
        scored = []
        for label, change, cost, keeps in _candidates(current, spec):
            if not keeps or "batch_size" in change or _other_cards(change):
                continue  # more GPUs are offered on their own, never folded into a one-card recipe
            try:
                scored.append((estimate(replace(current, **change), spec), label, change, cost))
            except (PlanError, SpecError):
                continue
        scored = [s for s in scored if s[0].device_total_bytes < est.device_total_bytes]
        if not scored:
            break
        est, label, change, cost = min(scored, key=lambda s: s[0].device_total_bytes)
        current = replace(current, **change)
        steps.append((label, change, cost))
    for name in ("batch_size", "seq_len"):
        while est.verdict != "fits":
            smaller = _shrink(current, name)
            if smaller is None or not apply("", *smaller):
                break
    if est.verdict != "fits":
        return None
    # halvings collapse into the final size, named once
    final = {}
    for name, text in (
        ("batch_size", "batch size {} (accumulate gradients)"),
        ("seq_len", "{}-token sequences"),
    ):
        halved = [s for s in steps if name in s[1]]
        if halved:
            last = halved[-1][1]
            if "completion_len" in last:  # a generating plan's length is its completion's
                text = "max_completion_length {}".format(last["completion_len"])
            final[name] = (text.format(last[name]), last, halved[-1][2])
    steps = [s for s in steps if "batch_size" not in s[1] and "seq_len" not in s[1]] + list(final.values())
    for i in reversed(range(len(steps))):
        trial = steps[:i] + steps[i + 1 :]
        if trial and total(trial).verdict == "fits":
            steps = trial
    if len(steps) < 2:
        return None
    est = total(steps)
    settings = {k: v for _, change, _ in steps for k, v in change.items()}
    keeps = not any(k in settings for k in ("seq_len", "tuning"))
    return _advice(
        " + ".join(label for label, _, _ in steps),
        settings,
        "; ".join(dict.fromkeys(cost for _, _, cost in steps)),
        base.device_total_bytes - est.device_total_bytes,
        est,
        keeps,
        combined=True,
    )


def _shrink(plan: Plan, name: str) -> tuple[dict, str] | None:
    """(change, cost) halving the batch or the length (a generating plan's as its shape allows), or None."""
    if generates(plan):
        return shrink(plan, name)
    if name == "batch_size":
        return (
            ({"batch_size": plan.batch_size // 2, "batch_tokens": 0}, "more steps")
            if plan.batch_size > 1
            else None
        )
    if plan.seq_len <= 64:
        return None
    return {"seq_len": max(64, plan.seq_len // 2), "batch_tokens": 0}, "longer rows truncated"


def modelled_note(plan: Plan) -> str | None:
    """One sentence naming the levers of `plan` whose terms are modelled from their code but not yet measured."""
    names = [lv.label for lv in LEVERS if not lv.measured and lv.applies(plan) and lv.is_on(plan)]
    if not names:
        return None
    return f"{', '.join(names)}: modelled from the library code, not yet measured on a GPU."


def levers_markdown() -> str:
    """The "Fitting more" table of docs/planner.md (tests/test_levers.py keeps the page in step with it)."""
    rows = [
        "| lever | run config | saves | costs | runs on | planner term (modelled from) |",
        "|---|---|---|---|---|---|",
    ]
    for lv in LEVERS:
        key = f"`{lv.config_key}`" if lv.config_key else "always on in the engine"
        rows.append(
            f"| {lv.label} | {key} | {lv.saves} | {lv.costs} | {lv.runs_on} | {lv.term} (`{lv.source}`) |"
        )
    return "\n".join(rows)


__all__ = [
    "LEVERS",
    "BY_FIELD",
    "Lever",
    "lever_savings",
    "modelled_note",
    "levers_markdown",
    "what_would_fit",
    "with_every_lever",
]
