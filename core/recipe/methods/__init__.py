"""The training methods, one module each: what differs between SFT, DPO, KTO and GRPO lives there and nowhere
else.

    from core.recipe import methods
    method = methods.get(cfg)          # the run config's method (or its name)
    train_ds, eval_ds = method.datasets(cfg, tokenizer)

Adding a method is one module with a `METHOD` plus a line here.
"""

from __future__ import annotations

from core.recipe.methods import dpo, grpo, kto, sft
from core.recipe.methods.base import Chart, Method, PlanTraits

REGISTRY: dict[str, Method] = {m.METHOD.name: m.METHOD for m in (sft, dpo, kto, grpo)}
NAMES = tuple(REGISTRY)


def get(which: str | dict | None) -> Method:
    """The Method of a run config (its `method`) or of a method name; SFT for None (a config without one)."""
    name = which.get("method", "sft") if isinstance(which, dict) else (which or "sft")
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"method must be one of {', '.join(NAMES)} (got {name!r}).") from None


def from_metrics(logged) -> Method:
    """The method whose own figures a run logged most of (rewards/accuracies is DPO's, kl KTO's): what a run is
    when no config says so. SFT, which logs none of its own, when none match."""
    logged = set(logged)
    best = max(REGISTRY.values(), key=lambda m: len(logged & set(m.metrics)))
    return best if logged & set(best.metrics) else REGISTRY[NAMES[0]]


def chance_of(metric: str) -> float | None:
    """The reference line a method's chart draws under `metric` (a coin flip's 0.5 under a preference accuracy),
    None for a figure no chart marks."""
    for m in REGISTRY.values():
        for chart in m.charts:
            if chart.chance is not None and metric in {name for name, _ in (*chart.train, *chart.eval)}:
                return chart.chance
    return None


def all_metrics() -> tuple[str, ...]:
    """Every figure some method's trainer logs beyond the common ones (the log readers keep them all)."""
    return tuple(dict.fromkeys(name for m in REGISTRY.values() for name in m.metrics))


__all__ = [
    "NAMES",
    "REGISTRY",
    "Chart",
    "Method",
    "PlanTraits",
    "all_metrics",
    "chance_of",
    "from_metrics",
    "get",
]
