"""One measured LoRA step of a tiny twin of issue #47's vision-language families (configs: core.demo.toy_vlm),
its batch made by the family's real image processor: what tests/test_vlm_families.py and benchmarks/vlm_accuracy.py
hold the planner's image tokens and tensor peak against."""

from __future__ import annotations

import json

from core.demo import toy_vlm
from core.estimate.plan import Plan
from core.estimate.vlm import image_tokens
from core.estimate.vlm_processor import folder_settings, pil_processor

# the tiny configs of issue #47's families (core.demo.toy_vlm: one place for the tiny VLM configs)
twin = toy_vlm.tiny_vlm_config


def random_image(width, height):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


LLAMA4_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,fc1,fc2,linear_1,linear_2"
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)
# the measured twins: a wide vision tower on a tiny language model (the vision terms a large share of the step)
MEASURED = {
    "mistral3": (448, 448),
    "internvl": (448, 448),
    "llava_next": (336, 336),
    "glm4v": (448, 448),
    "llava_onevision": (384, 384),
    "paligemma": (224, 224),
    "gemma4": (448, 448),
    "idefics2": (378, 378),
    "llama4": (672, 336),
}


def _measure(cfg, plan, facts, settings):
    """One LoRA step of the twin under the live-tensor tracker, its batch made by the family's real image
    processor (core.measure.vlm_step builds and steps the model as the engine trains it)."""
    import torch

    from core.measure.build import build_optimizer
    from core.measure.step import run_step
    from core.measure.step_plan import StepOptions, checked
    from core.measure.vlm_step import DTYPES, build_vlm

    plan = checked(plan)
    model = build_vlm(cfg, plan)
    if facts.rule == "chunks":  # Llama4ImageProcessor needs torchvision: random chunks of the planned count
        per = image_tokens(facts, plan)
        out = {"pixel_values": torch.randn(per.units, 3, facts.image_size, facts.image_size)}
    else:
        image = random_image(plan.image_width, plan.image_height)
        out = dict(pil_processor(facts, settings)(images=[image], return_tensors="pt"))
    n = image_tokens(facts, plan).placeholders
    ids = torch.randint(3, 100, (1, plan.seq_len), generator=torch.Generator().manual_seed(0))
    ids[:, :n] = facts.image_token
    labels = ids.clone()
    labels[ids == facts.image_token] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    batch["pixel_values"] = out["pixel_values"].to(DTYPES[plan.load_dtype])
    for key in ("image_sizes", "image_grid_thw", "pixel_attention_mask", "image_position_ids"):
        if key in out:
            batch[key] = out[key]
    # the image positions (1): GLM's 3-D rotary positions, PaliGemma's and Gemma 4's bidirectional image attention
    if facts.rule in ("glm", "soft"):
        batch["mm_token_type_ids"] = (ids == facts.image_token).long()
    if facts.rule == "square":
        batch["token_type_ids"] = (ids == facts.image_token).long()
    return run_step(
        model, build_optimizer(model, plan, StepOptions()), batch, plan, StepOptions()
    ).steady_peak_bytes


def wide_twin(family: str):
    """The twin with a vision tower 256 wide and 4 blocks deep on its 64-wide language model: the vision terms are
    a large share of the step."""
    cfg = twin(family)
    for key, value in WIDE.items():
        setattr(cfg.vision_config, key, value)
    if family == "glm4v":  # its tower names depth and num_heads
        cfg.vision_config.depth, cfg.vision_config.num_heads = 4, 4
    if family == "llama4":  # its pixel-shuffle MLP reads 4 x hidden (intermediate_size)
        cfg.vision_config.intermediate_size = 4 * WIDE["hidden_size"]
    if family == "gemma4":  # its tower names its K/V heads
        cfg.vision_config.num_key_value_heads = 4
    if family == "mistral3":  # Pixtral names its head width
        cfg.vision_config.head_dim = 64
    return cfg


def measured_plan(folder, family: str, checkpointing: bool, frozen: bool) -> Plan:
    """The plan of a measured step of `family`'s wide twin saved in `folder`."""
    w, h = MEASURED[family]
    return Plan(
        model=str(folder),
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        image_width=w,
        image_height=h,
        load_dtype="bf16",
        compute_dtype="bf16",
        autocast=False,
        device="cpu",
        seq_len=1536,
        gradient_checkpointing=checkpointing,
        vision_frozen=frozen,
        # Llama 4's router is a Linear LoRA cannot wrap: the engine's all-linear leaves it out, as these names do
        target_modules=LLAMA4_TARGETS if family == "llama4" else "all-linear",
        # TRL's fused LM head expects the inner model's last_hidden_state; Llama 4's inner language model is a
        # ...ForCausalLM (its output has none): unfused there
        fused_lm_head=family != "llama4",
    )


def measure_family(cfg, plan: Plan) -> int:
    """The steady tensor peak of one LoRA step of `plan` on the twin `cfg` (saved at plan.model)."""
    from core.estimate.specs import load_spec
    from core.estimate.vlm import vlm_of

    facts = vlm_of(load_spec(plan.model))
    settings = {**json.loads(facts.processor or "{}"), **folder_settings(plan.model)}
    return _measure(cfg, plan, facts, settings)


# a row the planner misses by more than 5%, and why (the test expects the miss; the benchmark prints it unjudged)
KNOWN_GAPS = {
    (
        "paligemma",
        False,
    ): "its prefix attention mask (token_type_ids) sends sdpa down a path that keeps more than "
    "the causal one the planner counts",
    (
        "llama4",
        True,
    ): "its vision blocks' recompute (complex fp32 rotary q/k) and pixel-shuffle adapter are not "
    "modelled yet",
}
