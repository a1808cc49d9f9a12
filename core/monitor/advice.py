"""One health warning of a run: what is wrong, the figures that show it, and what to change (no UI). The rules
that make them live in core.monitor.health and core.monitor.health_rewards."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class HealthWarning:
    # stable id: stalled, low_utilization, memory_high, nonfinite_loss, loss_spike, loss_flat, plan_mismatch,
    # preference_chance_accuracy, preference_margin_flat, preference_chosen_collapse, reward_zero, reward_no_spread,
    # completions_clipped
    code: str
    level: str  # "error" | "warning" | "info"
    title: str
    detail: str  # the figures
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


def stall_warning(stall: str) -> HealthWarning:
    """A live run that stopped stepping (core.rundir.stall's sentence) as a health warning."""
    return HealthWarning(
        "stalled",
        "warning",
        "Stalled",
        stall,
        "Paused with Ctrl+Z or SIGSTOP? Continue it (`fg`, or `kill -CONT` its pid). Hung (a stuck collective, a "
        "dead network mount)? Stop ends it, saving a checkpoint if it can.",
    )
