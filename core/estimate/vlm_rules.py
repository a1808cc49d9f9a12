"""The image rules of the vision-language families added for issue #47, picked by the family's image processor class
(what AutoImageProcessor loads for it: transformers' IMAGE_PROCESSOR_MAPPING_NAMES, or the model folder's
preprocessor_config.json `image_processor_type`) rather than by the model's name, with the numbers read from the
model's config and the processor's settings (transformers 5.25; each rule names the code it follows):

- "qwen": Qwen2VLImageProcessor and the families that reuse it (EXAONE 4.5, LLaVA-OneVision-1.5, HyperCLOVA X,
  LFM3-VL, Cosmos 3), and the processors with its smart_resize under their own settings (PaddleOCR-VL,
  VideoLLaMA 3, ERNIE 4.5-VL, HunYuan-VL): core.estimate.vlm's smart_resize rule.
- "glm": Glm4vImageProcessor (GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-OCR): the same, but its smart_resize counts the
  still image as two frames against max_pixels.
- "pixtral": PixtralImageProcessor (Mistral 3, Mistral Large 3, LightOnOCR): the image scaled down to a longest
  edge, cut into patch x merge cells; one token per cell plus one [IMG_BREAK] / [IMG_END] per row of cells.
- "anyres": LlavaNextImageProcessor / LlavaOnevisionImageProcessor: the best grid resolution of
  image_grid_pinpoints, one base crop plus a crop per grid tile, the unpadded features plus a newline per row
  (OneVision: pooled down to anyres_max_N base crops).
- "crops": GotOcr2ImageProcessor (InternVL, Qianfan-OCR; GOT-OCR2 uncropped): the grid of 1..max_patches tiles
  whose aspect ratio is closest to the image's, plus a thumbnail; image_seq_length tokens per tile, <img> and
  </img> around them.
- "square": SiglipImageProcessor (PaliGemma), DeepseekVLImageProcessor: every image resized to the encoder's
  square; one token per patch.
- "soft": Gemma4ImageProcessor: the image resized, its aspect ratio kept, to the most whole pooling x patch cells
  within max_soft_tokens x pooling^2 patches; one token per cell; the patches padded to that budget.
- "chunks": Llama4ImageProcessor: the canvas of up to max_patches 336 px chunks that scales the image least (up
  if it can), a global chunk beside several; (336/14)^2 / 4 tokens per chunk (pixel shuffle 0.5), with tile
  separators.
- "lfm2": Lfm2VlImageProcessor: a small image smart-resized to 64..256 tokens (16 px patches, 2x2 downsampled);
  a large one cut into 2..10 tiles of 512 px plus that thumbnail; the tiles' patches padded to one budget.
- "query": BlipImageProcessor (BLIP-2, InstructBLIP): the image resized to the encoder's square; the Q-Former
  turns it into num_query_tokens tokens.
- "idefics2": Idefics2ImageProcessor: the perceiver's resampler_n_latents tokens per image (and per crop of the
  four-way split when do_image_splitting is on); the tower runs on the image resized into [378, 980] px.
"""

from __future__ import annotations

import math

from core.estimate.vlm_resize import (
    anyres_features,
    chunk_canvas,
    crop_grid,
    glm_resize,
    idefics2_resize,
    lfm2_layout,
    pixtral_resize,
    soft_resize,
)

