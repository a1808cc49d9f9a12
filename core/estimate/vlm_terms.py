"""The bill's vision-language terms: the images' pixels, the vision tower's activations, the image tokens in the
language model's sequence -- from the code of transformers 5.24 (each family's vision tower and processor), peft
0.21 and trl 1.16 (SFTTrainer), measured against real steps of tiny models (tests/test_vlm.py,
benchmarks/vlm_accuracy.py).

What a step of a VLM holds beyond its language model's terms:
- the vision tower's and projector's weights (in the spec's parameters; in the load dtype under QLoRA too: the
  engine keeps them out of bitsandbytes) and, trained, their gradients and optimizer states;
- the batch's pixels (pixel_values: every patch, or every tile, in the load dtype), alive for the whole step;
- the image tokens: they sit in the language model's sequence, so the max_length bound (TRL truncates the
  processed ids, placeholders included) holds them: the language model's terms do not change, the text gets what
  is left of seq_len;
- the vision tower's activations. A frozen tower keeps none by itself (its input, the pixels, needs no grad), but
  SFTTrainer turns on enable_input_require_grads for LoRA with gradient checkpointing, and transformers hooks the
  input embeddings of every PreTrainedModel in the tree -- the vision tower's patch embedding too: the frozen tower
  then runs with grad and, checkpointed like the decoder, keeps each block's input until backward reaches it (the
  very end of backward), recomputing one block there. A trained tower (LoRA on it, or a full fine-tune) keeps its
  block inputs with checkpointing, every block's saved tensors without.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.estimate.activation_terms import checkpointing_on, step_dtypes
from core.estimate.plan import DTYPE_BYTES, Plan
from core.estimate.static_terms import adapter_bytes
from core.estimate.vlm import ImageTokens, VlmFacts, image_tokens, vlm_of


@dataclass(frozen=True)
class VisionTerms:
    images: int  # images in the batch
    per_image: ImageTokens
    pixels: int  # pixel_values (and Idefics3's pixel mask) bytes, alive for the whole step
    saved: int  # the vision tower's activations kept until backward reaches it
    recompute: int  # one checkpointed vision block recomputed in backward (next to every gradient)
    grad: bool  # does the vision tower run with grad (keep a graph)?
    why: str


def vision_runs_with_grad(facts: VlmFacts, plan: Plan) -> tuple[bool, str]:
    """(whether the vision tower builds a graph, why) for this plan."""
    if not plan.vision_frozen:
        return (
            True,
            "the vision tower is trained (vision_frozen off): its activations are kept for its gradients",
        )
    if plan.tuning != "full" and checkpointing_on(plan) and facts.input_grads:
        return True, (
            "frozen, yet it runs with grad: SFTTrainer's enable_input_require_grads (LoRA with gradient "
            "checkpointing) hooks the vision tower's patch embedding too, so its checkpointed blocks keep their "
            "inputs until the end of backward"
        )
    return False, "frozen and fed pixels that need no grad: it keeps no activations"


def pixel_bytes(facts: VlmFacts, tokens: ImageTokens, plan: Plan) -> int:
    """One image's pixel_values as its processor returns them (cast to the load dtype by the collator's model)."""
    d = DTYPE_BYTES[plan.load_dtype]
    if tokens.values:  # the rules of core.estimate.vlm_rules count them
        return tokens.values * d
    if facts.rule == "qwen":  # one row per patch: channels x temporal patch (2) x patch x patch
        return tokens.patches * 3 * 2 * facts.patch_size**2 * d
    side = facts.image_size
    b = tokens.units * 3 * side * side * d
    if facts.rule == "tiles":
        b += tokens.units * side * side * 8  # pixel_attention_mask: int64, as the processor returns it
    return b


def _block_saved(facts: VlmFacts, plan: Plan) -> float:
    """Per patch: what one vision block saves for backward besides its Linears' inputs, when it is not checkpointed
    (measured per op on tiny Qwen2.5-VL and Idefics3 towers): the norms (RMSNorm: its fp32 upcast and rstd;
    LayerNorm: its input, mean and rstd), the attention's q, k, v (Qwen-VL: the fused qkv output and the rotated q
    and k), sdpa's output and log-sum-exp, and the MLP's hidden (SwiGLU: gate, up and the activation; else fc1's
    output)."""
    d = step_dtypes(plan)
    h, inter = facts.vision_hidden, facts.vision_intermediate
    norms = 2 * ((h * 4 + 4) if facts.vision_rms else (h * d.hidden + 2 * d.hidden))
    qkv = 5 * h * d.proj if facts.vision_fused_qkv else 3 * h * d.proj
    attention = h * d.proj + facts.vision_heads * 4
    mlp = (3 if facts.vision_gated else 1) * inter * d.proj
    return norms + qkv + attention + mlp


def _outside_blocks(facts: VlmFacts, plan: Plan) -> float:
    """Per patch: what the tower keeps outside its blocks until backward reaches it (measured per op). Qwen-VL: the
    patch embedding's output, the rotary cos and sin (fp32, the checkpointed blocks' inputs), the merger's norm
    (RMSNorm: its fp32 upcast) and its first Linear's output (for the GELU's backward), and Qwen3-VL's deepstack
    mergers alike. The others: the final norm's (or the projector's) input."""
    d = step_dtypes(plan)
    h = facts.vision_hidden
    if facts.rule != "qwen":
        return h * d.hidden
    norm = h * 4 if facts.vision_rms else h * d.hidden
    rotary = 2 * (h // max(facts.vision_heads, 1)) * 4
    # Qwen3-VL's deepstack mergers: each one's norm input and first Linear's output, as wide as the patches
    return norm + 2 * h * d.hidden + rotary + facts.vision_deepstack * 2 * h * d.hidden


def _linear_inputs(facts: VlmFacts, plan: Plan) -> float:
    """Per patch: a fully trained block's Linears keep their inputs (the q/k/v, out, and MLP projections)."""
    d = step_dtypes(plan)
    h, inter = facts.vision_hidden, facts.vision_intermediate
    ins = (2 if facts.vision_fused_qkv else 4) * h + (2 * h + inter if facts.vision_gated else h + inter)
    return ins * d.proj


