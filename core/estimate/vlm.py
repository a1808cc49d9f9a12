"""Vision-language model facts for the planner: the vision tower, its projector and the image-token rule of the
family, read from the meta model core.estimate.specs builds (transformers' image-text-to-text class).

The language model is planned as any decoder LLM; this module says what the images add. How many tokens an image
becomes is each family's processor's rule (transformers 5.24), computed here without the processor:
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE variants (rule "qwen"): the image is resized to
  multiples of patch x merge pixels with its area in [min_pixels, max_pixels] (image_processing_qwen2_vl.smart_resize); the vision tower sees one patch per
  patch x patch pixels (the temporal patch repeats a still image: one frame), and every merge x merge patches
  become one token of the language model.
- Idefics3, SmolVLM ("tiles"): the image is scaled to a longest edge of 4 tiles and split into tiles of the vision
  encoder's image_size, plus the whole image scaled to one tile (image_processing_idefics3
  get_number_of_image_patches); each tile becomes image_seq_len tokens ((image_size / patch)^2 / scale_factor^2).
- Gemma 3 ("fixed"): every image is resized to the encoder's image_size and pooled to mm_tokens_per_image tokens.
- LLaVA ("llava"): the image is resized and cropped to image_size; (image_size / patch)^2 patch features plus the
  CLS one, which vision_feature_select_strategy "default" drops.

The families of issue #47 (Mistral 3, Gemma 4, Llama 4, LLaVA-NeXT / OneVision, InternVL, GLM-4.xV, PaliGemma,
Idefics2, LFM2-VL and more) take their rule from their image processor class and its settings: core.estimate.
vlm_rules (the rules), vlm_resize (each processor's resize), vlm_processor (where the settings come from, the model
folder's preprocessor_config.json over the class defaults), vlm_refusal (the sentence for a family still not
modelled).

The facts are plain JSON (ModelSpec.vlm_json) so that the spec's disk cache keeps them; `vlm_of(spec)` reads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from core.recipe.vision import VISION_MODULE_NAMES

# Where the image side of each family sits: the vision tower and the projector. A frozen vision tower (the default:
# what ms-swift's freeze_vit and freeze_aligner do) keeps LoRA off every module under these names.
VISION_MODULES = VISION_MODULE_NAMES  # the training engine's list: the plan excludes what LoRA does
TOWERS = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_tower")
PROJECTORS = (
    "merger",
    "multi_modal_projector",
    "connector",
    "vision_projection",
    "embed_vision",
    "aligner",
    "qformer",
)
RULES = {
    "qwen2_vl": "qwen",
    "qwen2_5_vl": "qwen",
    "qwen3_vl": "qwen",
    "qwen3_vl_moe": "qwen",
    # Qwen3.5: Qwen3-VL's vision tower without deepstack, Qwen3-VL's processor (a hybrid language model)
    "qwen3_5": "qwen",
    "qwen3_5_moe": "qwen",
    "idefics3": "tiles",
    "smolvlm": "tiles",
    "gemma3": "fixed",
    "llava": "llava",
}
# the families whose processor is Qwen3-VL's: it marks the image positions (mm_token_type_ids) for the 3-D rotary
# positions, which their models require
QWEN3_PROCESSOR = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# The processors' default pixel bounds (preprocessor_config.json of the published checkpoints; Qwen2/2.5-VL's are
# transformers' Qwen2VLImageProcessor defaults: 56 x 56 and 28 x 28 x 16384).
QWEN_PIXELS = {
    "qwen2_vl": (3136, 12_845_056),
    "qwen2_5_vl": (3136, 12_845_056),
    **dict.fromkeys(QWEN3_PROCESSOR, (65_536, 16_777_216)),
}
DEFAULT_IMAGE = (1024, 1024)  # width x height of the planned images when the plan names none
# Gemma 3's pan-and-scan settings (the published checkpoints' preprocessor_config.json)
PAN_AND_SCAN = dict(
    pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2
)


@dataclass(frozen=True)
class VlmFacts:
    family: str  # the config's model_type
    rule: str  # one of RULES' values: how an image becomes tokens
    vision_path: str  # e.g. model.visual
    projector_path: str  # e.g. model.visual.merger, model.multi_modal_projector
    vision_params: int  # the vision tower's parameters, its projector's not included
    projector_params: int
    vision_linear_params: int  # nn.Linear weights of both (what bitsandbytes 4-bit quantizes)
    vision_layers: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    vision_gated: bool  # a SwiGLU MLP (gate_proj, up_proj, down_proj; Qwen2.5-VL), else fc1 -> act -> fc2
    vision_rms: bool  # RMSNorm (its fp32 upcast saved), else LayerNorm
    vision_fused_qkv: bool  # one qkv Linear (Qwen-VL: its output, then the rotated q and k, are kept)
    vision_deepstack: int  # Qwen3-VL: mergers of intermediate blocks' features (deepstack_visual_indexes)
    patch_size: int
    merge_size: int  # qwen: spatial merge; 1 elsewhere
    image_size: int  # the encoder's input side (tiles, fixed, llava); 0 for qwen
    tile_tokens: int  # tiles: image_seq_len
    fixed_tokens: int  # fixed / llava: tokens per image
    image_token: int  # the placeholder id in the text
    start_token: int | None  # qwen: the vision_start id before the placeholders (its mrope positions need it)
    input_grads: bool  # enable_input_require_grads reaches the vision tower's patch embedding
    unsupported: str  # "" or the sentence saying why this family is not modelled
    # the image processor's class and settings (core.estimate.vlm_rules), as JSON; "" for the first ten families
    processor: str = ""
    cls: bool = False  # the tower prepends a class token to every crop (CLIP, InternViT)


def vlm_of(spec) -> VlmFacts | None:
    """The VLM facts of a ModelSpec, or None for a language model."""
    return _parse(spec.vlm_json) if getattr(spec, "vlm_json", "") else None


@lru_cache(maxsize=64)
def _parse(text: str) -> VlmFacts:
    return VlmFacts(**json.loads(text))


def is_vlm_config(cfg) -> bool:
    """Does a transformers config describe a model with a vision tower (a composite config with vision_config)?"""
    return getattr(cfg, "vision_config", None) is not None


def language_model(meta):
    """The language model inside a VLM's meta model (its decoder layers are the ones the planner counts)."""
    inner = getattr(meta, "model", meta)
    for name in ("language_model", "text_model"):
        if hasattr(inner, name):
            return getattr(inner, name)
    return None


