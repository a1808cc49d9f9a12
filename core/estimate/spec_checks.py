"""What a plan meets in its model, said before the bill: a sequence past the model's positions, a recurrence not
modelled yet, what all-linear leaves out, the path the recurrent layers were planned on, a LoRA rank wider than
the layers it adapts."""

from __future__ import annotations

import json

from core.estimate.activation_terms import mixer_facts
from core.estimate.layer_kinds import (
    kernel_note,
    kinds_of,
    unmodelled_recurrent_layers,
)
from core.estimate.mixer_terms import MIXERS
from core.estimate.plan import Plan, PlanError
from core.estimate.specs import ModelSpec


def check_against_spec(spec: ModelSpec, plan: Plan, targets) -> list[str]:
    warnings = []
    if spec.max_position_embeddings and plan.seq_len > spec.max_position_embeddings:
        warnings.append(
            f"seq_len {plan.seq_len} is longer than the model's max_position_embeddings "
            f"({spec.max_position_embeddings}); quality degrades beyond it unless you extend RoPE."
        )
    if plan.tuning != "full" and plan.target_modules.strip() == "all-linear" and spec.all_linear_notes:
        warnings += json.loads(
            spec.all_linear_notes
        )  # what all-linear leaves out here (a router, Mamba's out_proj)
    note = kernel_note(spec, plan)
    if note:
        warnings.append(note)
    unmodelled = unmodelled_recurrent_layers(
        spec
    ) + sum(  # a modelled kind whose family's config it cannot read
        1 for mixers, _ in kinds_of(spec) if any(m in MIXERS and not mixer_facts(spec, m) for m in mixers)
    )
    if unmodelled:
        warnings.append(
            f"{unmodelled} of this model's {spec.num_layers} layers mix tokens by a recurrence this planner does "
            "not model yet (Mamba-1, lightning or kimi delta attention, RG-LRU) and counts as attention layers: "
            "their activations are larger, so the peak can be well above this estimate without gradient "
            "checkpointing. Keep gradient checkpointing on and run the smoke test, which measures the real peak."
        )
    # a router's weight (a wrapped 2-D parameter) and a one-output gate (Qwen2-MoE's shared_expert_gate) score
    # few values: peft adapts them at any rank
    layers = [s for s in targets if s.experts != 1 and s.out_features > 1]
    if plan.tuning != "full" and layers:
        # a typo (r 4096 for a 64-wide model): no layer can use it
        widest = max(layers, key=lambda s: min(s.in_features, s.out_features))
        if plan.lora_r > min(widest.in_features, widest.out_features):
            raise PlanError(
                f"LoRA rank {plan.lora_r} is larger than every layer it adapts (the widest, {widest.name}, is "
                f"{widest.in_features} -> {widest.out_features}); use r <= "
                f"{min(widest.in_features, widest.out_features)}."
            )
        # peft trains a rank above a narrow layer's width (Qwen3.5's and Qwen3-Next's in_proj_a/b, hidden -> a few
        # heads, under all-linear): that adapter is simply full rank, its extra rows spend memory for nothing
        narrow = [s for s in layers if plan.lora_r > min(s.in_features, s.out_features)]
        if narrow:
            smallest = min(narrow, key=lambda s: min(s.in_features, s.out_features))
            warnings.append(
                f"LoRA rank {plan.lora_r} is larger than {len(narrow)} of the {len(layers)} layers it adapts (the "
                f"narrowest, {smallest.name}, is {smallest.in_features} -> {smallest.out_features}): their "
                "adapters are full rank at any r above that width, so the extra rank there costs memory and adds "
                "nothing; leave them out of lora.target_modules to spend it elsewhere."
            )
    return warnings