# Linears of one block that read the same input tensor (the attention's, the MLP's)
SHARED_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}


def _adapter_saved(facts: VlmFacts, plan: Plan, targets, patches: int, tokens: int) -> tuple[int, int]:
    """(in the projector, in the vision blocks) what peft's LoRA on the vision side saves: each adapted Linear's
    input cast to the adapter's dtype (fp32 adapters over a 16-bit base: a copy lora_A keeps; adapters in the load
    dtype keep the input itself, which a frozen Linear alone would not) and lora_A's output (lora_B keeps it). The projector runs on the merged image tokens, the blocks on every patch."""
    ad, load = adapter_bytes(plan), DTYPE_BYTES[plan.load_dtype]
    projector = blocks = 0
    seen = set()
    for s in targets:
        parent, _, leaf = s.name.rpartition(".")
        if ad != load:
            copy = s.in_features * ad
        else:  # no copy: lora_A keeps the input itself, once for the Linears that read the same tensor
            key = (parent.rpartition(".")[0], SHARED_INPUT[leaf]) if leaf in SHARED_INPUT else s.name
            copy = 0 if key in seen else s.in_features * ad
            seen.add(key)
        per_row = copy + plan.lora_r * ad
        if (
            facts.projector_path and s.name.startswith(facts.projector_path + ".")
        ) or ".deepstack_merger" in s.name:
            projector += tokens * per_row
        elif facts.vision_path and s.name.startswith(facts.vision_path + "."):
            blocks += patches * per_row
    return projector, blocks


def vision_terms(spec, plan: Plan, batch: int, targets=()) -> VisionTerms | None:
    """The vision terms of a step of `batch` rows (None for a language model); `targets`: peft's LoRA targets."""
    facts = vlm_of(spec)
    if facts is None:
        return None
    per = image_tokens(facts, plan)
    images = batch * plan.images_per_row
    grad, why = vision_runs_with_grad(facts, plan)
    d = step_dtypes(plan)
    patches = images * per.patches
    saved = recompute = 0
    if grad and images:
        projector, adapters = _adapter_saved(facts, plan, targets, patches, images * per.tokens)
        block = _block_saved(facts, plan) + (_linear_inputs(facts, plan) if plan.tuning == "full" else 0)
        layers = max(facts.vision_layers, 1)
        if checkpointing_on(plan):  # the block inputs; one block recomputed in backward
            saved = facts.vision_layers * patches * facts.vision_hidden * d.hidden
            recompute = int(patches * block) + adapters // layers
        else:
            saved = int(facts.vision_layers * patches * block) + adapters
        saved += int(patches * _outside_blocks(facts, plan)) + projector
    return VisionTerms(
        images=images,
        per_image=per,
        pixels=images * pixel_bytes(facts, per, plan),
        saved=int(saved),
        recompute=int(recompute),
        grad=grad,
        why=why,
    )


