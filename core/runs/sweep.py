"""Sweeps: a run config with a `sweep:` section is a family of runs, one per point, queued by name.

    sweep:
      method: grid              # every combination (default), or random: `trials` points drawn with `seed`
      parameters:               # any run-config key by its path, with the values to try
        training.learning_rate: [1.0e-4, 3.0e-4]
        lora.r: [8, 16]
      trials: 8                 # random only; a parameter may then be {min, max, log: true} instead of a list
      seed: 0

Each point is the base config with its values set, validated like any run config; the queue plans each one and
queues those that fit (core.runs.queue_cli).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from typing import Any

from core.recipe.config import ConfigError, validate_config
from core.recipe.config_keys import TOP_LEVEL

MAX_POINTS = 256  # a sweep larger than this is a typo, not a plan for the night
KEYS = ("method", "parameters", "trials", "seed")


class SweepError(ValueError):
    """A sweep section that cannot be expanded; the message names the key."""


def split(raw: dict) -> tuple[dict, dict | None]:
    """(the run config without its sweep section, the sweep section or None)."""
    if not isinstance(raw, dict) or "sweep" not in raw:
        return raw, None
    base = {k: v for k, v in raw.items() if k != "sweep"}
    return base, raw["sweep"]


def points(sweep: Any) -> list[dict[str, Any]]:
    """The sweep's points: [{key path: value}], in a stable order."""
    if not isinstance(sweep, dict):
        raise SweepError("sweep must be a mapping with parameters: {key path: [values]}.")
    unknown = [k for k in sweep if k not in KEYS]
    if unknown:
        raise SweepError(f"sweep.{unknown[0]}: unknown key; a sweep has {', '.join(KEYS)}.")
    how = sweep.get("method", "grid")
    params = sweep.get("parameters")
    if how not in ("grid", "random"):
        raise SweepError(f"sweep.method must be grid or random (got {how!r}).")
    if not isinstance(params, dict) or not params:
        raise SweepError(
            "sweep.parameters must map run-config keys to values, e.g. {training.learning_rate: [1e-4, 3e-4]}."
        )
    for path, values in params.items():
        section = str(path).partition(".")[0]
        if "." not in str(path) or section not in TOP_LEVEL:
            raise SweepError(
                f"sweep.parameters.{path}: name a key by its path, e.g. training.learning_rate or lora.r."
            )
        if isinstance(values, list) and values:
            continue
        if how == "random" and isinstance(values, dict) and {"min", "max"} <= set(values):
            continue
        raise SweepError(
            f"sweep.parameters.{path} must be a non-empty list of values"
            + (" or {min, max, log}." if how == "random" else ".")
        )
    if how == "grid":
        if any(not isinstance(v, list) for v in params.values()):
            raise SweepError("a grid sweep takes a list of values per parameter.")
        out = [dict(zip(params, combo, strict=True)) for combo in itertools.product(*params.values())]
    else:
        trials = sweep.get("trials")
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
            raise SweepError("sweep.trials must be a whole number of points to draw (random sweeps).")
        rng = random.Random(sweep.get("seed", 0))
        out = [{path: _draw(rng, values) for path, values in params.items()} for _ in range(trials)]
    if len(out) > MAX_POINTS:
        raise SweepError(f"the sweep has {len(out)} points (at most {MAX_POINTS}): narrow its parameters.")
    return out


def _draw(rng: random.Random, values):
    if isinstance(values, list):
        return rng.choice(values)
    lo, hi = float(values["min"]), float(values["max"])
    if values.get("log"):
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return rng.uniform(lo, hi)


def apply(base: dict, point: dict[str, Any]) -> dict:
    """The base config with the point's values set, validated (ConfigError names the key)."""
    cfg = copy.deepcopy(base)
    for path, value in point.items():
        section, _, key = path.partition(".")
        if section == "method":
            cfg["method"] = value
            continue
        target = cfg.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: must be a mapping to sweep {path}.")
        target[key] = value
    return validate_config(cfg)


def enqueue(workspace, raw: dict, stem: str) -> list[dict]:
    """Queue a run config, or each point of its `sweep:` section, under `stem` (a sweep's points: stem-1, stem-2,
    ...): each validated, its model folder checked and planned for this machine; the points that do not fit are
    not queued. One dict per point: {"name", "point", "plan", "entry" (None when not queued)}. ConfigError /
    SweepError / QueueError for input that cannot be queued at all."""
    from core.estimate.from_config import plan_json
    from core.estimate.plan import PlanError
    from core.estimate.specs import SpecError
    from core.runs import queue as Q
    from core.train.preflight import check_model

    base, sweep = split(raw)
    chosen = points(sweep) if sweep is not None else [{}]
    out = []
    for i, point in enumerate(chosen, 1):
        cfg = apply(base, point)
        problem = check_model(cfg["model"]["path"])
        if problem:
            raise ConfigError(problem)
        try:
            plan = plan_json(cfg)
        except (PlanError, SpecError) as exc:
            raise ConfigError(str(exc)) from None
        name = f"{stem}-{i}" if sweep is not None else stem
        entry = None
        if plan.get("verdict") != "does not fit":
            entry = Q.add(workspace, cfg, name, plan, sweep={"id": stem, "values": point} if point else None)
        out.append({"name": name, "point": point, "plan": plan, "entry": entry})
    return out


def label(point: dict[str, Any]) -> str:
    """The point's values for a sentence: "learning_rate=0.0001, r=8"."""
    return ", ".join(f"{path.rpartition('.')[2]}={_short(v)}" for path, v in point.items())


def _short(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
