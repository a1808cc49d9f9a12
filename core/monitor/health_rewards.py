"""Health rules for a run that learns from reward functions scored on its own completions (GRPO), in the words its
method module gives (core.recipe.methods.base.RewardHealth):

- reward_zero: the reward (or one reward function) is 0 at every one of the last logged points, well into the
  run: it cannot be earned, which is a mis-mapped answer column or an extraction that never matches, far more often
  than a model that cannot learn;
- reward_no_spread: nearly every group's completions scored alike (frac_reward_zero_std ~ 1): their advantages
  are 0 and they teach nothing;
- completions_clipped: nearly every completion was cut at the length limit (clipped_ratio ~ 1): the rewards judge
  answers that were never finished.

Each judges only the last few logged points, so a run that recovers loses its warning.
"""

from __future__ import annotations

import numpy as np

from core.monitor.advice import HealthWarning
from core.monitor.tail import RunSeries
from core.recipe.methods.base import RewardHealth

ZERO = 1e-9  # a reward this close to 0 is 0 (float noise of a mean of zeros)


def reward_warnings(series: RunSeries, h: RewardHealth, settings) -> list[HealthWarning]:
    """The reward rules' warnings for `series` (settings: core.monitor.health.HealthSettings)."""
    # a reward that is 0 everywhere also has no spread: one cause, one warning
    all_zero = _zero_run(series, h.reward, settings) is not None
    spread = None if all_zero else _no_spread(series, h, settings)
    return [
        w for w in (_reward_zero(series, h, settings), spread, _clipped(series, h, settings)) if w is not None
    ]


def _finite(series: RunSeries, name: str) -> tuple[np.ndarray, np.ndarray]:
    steps, vals = series.metric(name)
    ok = np.isfinite(vals)
    return steps[ok], vals[ok]


def _zero_run(series: RunSeries, name: str, settings) -> tuple[int, int, int] | None:
    """(points, first step, last step) of the trailing run of zeros of `name`, when it is long and late enough."""
    steps, vals = _finite(series, name)
    if not vals.size or steps[-1] < settings.reward_zero_steps:
        return None
    nonzero = np.nonzero(np.abs(vals) > ZERO)[0]
    start = int(nonzero[-1]) + 1 if nonzero.size else 0
    n = vals.size - start
    if n < settings.reward_zero_points:
        return None
    return n, int(steps[start]), int(steps[-1])


def _reward_zero(series: RunSeries, h: RewardHealth, settings) -> HealthWarning | None:
    prefix, suffix = h.per_function
    functions = {
        name[len(prefix) : -len(suffix)]: name
        for name in series.family_names
        if name.startswith(prefix) and name.endswith(suffix)
    }
    dead = [f for f, name in functions.items() if _zero_run(series, name, settings)]
    total = _zero_run(series, h.reward, settings)
    if total is None and not dead:
        return None
    if total is not None:
        n, first, last = total
        title = "The reward has been 0 at every logged step: it cannot be earned"
        who = f"every reward function ({', '.join(functions)})" if functions else "the reward functions"
    else:
        n, first, last = next(r for f in dead if (r := _zero_run(series, functions[f], settings)))
        title = f"Reward function {', '.join(dead)} has been 0 at every logged step: it cannot be earned"
        who = ", ".join(dead)
    return HealthWarning(
        "reward_zero",
        "warning",
        title,
        f"{h.reward if total is not None else ', '.join(functions[f] for f in dead)} was 0 at each of the last {n} "
        f"logged points (steps {first}-{last}): no completion of any prompt scored anything from {who}, so there "
        "is nothing to learn from.",
        "Look at the sample completions below: when they hold the right answer, the reward does not read it. Check "
        "the reward's column (rewards[i].column: the rows' answer column) and extraction (rewards[i].extract: "
        "last_number, answer_tag, boxed or a regex) against what the completions say; preflight scores each row's "
        "own answer as a completion and must see 1. When the answers are wrong, start from a model that is right "
        "some of the time (an SFT'd one) or with easier prompts.",
    )


def _window(series: RunSeries, name: str, settings) -> tuple[np.ndarray, np.ndarray] | None:
    steps, vals = _finite(series, name)
    k = settings.reward_window
    if vals.size < k:
        return None
    return steps[-k:], vals[-k:]


def _no_spread(series: RunSeries, h: RewardHealth, settings) -> HealthWarning | None:
    got = _window(series, h.zero_spread, settings)
    if got is None or float(got[1].min()) < settings.reward_share:
        return None
    steps, share = got
    reward = _window(series, h.reward, settings)
    said = f"; the mean reward was {float(reward[1].mean()):.3g}" if reward is not None else ""
    return HealthWarning(
        "reward_no_spread",
        "warning",
        "No learning signal: every completion of a prompt scores the same",
        f"{h.zero_spread} was {float(share.mean()):.0%} over the last {share.size} logged points (steps "
        f"{int(steps[0])}-{int(steps[-1])}): in that share of groups all completions of the prompt got the same "
        f"reward, so their advantages are 0 and they teach nothing{said}.",
        f"Raise {h.spread_settings} so that a prompt's completions differ. If the reward is already at its best on "
        "every prompt, the run has learnt these prompts: stop it, or train on harder ones.",
    )


def _clipped(series: RunSeries, h: RewardHealth, settings) -> HealthWarning | None:
    got = _window(series, h.clipped, settings)
    if got is None or float(got[1].min()) < settings.reward_share:
        return None
    steps, share = got
    length = _window(series, h.mean_length, settings)
    said = f" (mean length {float(length[1].mean()):.0f} tokens)" if length is not None else ""
    return HealthWarning(
        "completions_clipped",
        "warning",
        "Completions are always cut at the length limit",
        f"{h.clipped} was {float(share.mean()):.0%} over the last {share.size} logged points (steps "
        f"{int(steps[0])}-{int(steps[-1])}){said}: almost no completion ended before {h.length_setting}, so the "
        "rewards judge answers that were never finished.",
        f"Raise {h.length_setting} (the memory plan grows with it: check the verdict before launching), or ask for "
        "shorter answers (the prompt, or a length reward).",
    )
