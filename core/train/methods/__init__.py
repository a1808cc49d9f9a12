"""The training methods, one module each: what differs between SFT, DPO and KTO lives there and nowhere else.

    from core.train import methods
    method = methods.get(cfg)          # the run config's method (or its name)
    train_ds, eval_ds = method.datasets(cfg, tokenizer)

Adding a method is one module with a `METHOD` plus a line here.
"""

from __future__ import annotations

from core.train.methods import dpo, kto, sft
from core.train.methods.base import Chart, Method, PlanTraits

REGISTRY: dict[str, Method] = {m.METHOD.name: m.METHOD for m in (sft, dpo, kto)}
NAMES = tuple(REGISTRY)


def get(which: str | dict | None) -> Method:
    """The Method of a run config (its `method`) or of a method name; SFT for None (a config without one)."""
    name = which.get("method", "sft") if isinstance(which, dict) else (which or "sft")
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"method must be one of {', '.join(NAMES)} (got {name!r}).") from None


def all_metrics() -> tuple[str, ...]:
    """Every figure some method's trainer logs beyond the common ones (the log readers keep them all)."""
    return tuple(dict.fromkeys(name for m in REGISTRY.values() for name in m.metrics))


__all__ = ["NAMES", "REGISTRY", "Chart", "Method", "PlanTraits", "all_metrics", "get"]
