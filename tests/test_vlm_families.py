"""The vision-language families of issue #47 against the real libraries: tiny twins (their real transformers classes,
small widths, configs built here) planned from their config; the planner's image tokens against what the family's
real processor makes of images of several sizes and aspect ratios (its image processor's PIL variant, and the
processor's own replace_image_token where the processor class imports without torchvision); one measured LoRA step
against the planned tensor peak where it is cheap; a family still not modelled refused in one sentence naming the
closest modelled one.

Processors checked only through their image processor (the processor class needs torchvision here): Pixtral
(Mistral 3); their text rule is the one replace_image_token applies, restated in _count.
"""

import contextlib
import io
import json
import warnings

import pytest

from core.estimate.plan import Plan
from core.estimate.specs import load_spec
from core.estimate.vlm import image_tokens, vlm_of
from core.estimate.vlm_processor import folder_settings, pil_processor
from core.measure.vlm_families import (
    KNOWN_GAPS,
    MEASURED,
    measure_family,
    measured_plan,
    random_image,
    twin,
    wide_twin,
)

GOAL = 0.05


def _folder(tmp_path, family, preprocessor=None):
    folder = tmp_path / family
    twin(family).save_pretrained(folder)
    if preprocessor:
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return folder


def _processor(name: str, image_processor, **attrs):
    """The family's real processor class (its own replace_image_token), without a tokenizer: None where the class
    needs torchvision."""
    import transformers

    try:
        cls = getattr(transformers, name)
        cls.replace_image_token  # noqa: B018 (a dummy object raises here without torchvision)
    except (ImportError, AttributeError):
        return None
    proc = object.__new__(cls)
    proc.image_processor = image_processor
    for key, value in attrs.items():
        setattr(proc, key, value)
    return proc


