"""The GPUs people fine-tune on, by name, with the memory each really has: the one table the Estimate page's GPU
list and `python -m core.estimate --gpu-gb`'s help read.

Memory is what nvidia-smi reports as memory.total (MiB), not the box's "GB": an RTX 4090 "24 GB" has 24,564 MiB
(23.99 GiB), an L40S "48 GB" 46,068 MiB with ECC on (44.99 GiB). The planner judges a plan against that.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class Card:
    name: str  # as the user knows it: "RTX 4090"
    sold_as_gb: int  # the size on the box
    mib: int  # nvidia-smi memory.total

    @property
    def gib(self) -> float:
        return self.mib * MiB / GiB

    @property
    def label(self) -> str:
        """'RTX 4090 · 24 GB (23.99 GiB)': the name and box size the user looks for, the memory the plan uses."""
        return f"{self.name} · {self.sold_as_gb} GB ({self.gib:.2f} GiB)"


# Smallest first. Sizes from nvidia-smi on the real cards (ECC on where the card has it).
CARDS = (
    Card("RTX 3060", 12, 12288),
    Card("RTX 4060 Ti", 16, 16380),
    Card("RTX 4080 / 4080 SUPER", 16, 16376),
    Card("RTX 3090", 24, 24576),
    Card("RTX 4090", 24, 24564),
    Card("L4", 24, 23034),
    Card("RTX 5090", 32, 32607),
    Card("A100 40GB", 40, 40960),
    Card("L40S / L40", 48, 46068),
    Card("RTX A6000 / RTX 6000 Ada", 48, 49140),
    Card("A100 80GB", 80, 81920),
    Card("H100 80GB", 80, 81559),
    Card("H200", 141, 143771),
)
DEFAULT = "RTX 4090"  # the card most users of a single-GPU fine-tune own


def by_label() -> dict[str, float]:
    """label -> GiB, in the table's order."""
    return {c.label: c.gib for c in CARDS}


def default_label() -> str:
    return next(c.label for c in CARDS if c.name == DEFAULT)


def help_line() -> str:
    """The cards and their GiB in one line, for a CLI's help."""
    return ", ".join(f"{c.name} {c.gib:.2f}" for c in CARDS)
