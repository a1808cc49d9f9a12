"""A model as a list of layers, each planned as itself: which token mixers a decoder layer runs (softmax attention,
Gated DeltaNet, Mamba-2, a short convolution; Falcon-H1 runs attention and Mamba-2 side by side) and which
feed-forward block follows (a dense MLP, a mixture of experts, or none: Nemotron-H's blocks are one of each), read
from the real module tree of the meta model; and the saved tensors of a layer of each kind.

Hybrids interleave kinds (Qwen3.5: three Gated DeltaNet layers to one of attention), so the bill sums the layers
rather than multiplying one layer by their number. A recurrent mixer's memory depends on the path that runs it:
transformers' torch implementation, or the kernels of flash-linear-attention (Gated DeltaNet) and mamba-ssm +
causal-conv1d (Mamba-2) when they are installed on a CUDA machine (`kernel_path`). The saved tensors of each kind
are core.estimate.activation_terms' (attention, the MLP) and mixer_terms' rows (a recurrent kind is modelled when it
has one); this module only reads the layers (the specs that record the kinds import it, so it imports neither them
nor anything that does)."""

from __future__ import annotations

import json
from functools import lru_cache

from core import machine
from core.estimate.mixer_terms import MIXERS

ATTENTION = "attention"
UNREAD = "unread_mixer"  # a token mixer the module tree shows but this reading does not name (planned as attention)
# class-name endings of the mixer modules transformers 5 builds (a direct child of the decoder layer)
_MIXER_CLASSES = (
    ("GatedDeltaNet", "gated_deltanet"),  # Qwen3.5, Qwen3-Next, OLMo-hybrid
    ("Mamba2Mixer", "mamba2"),  # Mamba-2, Nemotron-H
    ("Zamba2MambaMixer", "mamba2"),  # before Mamba-1's ending, which its name ends with too
    ("BambaMixer", "mamba2"),
    ("MambaLayer", "mamba2"),  # Granite 4.0-H (GraniteMoeHybridMambaLayer)
    ("FalconH1Mixer", "mamba2"),
    ("MambaMixer", "mamba"),  # Mamba-1: Mamba, FalconMamba, Jamba, Zamba
    ("ShortConv", "short_conv"),  # LFM2
    ("DeltaAttention", "kda"),  # Kimi Delta Attention: Kimi Linear, Bailing hybrid (Ling 2.5)
    ("LightningAttention", "lightning_attention"),  # MiniMax
    ("RecurrentBlock", "rg_lru"),  # RecurrentGemma's conv + RG-LRU block
    ("RwkvSelfAttention", "rwkv"),  # RWKV's time mix (named attention, a recurrence)
    ("RwkvFeedForward", "rwkv_channel_mix"),  # its channel mix: shifts in the previous token too, no SwiGLU
    ("xLSTMLayer", "mlstm"),  # xLSTM's mLSTM layer (transformers' own code)
    ("mLSTMLayer", "mlstm"),  # the same layer from the xlstm package, which transformers takes when installed
)


def _blocks(module):
    """A layer's direct children, a nested decoder layer read through: Zamba's and Zamba2's hybrid layers run the
    shared transformer block (attention + MLP, its weights shared by every layer applying it) and then a Mamba
    layer, each a *DecoderLayer of its own."""
    for child in module.children():
        if type(child).__name__.endswith("DecoderLayer"):
            yield from _blocks(child)
        else:
            yield child


def layer_kind(layer, experts_path: str = "") -> tuple[tuple[str, ...], str]:
    """(the mixers, the feed-forward block) of one decoder layer, from its direct children's classes (`_blocks`); a
    MoE model's layer holding its experts (`experts_path`, core.estimate.moe's) has a "moe" block."""
    mixers, ffn, unread = [], "none", False
    moe = bool(experts_path) and any(name == experts_path for name, _ in layer.named_modules())
    for child in _blocks(layer):
        name = type(child).__name__
        kind = next((k for end, k in _MIXER_CLASSES if name.endswith(end)), None)
        if kind is None and "Attention" in name:
            kind = ATTENTION
        if kind:
            mixers.append(kind)
        elif ffn == "none" and any(w in name.lower() for w in ("mlp", "moe", "sparse", "feedforward")):
            ffn = "moe" if moe else "mlp"
        elif any(hasattr(m, "in_features") for m in child.modules()):  # it holds a Linear
            unread = True
    if unread and not mixers and ffn != "none":
        # a block beside its feed-forward holds projections of a kind this reading does not know (xLSTM's mLSTM
        # before it was read): an unmodelled mixer, which the plan warns about, not an MLP-only layer (Nemotron-H)
        mixers.append(UNREAD)
    if not mixers and ffn == "none":  # a layer this reading does not know: planned as the usual one
        return (ATTENTION,), "mlp"
    return tuple(sorted(mixers)), ffn


