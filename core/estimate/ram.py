"""A run on a CPU, against the machine's RAM: what the process will hold, not only its tensors.

The planner counts tensor bytes (weights, gradients, optimizer states, activations): on a card that is what decides
an out-of-memory. A CPU run's process also holds Python, torch and the training libraries' code and heaps, which
dwarf a small model's tensors (the demo: 65 MiB of tensors, 0.6 GiB resident), so a CPU plan is said as the
process's expected footprint against the RAM free, and the Monitor draws the same figure over the process's RSS.
"""

from __future__ import annotations

from dataclasses import dataclass

from core import machine
from core.estimate.plan import FIT_LIMIT

MiB = 2**20
# The training process before its first tensor: Python with torch, transformers, peft, trl and datasets imported
# (measured: 532 MiB resident on Linux with torch's CPU build), less what it shares with the model it then loads.
RUNTIME_BYTES = 512 * MiB


def process_bytes(tensor_peak_bytes: float) -> int:
    """What a CPU run's process is expected to hold at its peak: the plan's tensors and the runtime."""
    return int(tensor_peak_bytes) + RUNTIME_BYTES


@dataclass(frozen=True)
class RamPlan:
    tensors: int  # the plan's tensor peak
    process: int  # tensors + RUNTIME_BYTES
    free: int  # RAM available now (what the process can get)
    total: int  # RAM of the machine

    @property
    def fraction(self) -> float:
        return self.process / self.free if self.free else float("inf")

    @property
    def verdict(self) -> str:
        """As the planner says it for a card, against the RAM free now."""
        if self.fraction <= FIT_LIMIT:
            return "fits"
        return "tight" if self.fraction <= 1 else "does not fit"


def ram_plan(tensor_peak_bytes: float, free: int | None = None, total: int | None = None) -> RamPlan:
    """The RAM bill of a CPU run whose plan peaks at `tensor_peak_bytes`; this machine's RAM unless given."""
    if free is None or total is None:
        here_total, here_free = machine.ram()
        free, total = here_free if free is None else free, here_total if total is None else total
    return RamPlan(int(tensor_peak_bytes), process_bytes(tensor_peak_bytes), int(free), int(total))