# the image processor class -> the rule that says what it makes of an image
PROCESSOR_RULES = {
    "Qwen2VLImageProcessor": "qwen",
    # Qwen2-VL's smart_resize under their own names and settings (patch 14 or 16, merge 1 or 2, own pixel bounds)
    "PaddleOCRVLImageProcessor": "qwen",
    "VideoLlama3ImageProcessor": "qwen",
    "Ernie4_5_VLMoeImageProcessor": "qwen",
    "HunYuanVLImageProcessor": "qwen",
    "Glm4vImageProcessor": "glm",
    "Cosmos3EdgeImageProcessor": "glm",
    "Glm46VImageProcessor": "glm",
    "PixtralImageProcessor": "pixtral",
    "LlavaNextImageProcessor": "anyres",
    "LlavaOnevisionImageProcessor": "anyres",
    "GotOcr2ImageProcessor": "crops",
    "SiglipImageProcessor": "square",
    "DeepseekVLImageProcessor": "square",
    "BlipImageProcessor": "query",
    "Idefics2ImageProcessor": "idefics2",
    "Gemma4ImageProcessor": "soft",
    "Llama4ImageProcessor": "chunks",
    "Lfm2VlImageProcessor": "lfm2",
}
# the processor settings a rule reads (a preprocessor_config.json's keys)
SETTINGS = (
    "size",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "min_pixels",
    "max_pixels",
    "crop_size",
    "image_grid_pinpoints",
    "min_patches",
    "max_patches",
    "do_image_splitting",
    "crop_to_patches",
    "max_soft_tokens",
    "pooling_kernel_size",
    "resize_to_max_canvas",
    "min_tiles",
    "max_tiles",
    "use_thumbnail",
    "min_image_tokens",
    "max_image_tokens",
    "encoder_patch_size",
    "tile_size",
    "max_pixels_tolerance",
    "downsample_factor",
)
# the class defaults of processors that import only with torchvision (transformers 5.25's source), used where
# torchvision is missing; a model folder's preprocessor_config.json still overrides them
TORCHVISION_ONLY = {
    "Llama4ImageProcessor": {
        "size": {"height": 336, "width": 336},
        "max_patches": 16,
        "resize_to_max_canvas": False,
    },
    "Lfm2VlImageProcessor": {
        "downsample_factor": 2,
        "do_image_splitting": True,
        "min_tiles": 2,
        "max_tiles": 10,
        "use_thumbnail": True,
        "min_image_tokens": 64,
        "max_image_tokens": 256,
        "encoder_patch_size": 16,
        "tile_size": 512,
        "max_pixels_tolerance": 2.0,
    },
}
# image-text-to-text families whose rule is one of the old ones (core.estimate.vlm.RULES) under another name
SAME_AS = {"shieldgemma2": "gemma3", "vipllava": "llava", "video_llava": "llava"}


def rule_of(model_type: str, processor: str) -> str:
    return PROCESSOR_RULES.get(processor, "")


def patch_side(v) -> int:
    if isinstance(v, dict):
        return int(v.get("height") or v.get("width") or 0)
    return int(v[0] if isinstance(v, (list, tuple)) else v or 0)


