"""One measured training step of a vision-language model, next to the planner (core.estimate.vlm_terms).

The model is built from a config as the engine trains it (transformers' image-text-to-text class, bf16 weights,
peft LoRA -- on the language model only when the plan keeps the vision tower frozen -- gradient checkpointing with
the input gradients SFTTrainer turns on, TRL's fused LM head), and the batch is what the family's real image
processor makes of random images of the plan's size (pixel values, grids, tiles) with the image placeholder tokens
the processor would put in the text. The step runs under the live-tensor tracker (core.measure.step.run_step).
"""

from __future__ import annotations

import warnings

import torch

from core.estimate.plan import Plan
from core.estimate.specs import VISION_EXCLUDE
from core.estimate.vlm import QWEN3_PROCESSOR, VISION_MODULES, image_processor_kwargs, vlm_facts_for_config
from core.measure.build import TRL_FUSED_OUTPUTS, build_optimizer
from core.measure.step import run_step
from core.measure.step_plan import StepOptions, checked
from core.tracker import StepMemory

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_vlm(config, plan: Plan):
    """The model a VLM run of `plan` trains (random weights: a step's memory does not depend on their values)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(config, attn_implementation=plan.attn)
    model = model.to(DTYPES[plan.load_dtype])
    model.config.use_cache = False
    if plan.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if plan.tuning == "lora":
        exclude = VISION_EXCLUDE if plan.vision_frozen else None
        lora = LoraConfig(
            r=plan.lora_r,
            lora_alpha=plan.lora_alpha,
            lora_dropout=plan.lora_dropout,
            target_modules=plan.target_modules
            if plan.target_modules == "all-linear"
            else plan.target_modules.split(","),
            exclude_modules=exclude,
        )
        model = get_peft_model(model, lora)
        if plan.gradient_checkpointing:  # SFTTrainer.__init__: peft + checkpointing
            model.enable_input_require_grads()
    elif plan.vision_frozen:  # a full fine-tune that keeps the vision tower and its projector as they are
        for name, p in model.named_parameters():
            if any(f".{m}." in f".{name}" for m in VISION_MODULES):
                p.requires_grad_(False)
    if plan.fused_lm_head:
        from trl.trainer.utils import add_fused_lm_head

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        add_fused_lm_head(base, outputs=TRL_FUSED_OUTPUTS)
    return model


def _image(width: int, height: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def vlm_batch(config, plan: Plan) -> dict:
    """Rows of `plan.seq_len` tokens, each with `plan.images_per_row` random images of the plan's size as the
    family's image processor prepares them, their placeholder tokens first and random text after."""
    facts = vlm_facts_for_config(config)
    processor = _processor(facts, plan)
    width, height = plan.image_width, plan.image_height
    images = [_image(width, height, i) for i in range(plan.batch_size * plan.images_per_row)]
    out = dict(processor(images=images, return_tensors="pt"))
    per_image = _tokens_per_image(facts, out, len(images))
    g = torch.Generator().manual_seed(0)
    text = config.get_text_config()
    ids = torch.randint(0, min(text.vocab_size, 100), (plan.batch_size, plan.seq_len), generator=g)
    pos = 0
    for _ in range(plan.images_per_row):
        if facts.start_token is not None:
            ids[:, pos] = facts.start_token
            pos += 1
        ids[:, pos : pos + per_image] = facts.image_token
        pos += per_image
    labels = ids.clone()
    labels[ids == facts.image_token] = -100  # TRL's collator leaves the image placeholders out of the loss
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    for key, value in out.items():
        if key in ("pixel_values", "image_grid_thw", "pixel_attention_mask", "token_type_ids"):
            batch[key] = value.to(DTYPES[plan.load_dtype]) if key == "pixel_values" else value
    if facts.family == "gemma3":  # the image positions attend bidirectionally: Gemma 3 reads token_type_ids
        batch["token_type_ids"] = (ids == facts.image_token).long()
    if (
        facts.family in QWEN3_PROCESSOR
    ):  # the image positions (1) for the 3-D rotary positions, as it marks them
        batch["mm_token_type_ids"] = (ids == facts.image_token).long()
    return batch


def _processor(facts, plan: Plan):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kind = {
        "qwen": Qwen2VLImageProcessorPil,
        "tiles": Idefics3ImageProcessorPil,
        "llava": LlavaImageProcessorPil,
        "fixed": Gemma3ImageProcessorPil,
    }[facts.rule]
    return kind(**image_processor_kwargs(facts, plan))


def _tokens_per_image(facts, out: dict, images: int) -> int:
    if facts.rule == "qwen":
        return int(out["image_grid_thw"][0].prod()) // facts.merge_size**2
    if facts.rule == "tiles":
        return int(out["pixel_values"].shape[1]) * facts.tile_tokens
    if facts.rule == "fixed":  # Gemma 3: the image and its pan-and-scan crops, each pooled alike
        return int(out["pixel_values"].shape[0]) // images * facts.fixed_tokens
    return facts.fixed_tokens


def measure_vlm(config, plan: Plan, options: StepOptions = StepOptions()) -> StepMemory:
    """One measured step of `plan` on a VLM built from `config`."""
    plan = checked(plan)
    model = build_vlm(config, plan)
    optimizer = build_optimizer(model, plan, options)
    return run_step(model, optimizer, vlm_batch(config, plan), plan, options)
