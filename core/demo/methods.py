"""The demo's run of each method that has one beyond SFT, as the Train page's "Use the demo's ..." button sets it
up: its run config on a start model, and how that model is had (the preference demos train on the demo base, or
the SFT run merged into it; GRPO on a warm start that a background job builds once: core.jobs kind
"warm_start")."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.demo import grpo
from core.demo.prefs import dpo_demo_config, kto_demo_config, preference_base


@dataclass(frozen=True)
class MethodDemo:
    config: Callable[[Path, Path], dict]  # (the demo folder, the start model) -> the run config
    start: Callable[[Path], Path | None]  # the model it trains on; None while it must be built first
    help: str
    build_job: str | None = None  # the core.jobs kind that builds the start model (None: it is always there)
    building: str = ""  # what the page says while that job runs


def _warm_start(folder: str | os.PathLike) -> Path | None:
    path = Path(folder) / grpo.WARM_FOLDER
    return path if (path / "config.json").is_file() else None


PREFERENCE_HELP = "on the demo model: prefer 'HELLO!' over 'HELLO' (a style its data never showed)"
DEMOS = {
    "dpo": MethodDemo(dpo_demo_config, preference_base, "DPO " + PREFERENCE_HELP),
    "kto": MethodDemo(kto_demo_config, preference_base, "KTO " + PREFERENCE_HELP),
    "grpo": MethodDemo(
        grpo.grpo_demo_config,
        _warm_start,
        "GRPO on the demo's uppercase prompts, rewarded by exact match with each prompt's answer, from a warm "
        "start (the demo run's first steps, merged: right about a quarter of the time)",
        build_job="warm_start",
        building="Building the GRPO demo's warm start (a few SFT steps on the demo model, merged) as a background "
        "job",
    ),
}
