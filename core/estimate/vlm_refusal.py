"""The one sentence a vision-language family the planner does not model is refused with (issue #47 item 5): the
closest modelled family -- the one whose kind of image rule its processor has, else whose vision tower it reuses,
else the nearest name -- and what differs."""

from __future__ import annotations

from core.estimate.vlm_rules import PROCESSOR_RULES

# the modelled families named in a refusal, by model_type
MODELLED = {
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "gemma3": "Gemma 3",
    "idefics3": "Idefics3",
    "llava": "LLaVA",
    "mistral3": "Mistral 3 (Pixtral)",
    "llava_next": "LLaVA-NeXT",
    "llava_onevision": "LLaVA-OneVision",
    "internvl": "InternVL",
    "glm4v": "GLM-4.1V",
    "paligemma": "PaliGemma",
    "idefics2": "Idefics2",
    "lfm2_vl": "LFM2-VL",
    "blip-2": "BLIP-2",
    "deepseek_vl": "DeepSeek-VL",
    "llama4": "Llama 4",
    "gemma4": "Gemma 4",
}
# a word of the vision tower's class name (lower case, "_" dropped) -> the modelled family built on that tower;
# the first that matches wins (Siglip2 before Siglip)
TOWER_FAMILY = (
    ("siglip2", "lfm2_vl"),
    ("siglip", "paligemma"),
    ("clip", "llava"),
    ("pixtral", "mistral3"),
    ("blip", "blip-2"),
    ("idefics", "idefics3"),
    ("gotocr2", "internvl"),
    ("intern", "internvl"),
    ("qwen3", "qwen3_vl"),
    ("qwen", "qwen2_5_vl"),
    ("glm", "glm4v"),
    ("gemma", "gemma3"),
)
# a word of the image processor's class name -> the modelled family whose rule is of the same kind: tiles with a
# thumbnail (InternVL), any-res crops (LLaVA-NeXT), native-resolution patching (Qwen2.5-VL), fixed tokens
PROCESSOR_FAMILY = (
    ("qwen2vl", "qwen2_5_vl"),
    ("kimi", "qwen2_5_vl"),
    ("glm", "glm4v"),
    ("llava", "llava_next"),
    ("molmo", "llava_next"),
    ("gotocr", "internvl"),
    ("minicpm", "internvl"),
    ("ovis", "internvl"),
    ("cohere2vision", "internvl"),
    ("aria", "idefics3"),
    ("mllama", "llama4"),
    ("blip", "blip-2"),
    ("deepseekvl", "deepseek_vl"),
    ("janus", "deepseek_vl"),
    ("idefics", "idefics2"),
    ("clip", "llava"),
    ("siglip", "paligemma"),
)


def closest_family(model_type: str, tower: str = "", processor: str = "") -> str:
    """The modelled family nearest to `model_type`: the one whose kind of image rule its processor has, else whose
    vision tower it reuses, else the nearest name."""
    import difflib

    p = processor.lower().replace("_", "")
    for key, family in PROCESSOR_FAMILY:
        if key in p:
            return family
    t = tower.lower().replace("_", "")
    for key, family in TOWER_FAMILY:
        if key in t:
            return family
    return (difflib.get_close_matches(model_type, list(MODELLED), n=1, cutoff=0) or ["llava"])[0]


def unsupported_sentence(model_type: str, tower: str = "", processor: str = "") -> str:
    near = closest_family(model_type, tower, processor)
    differs = (
        f"its image processor ({processor}) turns images into tokens by a rule the planner does not know"
        if processor and not rule_known(processor)
        else f"its vision tower{f' ({tower})' if tower else ''} or language model is not one the planner finds"
    )
    return (
        f"{model_type}: this family's image rule or architecture is not modelled yet; the closest modelled family "
        f"is {MODELLED[near]} ({near}), and {differs}."
    )


def rule_known(processor: str) -> bool:
    return processor in PROCESSOR_RULES


def tower_name(vision) -> str:
    return type(vision).__name__ if vision is not None else ""