def rule_fields(rule: str, cfg, vision, proc: dict) -> dict:
    """The VlmFacts numbers of a family of `rule`: patch_size, merge_size, image_size, tile_tokens, fixed_tokens,
    cls (does the tower prepend a class token to each crop)."""
    vc = cfg.vision_config
    patch = patch_side(getattr(vc, "patch_size", 14))
    image = patch_side(getattr(vc, "image_size", 0))
    cls = any(n.rsplit(".", 1)[-1] in ("class_embedding", "cls_token") for n, _ in vision.named_parameters())
    out = dict(patch_size=patch, merge_size=1, image_size=image, tile_tokens=0, fixed_tokens=0, cls=cls)
    if rule in ("qwen", "glm"):
        out.update(
            patch_size=patch_side(proc.get("patch_size") or patch),
            merge_size=int(proc.get("merge_size") or getattr(vc, "spatial_merge_size", 2) or 2),
        )
    elif (
        rule == "pixtral"
    ):  # the model's own bound on the image (vision_config.image_size) is its longest edge
        out.update(merge_size=int(getattr(cfg, "spatial_merge_size", 1) or 1))
    elif rule == "anyres":
        out.update(fixed_tokens=(image // patch) ** 2)
    elif rule == "crops":
        out.update(tile_tokens=int(getattr(cfg, "image_seq_length", 0) or 0))
    elif rule == "square":
        out.update(fixed_tokens=(image // patch) ** 2)
    elif rule == "query":  # BLIP-2's Q-Former: num_query_tokens per image
        out.update(fixed_tokens=int(getattr(cfg, "num_query_tokens", 32) or 32))
    elif rule == "chunks":  # pixel shuffle: 1 / ratio^2 patches per token
        ratio = float(getattr(vc, "pixel_shuffle_ratio", 0.5) or 0.5)
        out.update(merge_size=int(round(1 / ratio**2)))
    elif rule == "lfm2":
        out.update(merge_size=int(getattr(cfg, "downsample_factor", 2) or 2))
    elif rule == "idefics2":
        perceiver = getattr(cfg, "perceiver_config", None)
        out.update(fixed_tokens=int(getattr(perceiver, "resampler_n_latents", 64) or 64))
    return out


def _side(size: dict, *keys) -> int:
    for k in keys:
        if isinstance(size, dict) and size.get(k):
            return int(size[k])
    return 0


def rule_tokens(facts, s: dict, width: int, height: int, max_pixels: int = 0) -> dict:
    """What one width x height image becomes under facts.rule with processor settings `s`: tokens (sequence
    positions it adds), placeholders (of them, the image-token ids the model fills with features), patches (the
    vision tower's positions over every crop), units (crops), resized (width, height), values (pixel_values
    elements), source (in words)."""
    p, m, side = facts.patch_size, facts.merge_size, facts.image_size
    cls = 1 if facts.cls else 0
    if facts.rule == "glm":
        size = s.get("size") or {}
        low = _side(size, "shortest_edge") or int(s.get("min_pixels") or 112 * 112)
        high = max_pixels or _side(size, "longest_edge") or int(s.get("max_pixels") or 28 * 28 * 15000)
        h, w = glm_resize(height, width, p * m, low, high)
        patches = (h // p) * (w // p)
        n = patches // m**2
        src = (
            f"{width}x{height} resized to {w}x{h} (multiples of {p * m} px; the still image counts as 2 frames "
            f"against max_pixels {high:,}); {patches:,} patches of {p} px, {m}x{m} merged per token"
        )
        return dict(
            tokens=n,
            placeholders=n,
            patches=patches,
            units=1,
            resized=(w, h),
            values=patches * 6 * p * p,
            source=src,
        )
    if facts.rule == "pixtral":
        longest = _side(s.get("size") or {}, "longest_edge") or side
        h, w = pixtral_resize(height, width, longest, p * m)
        rows, cols = h // (p * m), w // (p * m)
        src = (
            f"{width}x{height} scaled to fit {longest} px and padded to {w}x{h} (whole {p * m} px cells); "
            f"{rows}x{cols} tokens ({p} px patches, {m}x{m} merged) and one [IMG_BREAK]/[IMG_END] per row"
        )
        return dict(
            tokens=rows * cols + rows,
            placeholders=rows * cols,
            patches=(h // p) * (w // p),
            units=1,
            resized=(w, h),
            values=3 * h * w,
            source=src,
        )
    if facts.rule == "anyres":
        pins = s.get("image_grid_pinpoints") or [[side, side]]
        ratio = str(s.get("vision_aspect_ratio") or "")
        cap = int(ratio.removeprefix("anyres_max_")) if ratio.startswith("anyres_max_") else 0
        grid, tiles = anyres_features(height, width, side, p, pins, cap)
        # LlavaNextProcessor counts the CLS feature (num_additional_image_tokens), OneVision's does not; strategy
        # "default" drops one
        extra = cls if s.get("class") == "LlavaNextImageProcessor" else 0
        base = facts.fixed_tokens + extra - (1 if s.get("strategy", "default") == "default" else 0)
        n = grid + base
        src = (
            f"{width}x{height} on the best grid of image_grid_pinpoints: {tiles} crop(s) of {side} px + the "
            f"whole image; {base} base features + {grid:,} unpadded grid features with a newline per row"
            + (f" (pooled to about {cap} crops' worth)" if cap else "")
        )
        units = tiles + 1
        return dict(
            tokens=n,
            placeholders=n,
            patches=units * (facts.fixed_tokens + cls),
            units=units,
            resized=(side, side),
            values=units * 3 * side * side,
            source=src,
        )
    if facts.rule == "crops":
        low, high = int(s.get("min_patches") or 1), int(s.get("max_patches") or 12)
        cols, rows = crop_grid(height, width, side, low, high) if s.get("crop_to_patches") else (1, 1)
        units = cols * rows + (1 if cols * rows > 1 else 0)  # the thumbnail when there are several tiles
        n = units * facts.tile_tokens
        cut = (
            f"cut into {rows}x{cols} tiles of {side} px (the grid of {low}..{high} closest to its aspect ratio)"
            + (" + a thumbnail" if units > 1 else "")
            if s.get("crop_to_patches")
            else f"resized to one {side} px tile (crop_to_patches off)"
        )
        src = f"{width}x{height} {cut}; {facts.tile_tokens} tokens per tile (image_seq_length) between <img> and </img>"
        return dict(
            tokens=n + 2,
            placeholders=n,
            patches=units * ((side // p) ** 2 + cls),
            units=units,
            resized=(cols * side, rows * side),
            values=units * 3 * side * side,
            source=src,
        )
    if facts.rule == "idefics2":
        size = s.get("size") or {}
        split = bool(s.get("do_image_splitting"))
        h, w = idefics2_resize(
            height, width, _side(size, "shortest_edge") or 378, _side(size, "longest_edge") or 980
        )
        units = 5 if split else 1
        if split:  # four crops of the half-size image and the image itself, each resized alike
            h2, w2 = idefics2_resize(
                math.ceil(height / 2),
                math.ceil(width / 2),
                _side(size, "shortest_edge") or 378,
                _side(size, "longest_edge") or 980,
            )
        patches = (h // p) * (w // p) + (4 * (h2 // p) * (w2 // p) if split else 0)
        n = units * facts.fixed_tokens
        src = (
            f"{width}x{height} resized to {w}x{h}{' and split into 4 crops + the image' if split else ''}; the "
            f"perceiver pools each to {facts.fixed_tokens} tokens, between <fake_token_around_image> tokens"
        )
        return dict(
            tokens=n + units + 1,
            placeholders=n,
            patches=patches,
            units=units,
            resized=(w, h),
            values=units * 3 * h * w,
            source=src,
        )
    if facts.rule == "soft":
        k = int(s.get("pooling_kernel_size") or 3)
        budget = int(s.get("max_soft_tokens") or 280) * k * k
        h, w = soft_resize(height, width, p, budget, k)
        n = (h // p) * (w // p) // (k * k)
        src = (
            f"{width}x{height} resized to {w}x{h} (aspect kept, whole {k * p} px cells within {budget:,} patches of "
            f"{p} px); {n} soft tokens ({k}x{k} patches pooled each), between <boi> and <eoi>"
        )
        return dict(
            tokens=n + 2,
            placeholders=n,
            patches=budget,
            units=1,
            resized=(w, h),
            values=budget * 3 * p * p,
            source=src,
        )
    if facts.rule == "chunks":
        size = s.get("size") or {}
        side = _side(size, "height") or side
        rows, cols = chunk_canvas(
            height, width, side, int(s.get("max_patches") or 16), bool(s.get("resize_to_max_canvas"))
        )
        units = rows * cols + 1 if rows * cols > 1 else 1
        # the chunk's patches, pixel-shuffled: the processor's num_patches_per_chunk
        per = (side // p) ** 2 // m
        n = units * per
        seps = rows * cols if units > 1 else 0  # a separator after every chunk of a row, one per row
        src = (
            f"{width}x{height} on a {rows}x{cols} canvas of {side} px chunks{' + the global chunk' if units > 1 else ''}; "
            f"{per} tokens per chunk (({side}/{p})^2 / {m}, pixel-shuffled), with separators"
        )
        return dict(
            tokens=n + seps + 3,
            placeholders=n,
            patches=units * ((side // p) ** 2 + cls),
            units=units,
            resized=(cols * side, rows * side),
            values=units * 3 * side * side,
            source=src,
        )
    if facts.rule == "lfm2":
        rows, cols, h, w = lfm2_layout(height, width, s)
        ds = int(s.get("downsample_factor") or m)
        tile = int(s.get("tile_size") or 512)
        image = math.ceil((h // p) / ds) * math.ceil((w // p) / ds)
        split = rows * cols > 1
        thumb = bool(s.get("use_thumbnail", True))
        n = rows * cols * math.ceil(tile // p / ds) ** 2 + (image if thumb else 0) if split else image
        units = rows * cols + (1 if thumb else 0) if split else 1
        budget = max(
            int(s.get("max_image_tokens") or 256) * ds * ds,
            (tile // p) ** 2 if s.get("do_image_splitting", True) else 0,
        )
        src = (
            f"{width}x{height} "
            + (
                f"cut into {rows}x{cols} tiles of {tile} px + a {w}x{h} thumbnail"
                if split
                else f"resized to {w}x{h}"
            )
            + f"; {p} px patches, {ds}x{ds} downsampled per token; each tile padded to {budget:,} patches"
        )
        extra = 2 + (rows * cols + (1 if thumb else 0) if split else 0)  # start/end, a row-col tag per tile
        return dict(
            tokens=n + extra,
            placeholders=n,
            patches=units * budget,
            units=units,
            resized=(w, h),
            values=units * budget * 3 * p * p,
            source=src,
        )
    if facts.rule == "query":
        src = f"every image resized to {side}x{side}; the Q-Former's {facts.fixed_tokens} query tokens stand for it"
        n = facts.fixed_tokens
        return dict(
            tokens=n,
            placeholders=n,
            patches=(side // p) ** 2 + cls,
            units=1,
            resized=(side, side),
            values=3 * side * side,
            source=src,
        )
    # square (PaliGemma): every image resized to the encoder's square
    n = facts.fixed_tokens
    src = f"every image resized to {side}x{side}: ({side}/{p})^2 = {n} tokens"
    return dict(
        tokens=n,
        placeholders=n,
        patches=n + cls,
        units=1,
        resized=(side, side),
        values=3 * side * side,
        source=src,
    )