def layers_json(layers, experts_path: str = "") -> str:
    """The spec's record of every layer's kind: [[mixers...], ffn] per layer, in order."""
    return json.dumps([[list(m), f] for m, f in (layer_kind(layer, experts_path) for layer in layers)])


@lru_cache(maxsize=64)
def _parse(text: str) -> tuple[tuple[tuple[str, ...], str], ...]:
    return tuple((tuple(m), f) for m, f in json.loads(text))


def kinds_of(spec) -> tuple[tuple[tuple[str, ...], str], ...]:
    """Every layer's (mixers, ffn); a spec recorded before layers were read: every layer attention + MLP."""
    if spec.layers_json:
        return _parse(spec.layers_json)
    return (((ATTENTION,), "mlp"),) * spec.num_layers


def attention_layers(spec) -> int:
    return sum(1 for mixers, _ in kinds_of(spec) if ATTENTION in mixers)


def unmodelled_recurrent_layers(spec) -> int:
    """Layers whose token mixer is a recurrence this planner does not model (planned as attention)."""
    return sum(1 for mixers, _ in kinds_of(spec) if any(m != ATTENTION and m not in MIXERS for m in mixers))


def text_config(spec) -> dict:
    config = json.loads(spec.config_json)
    return config.get("text_config") or config


def kernel_path(plan, kind: str) -> bool:
    """Does `kind` run its CUDA kernels (True) or transformers' torch implementation (False) under `plan`?
    plan.recurrent_kernels 'kernels' / 'torch' is the target machine's choice; 'auto' asks this machine: the
    kernels run only on a CUDA device with their packages importable."""
    if (
        plan.device != "cuda"
        or plan.recurrent_kernels == "torch"
        or not (kind in MIXERS and MIXERS[kind].kernels)
    ):
        return False  # (a kind without kernels, RWKV's channel mix or RG-LRU, has only its torch code)
    if plan.recurrent_kernels == "kernels":
        return True
    return all(machine.importable(p) for p in MIXERS[kind].kernels) if kind in MIXERS else False


def kernel_note(spec, plan) -> str:
    """One sentence: which path the plan assumed for the model's recurrent layers, and why ("" for none)."""
    kinds = sorted({m for mixers, _ in kinds_of(spec) for m in mixers if m in MIXERS and MIXERS[m].kernels})
    if not kinds:
        return ""
    parts = []
    for kind in kinds:
        on = kernel_path(plan, kind)
        packages = " + ".join(MIXERS[kind].kernels)
        if plan.recurrent_kernels == "auto" and plan.device == "cuda":
            why = f"{packages} {'importable' if on else 'not installed'} here"
        elif plan.device != "cuda":
            why = "the kernels run on CUDA only"
        else:
            why = f"recurrent_kernels {plan.recurrent_kernels}"
        parts.append(f"{kind.replace('_', ' ')} on {'its CUDA kernels' if on else 'the torch path'} ({why})")
    return "Recurrent layers planned: " + "; ".join(parts) + "."


@lru_cache(maxsize=64)
def mlp_linear_names(linears, hidden: int) -> tuple[str, ...]:
    """The dense MLP's Linear leaf names among a model's decoder Linears (LinearShapes): the group under one
    module that reads the hidden state, and the one that writes it back; Llama's names when none is found."""
    groups: dict[str, list] = {}
    for s in linears:
        if not s.experts:
            groups.setdefault(s.name.rsplit(".", 1)[0].split(".")[-1], []).append(s)
    for parent, group in groups.items():
        # a mixer's Linears (Jamba's .mamba: in_proj reads the hidden state, out_proj writes it) are not the MLP
        if any(w in parent for w in ("attn", "attention", "mixer", "mamba", "conv", "experts")):
            continue
        down = [s for s in group if s.out_features == hidden and s.in_features != hidden]
        into = sorted(
            {s.name.rsplit(".", 1)[-1] for s in group if s.in_features == hidden} - {"router", "gate"}
        )
        if len(down) >= 1 and 1 <= len(into) <= 2:
            names = sorted(into, key=lambda n: ("up" in n or n == "w3", n))  # the gate first
            return (*names, down[0].name.rsplit(".", 1)[-1])
    return ("gate_proj", "up_proj", "down_proj")
