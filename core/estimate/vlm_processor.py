"""Where a vision-language family's image settings come from (core.estimate.vlm_rules applies them): the image
processor class AutoImageProcessor would load for it, that class's defaults, what the model's config says of its
images, and the model folder's own preprocessor_config.json / processor_config.json over them; and the family's
real PIL image processor set up alike (the tests and measurements check the rules against it)."""

from __future__ import annotations

import json
from pathlib import Path

from core.estimate.vlm_rules import PROCESSOR_RULES, SETTINGS, TORCHVISION_ONLY, patch_side

# families transformers maps to no image processor nor processor: the one their published checkpoints name
NO_IMAGE_PROCESSOR = {
    "glm_ocr": "Glm4vImageProcessor",
    "qwen2_5_omni_thinker": "Qwen2VLImageProcessor",
    "qwen3_omni_moe_thinker": "Qwen2VLImageProcessor",
}


# the families whose published preprocessor_config.json turns GotOcr2ImageProcessor's crop_to_patches on (GOT-OCR2's
# own does not: one tile)
CROPPED = ("internvl", "qianfan_ocr")


def processor_class(model_type: str) -> str:
    """The image processor class AutoImageProcessor would load for a folder of `model_type` without its own
    preprocessor_config.json (the torchvision and PIL variants share one name, less the "Pil" suffix)."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}
    name = (names.get("torchvision") or names.get("pil") or "") if isinstance(names, dict) else str(names)
    if not name:  # a family that borrows another's processor (GLM-4.5V's is GLM-4.1V's Glm4vProcessor)
        name = NO_IMAGE_PROCESSOR.get(model_type) or (PROCESSOR_MAPPING_NAMES.get(model_type) or "").replace(
            "Processor", "ImageProcessor"
        )
    return name.removesuffix("Pil")


def processor_defaults(name: str) -> dict:
    """The class-level settings of image processor `name` (its PIL variant: that one imports without torchvision);
    {} when neither imports."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    for candidate in (name + "Pil", name):
        try:
            cls = get_image_processor_class_from_name(candidate)
        except Exception:  # a torchvision-only processor on a machine without torchvision
            continue
        if cls is None:
            continue
        out = {}
        try:
            for key in SETTINGS:
                value = getattr(cls, key, None)
                if value is not None and not callable(value):
                    out[key] = value if not isinstance(value, tuple) else list(value)
        except ImportError:  # transformers' stand-in for a class that needs torchvision
            continue
        return out
    return dict(TORCHVISION_ONLY.get(name, {}))


def settings_for(processor: str, cfg) -> str:
    """The processor settings of a config's family as JSON: the processor class's defaults, and what the model's
    config itself says of its images (LLaVA-NeXT's grid, OneVision's anyres_max_N, the feature strategy; Pixtral's
    longest edge is the vision encoder's image_size, which the published preprocessor configs repeat)."""

    s = {"class": processor, **processor_defaults(processor)}
    for key, name in (
        ("image_grid_pinpoints", "image_grid_pinpoints"),
        ("vision_aspect_ratio", "vision_aspect_ratio"),
        ("strategy", "vision_feature_select_strategy"),
    ):
        value = getattr(cfg, name, None)
        if value is not None:
            s[key] = value
    if cfg.model_type in CROPPED:  # the class says no; these families' published configs crop
        s["crop_to_patches"] = True
    if PROCESSOR_RULES.get(processor) == "pixtral":
        s["size"] = {"longest_edge": patch_side(getattr(cfg.vision_config, "image_size", 1024))}
    return json.dumps(s, sort_keys=True)


def folder_settings(model: str) -> dict:
    """The image settings of a model folder's (or a cached Hub repo's) preprocessor_config.json and
    processor_config.json: they override the defaults (a published checkpoint's max_pixels, longest edge, tiles)."""
    import os

    out = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = os.path.join(model, name)
        if not os.path.isfile(path):
            try:
                from huggingface_hub import try_to_load_from_cache

                path = (
                    try_to_load_from_cache(model, name)
                    if "/" in model and not os.path.exists(model)
                    else None
                )
            except Exception:  # not a repo id the cache knows
                path = None
        if not isinstance(path, str) or not os.path.isfile(path):
            continue
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        data = data.get("image_processor", data) if isinstance(data, dict) else {}
        out.update({k: v for k, v in data.items() if k in SETTINGS or k == "vision_aspect_ratio"})
    return out


def processor_kwargs(facts, s: dict) -> dict:
    """The family's PIL image processor set up as these facts and settings describe (the tests check the rules
    against it; core.measure builds its batches with it)."""
    p, m, side = facts.patch_size, facts.merge_size, facts.image_size
    square = {"height": side, "width": side}
    if facts.rule in ("qwen", "glm"):
        size = s.get("size") or {}
        out = dict(patch_size=p, merge_size=m, size=size) if size else dict(patch_size=p, merge_size=m)
        return out
    if facts.rule == "pixtral":  # PixtralProcessor hands its image processor patch x merge as the patch size
        return dict(size=s.get("size"), patch_size={"height": p * m, "width": p * m})
    if facts.rule == "anyres":
        pins = s.get("image_grid_pinpoints")
        if s.get("class") == "LlavaNextImageProcessor":
            return dict(size={"shortest_edge": side}, crop_size=square, image_grid_pinpoints=pins)
        return dict(size=square, image_grid_pinpoints=pins)
    if facts.rule == "crops":
        return dict(
            size=square,
            min_patches=s.get("min_patches", 1),
            max_patches=s.get("max_patches", 12),
            crop_to_patches=bool(s.get("crop_to_patches")),
        )
    if facts.rule == "idefics2":
        return dict(size=s.get("size"), do_image_splitting=bool(s.get("do_image_splitting")))
    if facts.rule == "soft":
        return dict(
            patch_size=p,
            max_soft_tokens=s.get("max_soft_tokens", 280),
            pooling_kernel_size=s.get("pooling_kernel_size", 3),
        )
    return dict(size=square)


def pil_processor(facts, s: dict):
    """The PIL variant of the family's image processor (imports without torchvision), set up by processor_kwargs."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    return get_image_processor_class_from_name(s["class"] + "Pil")(**processor_kwargs(facts, s))
