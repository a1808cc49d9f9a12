"""Vision-language planning (issue #36 item 3) against the real libraries: image tokens against each family's real
image processor, tiny random-weight VLMs trained for one step under the live-tensor tracker against the planner's
tensor peak (within 5%), every family the planner names planned from a default config (or refused in one
sentence), a run config planned, and the image levers re-estimated."""

import contextlib
import io
import json
import warnings
from dataclasses import replace

import pytest

from core.demo.toy_vlm import tiny_vlm_config
from core.estimate.bill import estimate
from core.estimate.plan import Plan
from core.estimate.specs import load_spec
from core.estimate.vlm import image_processor_kwargs, image_tokens, vlm_of

# wide vision towers on a tiny language model: the vision terms are a large share of the step
VISION = {
    "qwen2_5_vl": dict(
        hidden_size=256, intermediate_size=512, depth=4, num_heads=4, fullatt_block_indexes=[3]
    ),
    # Qwen3.5: Qwen3-VL's tower without deepstack on a hybrid (Gated DeltaNet) language model
    "qwen3_5": dict(hidden_size=256, intermediate_size=512, depth=4, num_heads=4),
    "smolvlm": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4),
    "llava": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4),
}
IMAGE = {"qwen2_5_vl": 448, "qwen3_5": 448, "smolvlm": 512, "llava": 336}


def _folder(tmp_path, family):
    cfg = tiny_vlm_config(family, vision=VISION[family])
    folder = tmp_path / family
    cfg.save_pretrained(folder)
    return cfg, folder


def _plan(folder, side, **kw) -> Plan:
    base = dict(load_dtype="bf16", compute_dtype="bf16", autocast=False, device="cpu", seq_len=320)
    return Plan(
        model=str(folder),
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        image_width=side,
        image_height=side,
        **{**base, **kw},
    )


@pytest.mark.parametrize(
    "family,size,max_pixels",
    [
        ("qwen2_5_vl", (1024, 768), 0),
        ("qwen2_5_vl", (1920, 1080), 1_003_520),
        ("qwen2_5_vl", (40, 300), 0),
        ("qwen3_5", (1024, 768), 0),
        ("smolvlm", (1024, 768), 0),
        ("smolvlm", (50, 40), 0),
        ("llava", (640, 480), 0),
    ],
)
def test_image_tokens_are_what_the_real_processor_makes(tmp_path, family, size, max_pixels):
    """The planner's rule (no processor) against the family's real image processor on a real image of that size."""
    from core.measure.vlm_step import _image, _processor, _tokens_per_image

    _, folder = _folder(tmp_path, family)
    facts = vlm_of(load_spec(str(folder)))
    plan = Plan(model=str(folder), image_width=size[0], image_height=size[1], max_pixels=max_pixels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _processor(facts, plan)(images=[_image(*size, 0)], return_tensors="pt")
    assert image_tokens(facts, plan).tokens == _tokens_per_image(facts, dict(out), 1)
    assert image_processor_kwargs(facts, plan)  # the processor was set up from the model's config


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,checkpointing,frozen",
    [
        ("qwen2_5_vl", True, True),
        ("qwen2_5_vl", False, True),
        ("qwen2_5_vl", False, False),
        ("smolvlm", True, True),
        ("smolvlm", False, True),
        # with checkpointing: without it, its Gated DeltaNet layers keep more than the planner counts (it warns)
        ("qwen3_5", True, True),
    ],
)
def test_a_vlm_step_peaks_where_the_plan_says(tmp_path, family, checkpointing, frozen):
    """One real step against the planned tensor peak, within 5%: LoRA on the language model with the vision tower
    frozen (with checkpointing it still runs with grad through SFTTrainer's input-gradient hook), or on the
    vision tower and projector too."""
    from core.measure.vlm_step import measure_vlm

    cfg, folder = _folder(tmp_path, family)
    plan = _plan(folder, IMAGE[family], gradient_checkpointing=checkpointing, vision_frozen=frozen)
    measured = measure_vlm(cfg, plan).steady_peak_bytes
    est = estimate(plan)
    # the frozen tower runs with grad where the input-gradient hook reaches its patch embedding (not Qwen3.5's)
    hooked = vlm_of(load_spec(str(folder))).input_grads
    assert est.vlm["vision_grad"] is ((checkpointing and hooked) or not frozen)
    assert hooked is (family != "qwen3_5")
    assert abs(measured / est.tensor_peak_bytes - 1) <= 0.05, (measured, est.tensor_peak_bytes)


