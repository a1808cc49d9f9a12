"""What `all-linear` means on a given model: peft's own choice (every nn.Linear / Conv1D but the output head), less
the Linear layers peft cannot train there -- one rule for the planner (on the meta model) and the trainer (on the
loaded one), so the plan bills exactly the adapters the run makes.

Left out, from peft 0.21's and transformers 5's code:
- a model class's own Linear subclass whose forward does not return one tensor (Llama 4's router returns scores
  and indices, so peft's LoRA wrapper fails on the first forward: "'tuple' object has no attribute 'dtype'");
  one that returns a tensor (Falcon's FalconLinear, a matmul plus bias) is a Linear peft trains like any other;
- the projections peft refuses on Mamba-based families (tuners_utils._check_lora_target_modules_mamba: out_proj
  and conv1d on falcon_h1, mamba, mamba2, falcon_mamba, nemotron_h), which it would refuse outright.
"""

from __future__ import annotations

# peft 0.21 tuners/tuners_utils.py `_check_lora_target_modules_mamba`
PEFT_MAMBA_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")
PEFT_MAMBA_REFUSED = ("out_proj", "conv1d")


def _own_forward_linear(module) -> bool:
    """A transformers model's Linear subclass whose own forward does not return one tensor (a router returning
    scores and indices): asked of the module itself, one row through it (on the meta model, no compute)."""
    import torch
    import torch.nn as nn

    cls = type(module)
    if (
        cls is nn.Linear
        or not cls.__module__.startswith("transformers.models.")
        or cls.forward is nn.Linear.forward
    ):
        return False
    weight = module.weight
    try:
        with torch.no_grad():
            out = module(torch.zeros(1, module.in_features, device=weight.device, dtype=weight.dtype))
    except Exception:  # a forward that cannot run alone cannot run under LoRA's wrapper either
        return True
    return not isinstance(out, torch.Tensor)


def all_linear(model) -> tuple[str | list[str], list[str]]:
    """(target_modules for peft's LoraConfig: "all-linear" when peft's own choice trains on `model`, else the
    module names of that choice that it can train; one sentence per kind of layer left out)."""
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    names, routers, refused = [], set(), set()
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)) or module is head:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if _own_forward_linear(module):
            routers.add(f"{leaf} ({type(module).__name__})")
        elif model_type in PEFT_MAMBA_TYPES and leaf in PEFT_MAMBA_REFUSED:
            refused.add(leaf)
        else:
            names.append(name)
    notes = []
    if routers:
        notes.append(
            f"all-linear leaves out {', '.join(sorted(routers))}: a Linear with a forward of its own (a router) "
            "that LoRA cannot wrap."
        )
    if refused:
        notes.append(
            f"all-linear leaves out the Mamba mixers' {', '.join(sorted(refused))}: peft cannot put LoRA on them "
            f"in a {model_type} model."
        )
    return ("all-linear" if not notes else names), notes


def refused_targets(model_type: str, targets) -> str | None:
    """One sentence when explicit target_modules name a layer peft refuses on this family; else None."""
    if model_type not in PEFT_MAMBA_TYPES or isinstance(targets, str):
        return None
    bad = sorted({t for t in targets if t.rsplit(".", 1)[-1] in PEFT_MAMBA_REFUSED})
    if not bad:
        return None
    return (
        f"lora.target_modules names {', '.join(bad)}, which peft cannot put LoRA on in a {model_type} model (the "
        "Mamba mixer's out_proj and conv1d); leave them out, or use all-linear, which leaves them out itself."
    )
