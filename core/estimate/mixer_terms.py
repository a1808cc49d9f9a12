"""Each recurrent token mixer's terms, by the layer kind core.estimate.layer_kinds reads: how its facts are read
from the config, what its forward saves for backward, and what it holds beyond that at its forward and backward
peaks (per token). One row per kind; a kind without a row (or whose facts its reader cannot find in this family's
config) is planned as attention, with the planner's warning."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from core.estimate import (
    gdn_terms,
    kda_terms,
    lightning_terms,
    mamba1_terms,
    mamba_terms,
    mlstm_terms,
    rg_lru_terms,
    rwkv_terms,
)


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
    "mamba": MixerTerms(
        mamba1_terms.mamba1_facts,
        mamba1_terms.mamba1_mixer_saved,
        mamba1_terms.mamba1_forward_temporaries,
        mamba1_terms.mamba1_backward_temporaries,
        ("mamba_ssm", "causal_conv1d"),
    ),
    "short_conv": MixerTerms(
        mamba_terms.short_conv_facts,
        mamba_terms.short_conv_mixer_saved,
        mamba_terms.short_conv_forward_temporaries,
        mamba_terms.short_conv_backward_temporaries,
        ("causal_conv1d",),
    ),
    "kda": MixerTerms(
        kda_terms.kda_facts,
        kda_terms.kda_mixer_saved,
        kda_terms.kda_forward_temporaries,
        kda_terms.kda_backward_temporaries,
        ("fla",),
    ),
    "rwkv": MixerTerms(  # its CUDA kernel is compiled at model construction when ninja is there
        rwkv_terms.rwkv_facts,
        rwkv_terms.rwkv_mixer_saved,
        rwkv_terms.rwkv_forward_temporaries,
        rwkv_terms.rwkv_backward_temporaries,
        ("ninja",),
    ),
    "rwkv_channel_mix": MixerTerms(
        rwkv_terms.rwkv_facts,
        rwkv_terms.channel_mix_saved,
        rwkv_terms.channel_mix_forward_temporaries,
        rwkv_terms.channel_mix_backward_temporaries,
        (),
    ),
    "mlstm": MixerTerms(  # transformers' native code (the xlstm package's Triton kernels: not modelled)
        mlstm_terms.mlstm_facts,
        mlstm_terms.mlstm_mixer_saved,
        mlstm_terms.mlstm_forward_temporaries,
        mlstm_terms.mlstm_backward_temporaries,
        (),
    ),
    "lightning_attention": MixerTerms(  # MiniMax: one torch path, no kernel package
        lightning_terms.lightning_facts,
        lightning_terms.lightning_mixer_saved,
        lightning_terms.lightning_forward_temporaries,
        lightning_terms.lightning_backward_temporaries,
        (),
    ),
    "rg_lru": MixerTerms(  # RecurrentGemma: one torch path, no kernel package
        rg_lru_terms.rg_lru_facts,
        rg_lru_terms.rg_lru_mixer_saved,
        rg_lru_terms.rg_lru_forward_temporaries,
        rg_lru_terms.rg_lru_backward_temporaries,
        (),
    ),
}