def check_images(spec, plan: Plan) -> list[str]:
    """A warning when one row's images alone are longer than seq_len: TRL truncates the placeholders, and the model
    then refuses the batch ("Image features and image tokens do not match"). The memory is still planned at the
    bound (the sequence the language model would see, the images the vision tower would)."""
    facts = vlm_of(spec)
    if facts is None or not plan.images_per_row:
        return []
    per = image_tokens(facts, plan)
    need = per.tokens * plan.images_per_row
    if need >= plan.seq_len:
        fix = (
            "lower max_pixels or the image size"
            if facts.rule in ("qwen", "glm")
            else "use fewer images per row"
        )
        return [
            f"{plan.images_per_row} image(s) of {plan.image_width}x{plan.image_height} take {need:,} tokens "
            f"({per.tokens:,} each), not less than seq_len {plan.seq_len}: TRL would truncate their placeholders and "
            f"the model refuse the batch; raise seq_len (max_length) or {fix}."
        ]
    return []


def with_images(order: tuple) -> tuple:
    """The bill's component order with a VLM's pixel_values ("images") beside the static terms."""
    at = order.index("optimizer_states") + 1
    return order[:at] + ("images",) + order[at:]


def vlm_record(facts: VlmFacts, v: VisionTerms, plan: Plan) -> dict:
    """The estimate's `vlm` record: the images, their tokens and where the numbers come from, the vision terms."""
    d = DTYPE_BYTES[plan.load_dtype]
    return {
        "family": facts.family,
        "image_size": f"{plan.image_width}x{plan.image_height}",
        "max_pixels": plan.max_pixels,
        "images_per_row": plan.images_per_row,
        "image_tokens_per_image": v.per_image.tokens,
        "image_tokens_per_row": v.per_image.tokens * plan.images_per_row,
        "text_tokens_per_row": max(0, plan.seq_len - v.per_image.tokens * plan.images_per_row),
        "vision_patches_per_image": v.per_image.patches,
        "tokens_source": v.per_image.source,
        "vision_params": facts.vision_params,
        "projector_params": facts.projector_params,
        "vision_weight_bytes": (facts.vision_params + facts.projector_params) * d,
        "vision_frozen": plan.vision_frozen,
        "vision_grad": v.grad,
        "vision_grad_reason": v.why,
        "pixel_bytes": v.pixels,
        "vision_activation_bytes": v.saved,
        "vision_recompute_bytes": v.recompute,
    }


def vlm_lines(est) -> list[str]:
    """What a terminal (and the Estimate page) says of a VLM estimate."""
    m = getattr(est, "vlm", None)
    if not m:
        return []
    from core.fmt import gib

    frozen = "frozen" if m["vision_frozen"] else "trained"
    return [
        f"vision-language model ({m['family']}): {m['images_per_row']} image(s) per row of {m['image_size']} px "
        f"-> {m['image_tokens_per_image']:,} image tokens each ({m['image_tokens_per_row']:,} of the row's "
        f"{m['image_tokens_per_row'] + m['text_tokens_per_row']:,}; {m['text_tokens_per_row']:,} left for text)",
        f"  image tokens from: {m['tokens_source']}",
        f"  vision tower {m['vision_params']:,} params + projector {m['projector_params']:,} "
        f"({gib(m['vision_weight_bytes'])} in the load dtype), {frozen}; pixels {gib(m['pixel_bytes'])}",
        f"  vision activations {gib(m['vision_activation_bytes'])}"
        + (
            f", one block recomputed {gib(m['vision_recompute_bytes'])}"
            if m["vision_recompute_bytes"]
            else ""
        )
        + f": {m['vision_grad_reason']}",
    ]
