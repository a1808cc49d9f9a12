"""Model families whose step this planner does not count yet, each refused in one sentence that says what it does
not model and why, read from the meta model core.estimate.specs builds (never from the model's name alone): a plan
that leaves out a term growing with the square of the sequence would be far below the measured peak.

- Several transformer stacks of their own widths and no hidden_size of their own (BLT, transformers 5.25
  models/blt: a byte-level local encoder and decoder around a global transformer over patches that its entropy
  model cuts from the data, so even the global stack's length is the data's): this planner plans one stack of
  decoder layers sharing a width.
- An attention that masks every query-key pair per head with a mask computed from the layer's values (Doge,
  models/doge DogeAttention.prepare_dynamic_mask: batch x heads x seq x seq, in the graph, passed to sdpa as a
  float mask): a tiny Doge twin (2 layers, hidden 64, 300 tokens, LoRA all-linear, no checkpointing) measured
  2.85x its plan on the CPU, sdpa's math path keeping the fp32 probabilities per layer.
- An attention that adds a learned relative-position bias per head over every query-key pair (Inkling, models/
  inkling InklingRelativeLogits: batch x heads x seq x seq, passed to sdpa as a float mask), with fp32 short
  convolutions on its keys and values and around the attention and the MLP, and a router that scores its shared
  experts too (InklingTopkRouter: routed + shared logits).
"""

from __future__ import annotations


def unplanned_sentence(model_type: str, config: dict, layer) -> str:
    """One sentence when this planner cannot count `model_type`'s step (`config`: its config.json as a dict,
    `layer`: its first decoder layer on the meta device); "" when it can."""
    stacks = [k for k, v in config.items() if isinstance(v, dict) and "hidden_size" in v]
    if "hidden_size" not in config and "text_config" not in config and len(stacks) > 1:
        widths = ", ".join(f"{k} {config[k]['hidden_size']}" for k in stacks)
        if "patcher_config" in stacks:  # BLT
            widths += (
                ": a byte-level encoder and decoder around a global transformer over patches its entropy model "
                "cuts from the data"
            )
        return (
            f"{model_type}: the model runs several transformer stacks of their own widths ({widths}) and has no one "
            "hidden size; this planner plans one stack of decoder layers sharing a width, so it cannot plan this "
            "model."
        )
    for mod in layer.modules():
        name = type(mod).__name__
        if hasattr(mod, "prepare_dynamic_mask"):
            return (
                f"{model_type}: its attention ({name}) masks every query-key pair of every head with a mask "
                "computed from the layer's values (batch x heads x sequence x sequence, trained through the "
                "attention), which this planner does not count yet: a tiny twin measured 2.85x its plan, so it "
                "refuses rather than plan it that low."
            )
        if name.endswith("RelativeLogits"):
            return (
                f"{model_type}: its attention adds a learned relative-position bias per head over every query-key "
                f"pair ({name}: batch x heads x sequence x sequence, trained through the attention), runs fp32 "
                "short convolutions on its keys and values and around each block, and its router weighs shared "
                "experts too; this planner does not count those yet, so it cannot plan this model."
            )
    return ""