@pytest.mark.parametrize("size", [(1024, 400), (300, 1200), (1024, 1000)])
def test_gemma3_pan_and_scan_crops_as_its_processor_does(tmp_path, size):
    from core.measure.vlm_step import _image, _processor, _tokens_per_image

    folder = _default_folder(tmp_path, "gemma3")
    facts = vlm_of(load_spec(str(folder)))
    plan = Plan(model=str(folder), image_width=size[0], image_height=size[1], pan_and_scan=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _processor(facts, plan)(images=[_image(*size, 0)], return_tensors="pt")
    assert image_tokens(facts, plan).tokens == _tokens_per_image(facts, dict(out), 1)
    assert image_tokens(facts, replace(plan, pan_and_scan=False)).tokens == facts.fixed_tokens


def test_the_vision_terms_are_in_the_bill(tmp_path):
    """Pixels and the frozen tower's checkpointed inputs appear with LoRA + checkpointing, not without it; a trained
    tower adds LoRA on its Linears."""
    _, folder = _folder(tmp_path, "qwen2_5_vl")
    on = estimate(_plan(folder, 448))
    off = estimate(_plan(folder, 448, gradient_checkpointing=False))
    assert on.components["images"] > 0 and on.vlm["vision_activation_bytes"] > 0
    assert off.vlm["vision_activation_bytes"] == 0 and "no activations" in off.vlm["vision_grad_reason"]
    trained = estimate(_plan(folder, 448, vision_frozen=False))
    assert trained.trainable_params > on.trainable_params
    assert on.vlm["image_tokens_per_image"] == 256 and "448x448" in on.vlm["tokens_source"]


def _cli(args) -> tuple[int, str]:
    from core.estimate.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue() + err.getvalue()


def _default_folder(tmp_path, model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = CONFIG_MAPPING[model_type]().to_dict()
    data["model_type"] = model_type
    for key in ("transformers_version", "architectures"):
        data.pop(key, None)
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize(
    "family",
    [
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "gemma3",
        "idefics3",
        "smolvlm",
        "llava",
    ],
)
def test_every_named_family_plans_from_its_default_config(tmp_path, family):
    rc, out = _cli(["--model", str(_default_folder(tmp_path, family)), "--gpu-gb", "80", "--seq-len", "4096"])
    assert rc == 0, out
    assert "image tokens each" in out and "image tokens from:" in out and "Traceback" not in out


def test_a_family_it_cannot_model_is_refused_in_one_sentence(tmp_path):
    rc, out = _cli(["--model", str(_default_folder(tmp_path, "janus"))])
    assert rc == 2 and "not modelled yet" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_image_flags_and_a_bad_size(tmp_path):
    _, folder = _folder(tmp_path, "qwen2_5_vl")
    # 2,048 tokens: the image's ~1,280 placeholders fit (at the default 512 the plan warns that they do not)
    flags = ["--image-size", "1920x1080", "--max-pixels", "1003520", "--seq-len", "2048", "--json"]
    rc, out = _cli(["--model", str(folder), *flags])
    assert rc == 0, out
    vlm = json.loads(out[out.index("{") :])["vlm"]
    assert 0 < vlm["image_tokens_per_image"] <= 1_003_520 // 28**2  # one token per 28 x 28 px at most
    assert vlm["max_pixels"] == 1_003_520 and vlm["image_size"] == "1920x1080"
    rc, out = _cli(["--model", str(folder), "--image-size", "big"])
    assert rc == 2 and "WxH" in out and "Traceback" not in out


def test_a_vlm_run_config_plans(tmp_path):
    from core.estimate.from_config import plan_for_config
    from core.recipe.config import validate_config

    _, folder = _folder(tmp_path, "smolvlm")
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    cfg = validate_config(
        {"model": {"path": str(folder)}, "data": {"path": str(tmp_path / "d.jsonl")}}, here=False
    )
    est = estimate(plan_for_config(cfg, 24, "cuda"))
    assert est.vlm and est.vlm["images_per_row"] == 1
    cfg["data"]["images_per_row"] = 2  # a key the VLM data side may add: read when present
    assert estimate(plan_for_config(cfg, 24, "cuda")).vlm["images_per_row"] == 2


def test_what_would_fit_offers_fewer_pixels_and_images(tmp_path):
    from core.estimate.levers import what_would_fit

    _, folder = _folder(tmp_path, "qwen2_5_vl")
    plan = _plan(folder, 2048, seq_len=8000, images_per_row=2, gpu_gb=0.05, device="cuda")
    advice = what_would_fit(plan)
    pixels = next(a for a in advice if a["change"].startswith("max_pixels"))
    assert pixels["saves_bytes"] > 0 and "less detail" in pixels["costs"]
    fewer = estimate(replace(plan, **pixels["settings"])).vlm["image_tokens_per_image"]
    assert fewer < estimate(plan).vlm["image_tokens_per_image"]
    images = next(a for a in advice if "image(s) per row" in a["change"])
    assert images["saves_bytes"] > 0 and images["settings"]["images_per_row"] < 2


@pytest.mark.slow  # the page's first render imports transformers and peft
def test_the_estimate_page_shows_image_inputs_and_the_vlm_lines():
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(
        str(Path(__file__).resolve().parent.parent / "pages" / "estimate.py"), default_timeout=180
    )
    at.run()
    assert not at.exception
    assert not [
        n for n in at.number_input if n.key == "es_images_per_row"
    ]  # a language model: no image inputs
    at.selectbox(key="es_model").set_value("Qwen/Qwen2.5-VL-7B-Instruct")
    at.run()
    at.number_input(key="es_max_pixels").set_value(1_003_520)
    at.number_input(key="es_image_width").set_value(2048)
    at.run()
    assert not at.exception, at.exception
    lines = "\n".join(i.value for i in at.info)
    assert "image tokens each" in lines and "max_pixels 1,003,520" in lines