def vlm_json(meta, cfg) -> str:
    """The VLM facts of a meta `meta` model built from `cfg` as JSON ("" for a language model)."""
    if not is_vlm_config(cfg):
        return ""
    return json.dumps(asdict(facts_of(meta, cfg)), sort_keys=True)


def facts_of(meta, cfg) -> VlmFacts:
    import torch.nn as nn

    from core.estimate import vlm_processor, vlm_rules
    from core.estimate.vlm_refusal import tower_name, unsupported_sentence

    family = cfg.model_type
    rule = RULES.get(vlm_rules.SAME_AS.get(family, family), "")
    processor = "" if rule else vlm_processor.processor_class(family)
    rule = rule or vlm_rules.rule_of(family, processor)
    vc = cfg.vision_config
    vision_path, vision = _find(meta, TOWERS)
    projector_path, projector = _find(meta, PROJECTORS)
    vparams = sum(p.numel() for p in vision.parameters()) if vision is not None else 0
    pparams = sum(p.numel() for p in projector.parameters()) if projector is not None else 0
    if projector is not None and vision is not None and projector_path.startswith(vision_path + "."):
        vparams -= pparams  # Qwen's merger sits inside the vision tower
    linear = sum(
        m.weight.numel()
        for root in (vision, projector if not projector_path.startswith(vision_path + ".") else None)
        if root is not None
        for m in root.modules()
        if isinstance(m, nn.Linear)
    )
    blocks = _blocks(vision)
    patch = _int(getattr(vc, "patch_size", 14))
    image_size = _int(getattr(vc, "image_size", 0))
    scale = int(getattr(cfg, "scale_factor", 1) or 1)
    tile_tokens = int(((image_size // patch) ** 2) / scale**2) if rule == "tiles" else 0
    fixed = 0
    if rule == "fixed":
        fixed = int(getattr(cfg, "mm_tokens_per_image", 0) or 0)
    elif rule == "llava":
        full = getattr(cfg, "vision_feature_select_strategy", "default") == "full"
        fixed = (image_size // patch) ** 2 + (1 if full else 0)
    known = rule and vision is not None and blocks is not None and language_model(meta) is not None
    unsupported = "" if known else unsupported_sentence(family, tower_name(vision), processor)
    new = {}
    if known and processor:  # a family of issue #47: its numbers by its processor's rule
        new = vlm_rules.rule_fields(rule, cfg, vision, vlm_processor.processor_defaults(processor))
        settings = vlm_processor.settings_for(processor, cfg)
    return VlmFacts(
        family=family,
        rule=rule,
        vision_path=vision_path,
        projector_path=projector_path,
        vision_params=int(vparams),
        projector_params=int(pparams),
        vision_linear_params=int(linear),
        vision_layers=len(blocks) if blocks is not None else 0,
        vision_hidden=_int(getattr(vc, "hidden_size", 0) or getattr(vc, "embed_dim", 0)),
        vision_intermediate=_int(getattr(vc, "intermediate_size", 0) or 4 * getattr(vc, "embed_dim", 0)),
        vision_heads=_int(getattr(vc, "num_heads", 0) or getattr(vc, "num_attention_heads", 0)),
        vision_gated=_has(blocks, "gate_proj"),
        vision_rms=any("rms" in type(m).__name__.lower() for m in (blocks[0].modules() if blocks else ())),
        vision_fused_qkv=_has(blocks, "qkv"),
        vision_deepstack=len(getattr(vc, "deepstack_visual_indexes", None) or ()),
        patch_size=new.get("patch_size", patch),
        merge_size=new.get("merge_size", _int(getattr(vc, "spatial_merge_size", 1) or 1)),
        image_size=new.get("image_size", image_size),
        tile_tokens=new.get("tile_tokens", tile_tokens),
        fixed_tokens=new.get("fixed_tokens", fixed),
        image_token=int(_first(cfg, "image_token_id", "image_token_index") or 0),
        start_token=_first(cfg, "vision_start_token_id"),
        input_grads=_reaches_vision(vision),
        unsupported=unsupported,
        processor=settings if new else "",
        cls=bool(new.get("cls", False)),
    )


def _int(v) -> int:
    return int(v[0] if isinstance(v, (list, tuple)) else v or 0)


def _first(cfg, *names):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return int(v)
    return None


def _has(blocks, name: str) -> bool:
    return bool(blocks) and any(n.rsplit(".", 1)[-1] == name for n, _ in blocks[0].named_modules())


def _find(meta, names):
    for path, mod in meta.named_modules():
        if path.rsplit(".", 1)[-1] in names:
            return path, mod
    return "", None


def _blocks(vision):
    import torch.nn as nn

    if vision is None:
        return None
    lists = [m for m in vision.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else None


def _reaches_vision(vision) -> bool:
    """transformers' enable_input_require_grads hooks the input embeddings of every PreTrainedModel in the tree:
    a vision tower that names its patch embedding there then runs with grad (SFTTrainer calls it for LoRA with
    gradient checkpointing), a frozen one too."""
    from transformers import PreTrainedModel

    if vision is None:
        return False
    for m in vision.modules():
        if isinstance(m, PreTrainedModel):
            try:
                if m.get_input_embeddings() is not None:
                    return True
            except (NotImplementedError, AttributeError):
                continue
    return False


def vlm_facts_for_config(cfg) -> VlmFacts:
    """The facts of a transformers VLM config (builds its meta model)."""
    import warnings

    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = AutoModelForImageTextToText.from_config(cfg)
    return facts_of(meta, cfg)


# ----------------------------------------------------------------------------------------------------------
# images -> tokens


@dataclass(frozen=True)
class ImageTokens:
    tokens: int  # placeholder tokens one image adds to the language model's sequence
    patches: int  # positions the vision tower runs on for one image (over all its tiles)
    units: int  # tiles (tiles rule), else 1
    resized: tuple[int, int]  # (width, height) the processor resizes to
    source: str  # where the number comes from, in words
    placeholders: int = 0  # of the tokens, the image-token ids the model fills with features (0: all of them)
    values: int = 0  # pixel_values elements (0: the first ten families' rule in vlm_terms.pixel_bytes)

    def __post_init__(self):
        if not self.placeholders:  # the first ten families' rules: every token is a placeholder
            object.__setattr__(self, "placeholders", self.tokens)


def pixel_bounds(facts: VlmFacts, plan) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen-family plan: the plan's max_pixels, else the processor's default."""
    low, high = QWEN_PIXELS.get(facts.family, (3136, 12_845_056))
    return low, plan.max_pixels or high


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize (5.24), as (height, width)."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _tiles(height: int, width: int, tile: int) -> tuple[int, int, int]:
    """Idefics3ImageProcessor.get_number_of_image_patches (5.24): (tiles incl. the global image, rows, cols)."""
    longest = 4 * tile  # the processor's size["longest_edge"]: four tiles (4 x 364 for Idefics3)
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if max(height, width) > 4096:  # MAX_IMAGE_SIZE
        scale = 4096 / max(height, width)
        height, width = int(height * scale), int(width * scale)
    rows = math.ceil(height / tile)
    cols = math.ceil(width / tile)
    if rows * tile > tile or cols * tile > tile:
        return rows * cols + 1, rows, cols
    return 1, 1, 1


def image_tokens(facts: VlmFacts, plan) -> ImageTokens:
    """What one image of the plan's size becomes, by the family's processor rule."""
    width, height = plan.image_width, plan.image_height
    if facts.processor:  # a family of issue #47 (core.estimate.vlm_rules), the model folder's settings over
        from core.estimate.vlm_processor import folder_settings
        from core.estimate.vlm_rules import rule_tokens

        settings = {**json.loads(facts.processor), **folder_settings(plan.model)}
        if facts.rule == "qwen":  # Qwen2VLImageProcessor's own bounds, or the folder's
            size = settings.get("size") or {}
            low = size.get("shortest_edge") or settings.get("min_pixels") or 3136
            high = plan.max_pixels or size.get("longest_edge") or settings.get("max_pixels") or 12_845_056
            settings["bounds"] = [low, high]
        else:
            r = rule_tokens(facts, settings, width, height, plan.max_pixels)
            return ImageTokens(
                r["tokens"],
                r["patches"],
                r["units"],
                r["resized"],
                r["source"],
                r["placeholders"],
                r["values"],
            )
    if facts.rule == "qwen":
        low, high = settings["bounds"] if facts.processor else pixel_bounds(facts, plan)
        factor = facts.patch_size * facts.merge_size
        h, w = smart_resize(height, width, factor, low, high)
        patches = (h // facts.patch_size) * (w // facts.patch_size)
        source = (
            f"{width}x{height} resized to {w}x{h} (multiples of {factor} px, area within min_pixels {low:,} and "
            f"max_pixels {high:,}{'' if plan.max_pixels else ', the processor default'}); {patches:,} patches of "
            f"{facts.patch_size} px, {facts.merge_size}x{facts.merge_size} merged per token"
        )
        return ImageTokens(patches // facts.merge_size**2, patches, 1, (w, h), source)
    per_unit = (facts.image_size // facts.patch_size) ** 2 if facts.image_size else 0
    if facts.rule == "tiles":
        n, rows, cols = _tiles(height, width, facts.image_size)
        split = f"{rows}x{cols} tiles of {facts.image_size} px + the whole image" if n > 1 else "one tile"
        source = (
            f"{width}x{height} scaled to a longest edge of {4 * facts.image_size} px and split into {split}; "
            f"{facts.tile_tokens} tokens per tile (image_seq_len)"
        )
        return ImageTokens(
            n * facts.tile_tokens, n * per_unit, n, (cols * facts.image_size, rows * facts.image_size), source
        )
    if facts.rule == "fixed":
        crops = pan_and_scan_crops(width, height) if plan.pan_and_scan else 0
        scan = (
            f"; pan-and-scan: {crops} crop(s) of it, as many tokens each"
            if plan.pan_and_scan
            else " (mm_tokens_per_image; pan-and-scan, off, would add as many per crop of a wide or tall image)"
        )
        source = (
            f"every image resized to {facts.image_size}x{facts.image_size} and pooled to {facts.fixed_tokens} tokens"
            + scan
        )
        units = crops + 1
        return ImageTokens(
            units * facts.fixed_tokens, units * per_unit, units, (facts.image_size,) * 2, source
        )
    source = (
        f"every image resized and cropped to {facts.image_size}x{facts.image_size}: "
        f"({facts.image_size}/{facts.patch_size})^2 = {per_unit} patch features"
        + (
            " and the CLS one (strategy full)"
            if facts.fixed_tokens > per_unit
            else " (the CLS feature dropped)"
        )
    )
    return ImageTokens(facts.fixed_tokens, per_unit + 1, 1, (facts.image_size,) * 2, source)


def pan_and_scan_crops(width: int, height: int) -> int:
    """Gemma3ImageProcessor.pan_and_scan (5.24): the crops of an image whose aspect ratio is at least 1.2, 2 to 4
    of them, none smaller than 256 px; 0 otherwise."""
    ps = PAN_AND_SCAN
    long, short = max(width, height), min(width, height)
    if long / short < ps["pan_and_scan_min_ratio_to_activate"]:
        return 0
    n = min(math.floor(long / ps["pan_and_scan_min_crop_size"]), math.floor(long / short + 0.5))
    n = min(ps["pan_and_scan_max_num_crops"], max(2, n))
    if min(math.ceil(long / n), short) < ps["pan_and_scan_min_crop_size"]:
        return 0
    return n


def image_processor_kwargs(facts: VlmFacts, plan) -> dict:
    """The family's image processor set up as the plan describes (core.measure.vlm_step, the tests)."""
    if facts.rule == "qwen":
        low, high = pixel_bounds(facts, plan)
        return dict(
            patch_size=facts.patch_size,
            merge_size=facts.merge_size,
            temporal_patch_size=2,
            size={"shortest_edge": low, "longest_edge": high},
        )
    if facts.rule == "tiles":
        return dict(
            size={"longest_edge": 4 * facts.image_size},
            max_image_size={"longest_edge": facts.image_size},
        )
    side = {"height": facts.image_size, "width": facts.image_size}
    if facts.rule == "llava":
        return dict(size={"shortest_edge": facts.image_size}, crop_size=side)
    return dict(size=side, do_pan_and_scan=bool(plan.pan_and_scan), **PAN_AND_SCAN)