def _count(family, facts, ip, settings, out: dict) -> int:
    """The image-token placeholders the family's processor writes for the first image of `out`."""
    image = "<image>"
    if family == "mistral3":  # PixtralProcessor.replace_image_token: [IMG] per cell (needs torchvision here)
        h, w = (int(x) for x in out["image_sizes"][0])
        cell = facts.patch_size * facts.merge_size
        return (h // cell) * (w // cell)
    if family == "llava_next":
        proc = _processor(
            "LlavaNextProcessor",
            ip,
            image_token=image,
            patch_size=facts.patch_size,
            num_additional_image_tokens=1,
            vision_feature_select_strategy="default",
        )
    elif family == "llava_onevision":
        proc = _processor(
            "LlavaOnevisionProcessor",
            ip,
            image_token=image,
            num_image_tokens=facts.fixed_tokens,
            vision_feature_select_strategy=settings.get("strategy", "full"),
            vision_aspect_ratio=settings.get("vision_aspect_ratio", "anyres_max_9"),
        )
        out = {**out, "batch_num_images": [1]}
    elif family == "internvl":
        proc = _processor(
            "InternVLProcessor",
            ip,
            image_token=image,
            image_seq_length=facts.tile_tokens,
            start_image_token="<img>",
            end_image_token="</img>",
        )
    elif family == "paligemma":
        proc = _processor("PaliGemmaProcessor", ip, image_token=image, image_seq_length=facts.fixed_tokens)
    elif family in ("glm4v", "exaone4_5"):
        name = {"glm4v": "Glm4vProcessor", "exaone4_5": "Exaone4_5_Processor"}[family]
        proc = _processor(name, ip, image_token=image)
    elif family == "video_llava":
        proc = _processor(
            "VideoLlavaProcessor",
            ip,
            image_token=image,
            patch_size=facts.patch_size,
            num_additional_image_tokens=1,
            vision_feature_select_strategy="default",
        )
    elif family == "deepseek_vl":
        proc = _processor("DeepseekVLProcessor", ip, image_token=image, num_image_tokens=facts.fixed_tokens)
    elif family == "blip-2":  # Blip2Processor.__call__: num_query_tokens image tokens per image
        return facts.fixed_tokens
    elif family == "gemma4":
        proc = _processor("Gemma4Processor", ip, image_token=image, boi_token="<boi>", eoi_token="<eoi>")
    elif family == "idefics2":  # Idefics2Processor.__call__: image_seq_len per image, five with the split
        return facts.fixed_tokens * (5 if ip.do_image_splitting else 1)
    assert proc is not None, f"{family}'s processor should import here"
    return proc.replace_image_token(out, 0).count(image)


SIZES = [(1024, 768), (640, 1280), (2000, 500), (300, 300), (97, 1500)]
FAMILIES = [
    "gemma4",
    "mistral3",
    "llava_next",
    "llava_onevision",
    "internvl",
    "paligemma",
    "glm4v",
    "exaone4_5",
    "idefics2",
    "video_llava",
    "deepseek_vl",
    "blip-2",
]
# their processors import only with torchvision (not installed here): planned, their rules checked by hand below
NO_PROCESSOR_HERE = ["llama4", "lfm2_vl"]
# a published checkpoint's processor settings, written to the twin's folder: the plan must read them
PUBLISHED = {
    "mistral3": {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": 1540}},
    "internvl": {
        "image_processor_type": "GotOcr2ImageProcessor",
        "max_patches": 12,
        "crop_to_patches": True,
        "min_patches": 1,
    },
    "glm4v": {"size": {"shortest_edge": 12544, "longest_edge": 9633792}, "patch_size": 14, "merge_size": 2},
    "idefics2": {"do_image_splitting": True, "size": {"shortest_edge": 378, "longest_edge": 980}},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_image_tokens_equal_the_real_processors(tmp_path, family, size):
    from core.measure.vlm_step import _processor as old_rule_processor

    folder = _folder(tmp_path, family, PUBLISHED.get(family))
    facts = vlm_of(load_spec(str(folder)))
    assert not facts.unsupported, facts
    plan = Plan(model=str(folder), image_width=size[0], image_height=size[1])
    settings = {**json.loads(facts.processor or "{}"), **folder_settings(str(folder))}
    # a family on one of the first ten families' rules (Video-LLaVA: LLaVA's) is set up as core.measure does
    ip = pil_processor(facts, settings) if facts.processor else old_rule_processor(facts, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = dict(ip(images=[random_image(*size)], return_tensors="pt"))
    planned = image_tokens(facts, plan)
    assert planned.placeholders == _count(family, facts, ip, settings, out), planned.source
    assert planned.tokens >= planned.placeholders > 0 and planned.patches > 0


def test_the_plan_reads_the_folders_processor_settings(tmp_path):
    """A published preprocessor_config.json changes the plan (GLM-4.1V's max_pixels), not the family's name."""
    wide = _folder(tmp_path / "a", "glm4v")
    narrow = _folder(tmp_path / "b", "glm4v", {"size": {"shortest_edge": 12544, "longest_edge": 200_704}})
    big = dict(image_width=2048, image_height=2048)
    many = image_tokens(vlm_of(load_spec(str(wide))), Plan(model=str(wide), **big)).tokens
    few = image_tokens(vlm_of(load_spec(str(narrow))), Plan(model=str(narrow), **big)).tokens
    assert few < many and few <= 200_704 // 2 // 28**2


def test_llama4_chunks_and_lfm2_tiles_as_their_processors_code_says(tmp_path):
    """Llama4ImageProcessor and Lfm2VlImageProcessor need torchvision, which is not installed here: their rules
    against numbers worked by hand from their code (Llama 4's get_best_fit docstring example among them)."""
    from core.estimate.vlm_resize import chunk_canvas, lfm2_layout

    assert chunk_canvas(200, 300, 224, 3, False) == (1, 2)  # get_best_fit's example: 224 x 448
    llama = vlm_of(load_spec(str(_folder(tmp_path, "llama4"))))
    small = image_tokens(llama, Plan(model="x", image_width=300, image_height=300))
    assert small.placeholders == 144 and small.units == 1  # (336/14)^2 / 4, one chunk
    big = image_tokens(llama, Plan(model="x", image_width=1024, image_height=768))
    assert big.units == 13 and big.placeholders == 13 * 144  # a 3 x 4 canvas of chunks + the global one
    lfm = vlm_of(load_spec(str(_folder(tmp_path, "lfm2_vl"))))
    assert lfm2_layout(300, 300, json.loads(lfm.processor))[2:] == (288, 288)
    assert image_tokens(lfm, Plan(model="x", image_width=300, image_height=300)).placeholders == 81
    # 1024 x 768 is over twice 256 tokens' pixels: 3 x 2 tiles of 512 px (256 tokens each) + a 576 x 416 thumbnail
    wide = image_tokens(lfm, Plan(model="x", image_width=1024, image_height=768))
    assert wide.placeholders == 6 * 256 + 18 * 13 and wide.units == 7


def test_what_would_fit_offers_glms_max_pixels(tmp_path):
    """GLM-4.1V's processor is bounded by max_pixels as Qwen-VL's is: the lever lowers its image tokens."""
    from dataclasses import replace

    from core.estimate.bill import estimate
    from core.estimate.levers import what_would_fit

    folder = _folder(tmp_path, "glm4v")
    plan = Plan(
        model=str(folder), image_width=2048, image_height=2048, seq_len=8000, gpu_gb=0.05, device="cuda"
    )
    advice = next(a for a in what_would_fit(plan) if a["change"].startswith("max_pixels"))
    fewer = estimate(replace(plan, **advice["settings"])).vlm["image_tokens_per_image"]
    assert fewer < estimate(plan).vlm["image_tokens_per_image"]


def _cli(args) -> tuple[int, str]:
    from core.estimate.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("family", FAMILIES + NO_PROCESSOR_HERE)
def test_each_family_plans_with_its_vision_terms(tmp_path, family):
    folder = _folder(tmp_path, family, PUBLISHED.get(family))
    rc, out = _cli(
        ["--model", str(folder), "--gpu-gb", "24", "--seq-len", "8192", "--image-size", "1024x768"]
    )
    assert rc == 0, out
    assert "image tokens each" in out and "image tokens from:" in out and "vision activations" in out


@pytest.mark.parametrize(
    "family,closest",
    [
        ("janus", "DeepSeek-VL"),
        ("aria", "Idefics3"),
        ("molmo2", "LLaVA-NeXT"),
        ("kimi_k25", "Qwen2.5-VL"),
        ("mllama", "Llama 4"),
    ],
)
def test_a_family_not_modelled_names_the_closest_one_in_one_sentence(tmp_path, family, closest):
    from transformers import AutoConfig

    folder = tmp_path / family
    AutoConfig.for_model(family).save_pretrained(folder)
    rc, out = _cli(["--model", str(folder)])
    assert rc == 2 and "not modelled yet" in out and f"closest modelled family is {closest}" in out, out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MEASURED))
@pytest.mark.parametrize(
    "checkpointing,frozen",
    [(True, True), (False, True), (True, False)],
    ids=["gc", "no-gc", "gc-tower-trained"],
)
def test_a_twins_lora_step_peaks_where_the_plan_says(tmp_path, family, checkpointing, frozen):
    from core.estimate.bill import estimate

    cfg = wide_twin(family)
    folder = tmp_path / family
    cfg.save_pretrained(folder)
    plan = measured_plan(folder, family, checkpointing, frozen)
    ratio = measure_family(cfg, plan) / estimate(plan).tensor_peak_bytes
    gap = KNOWN_GAPS.get((family, checkpointing))
    if gap and ratio > 1 + GOAL:
        pytest.xfail(f"{family} measures {ratio:.3f}x the plan: {gap}")
    assert abs(ratio - 1) <= GOAL, ratio
