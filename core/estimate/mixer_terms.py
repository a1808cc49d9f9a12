"""Each recurrent token mixer's terms, by the layer kind core.estimate.layer_kinds reads: how its facts are read
from the config, what its forward saves for backward, and what it holds beyond that at its forward and backward
peaks (per token). One row per kind; a kind without a row (or whose facts its reader cannot find in this family's
config) is planned as attention, with the planner's warning."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from core.estimate import gdn_terms, mamba_terms


class MixerTerms(NamedTuple):
    facts: Callable  # (text config dict) -> facts, or None where this family's config does not say them
    saved: Callable  # (LayerTerms, facts, kernel) -> None: adds the mixer's saved tensors
    forward_temporaries: Callable  # (LayerTerms, facts, kernel) -> per-token bytes
    backward_temporaries: Callable
    kernels: tuple[
        str, ...
    ]  # what its CUDA kernel path needs importable (transformers takes it when they import)


MIXERS: dict[str, MixerTerms] = {
    "gated_deltanet": MixerTerms(
        gdn_terms.gdn_facts,
        gdn_terms.gdn_mixer_saved,
        gdn_terms.gdn_forward_temporaries,
        gdn_terms.gdn_backward_temporaries,
        ("fla",),
    ),
    "mamba2": MixerTerms(
        mamba_terms.mamba_facts,
        mamba_terms.mamba_mixer_saved,
        mamba_terms.mamba_forward_temporaries,
        mamba_terms.mamba_backward_temporaries,
        ("mamba_ssm", "causal_conv1d"),
    ),
    "short_conv": MixerTerms(
        mamba_terms.short_conv_facts,
        mamba_terms.short_conv_mixer_saved,
        mamba_terms.short_conv_forward_temporaries,
        mamba_terms.short_conv_backward_temporaries,
        ("causal_conv1d",),
    ),
}
