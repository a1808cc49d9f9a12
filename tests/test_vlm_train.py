"""Vision-language SFT on the CPU as a user runs it (issue #36 item 4): a tiny random LLaVA (CLIP vision tower,
projector, Llama language model) saved with its processor, a generated dataset of coloured PNG squares asked about
in image conversations, `python -m core.train` with LoRA, `python -m core.preflight` naming a broken image by its
row, and the merge of the adapter leaving the vision tower as it was."""

import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import REPO, train

slow = pytest.mark.slow
VISION = ("vision_tower", "multi_modal_projector")


def vlm_run_config(model, data, **training) -> dict:
    """A tiny VLM's LoRA run on `data` (a file, or a Hub id), as the user writes it (not validated)."""
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": str(data), "eval_split": 0.25},
        "training": {"per_device_train_batch_size": 4, "learning_rate": 5e-3, "max_length": 128, **training},
    }


def _config(model: Path, data: Path, **training) -> dict:
    from core.recipe.config import validate_config

    return validate_config(vlm_run_config(model, data, **training))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(root, base model folder, data file): a tiny LLaVA and 16 image conversations."""
    from core.demo.toy import build_image_dataset, build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm")
    return root, build_tiny_vlm(root / "base"), build_image_dataset(root / "data", rows=16)


@pytest.fixture(scope="module")
def vlm_run(vlm):
    root, base, data = vlm
    run_dir = root / "runs" / "vlm"
    done = train(_config(base, data, max_steps=8, logging_steps=1), run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _copy_data(vlm, tmp_path: Path) -> Path:
    _, _, data = vlm
    shutil.copytree(data.parent, tmp_path / "data")
    return tmp_path / "data" / data.name


def _preflight(cfg: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    from core.recipe.config import dump_config

    path = dump_config(cfg, tmp_path / "run.yaml")
    return subprocess.run(
        [sys.executable, "-m", "core.preflight", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_conversation_trains_on_its_answer_alone_not_on_the_prompt_or_the_image_tokens(vlm):
    from core.recipe import vision
    from core.recipe.data import IGNORE_INDEX, load_rows

    _, base, data = vlm
    processor = vision.load_processor(base)
    fmt = vision.ImageChat({"path": str(data)})
    messages = fmt.messages(load_rows({"path": str(data)})[0])
    row = vision.encode(messages, processor, max_length=128)
    ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
    images = [i for i, t in enumerate(ids) if t == processor.image_token_id]
    assert len(images) == 16  # (28 / 7)^2 patches: the processor expanded the one placeholder
    assert all(labels[i] == IGNORE_INDEX for i in images)
    trained = [t for t in labels if t != IGNORE_INDEX]
    assert processor.tokenizer.decode(trained) == "red</s>"  # row 0 asks about a red square
    assert row["pixel_values"].shape == (1, 3, 28, 28)


def test_the_token_lengths_count_each_image_as_the_processor_expands_it(vlm):
    from core.recipe import vision, vision_checks

    _, base, data = vlm
    processor = vision.load_processor(base)
    preview = vision_checks.preview({"path": str(data)}, processor, n=3, length_rows=16, max_length=128)
    assert preview["total_rows"] == 16 and len(preview["lengths"]) == 16
    fmt = vision.ImageChat({"path": str(data)})
    from core.recipe.data import load_rows

    rows = load_rows({"path": str(data)})
    for i in range(3):  # the header-only rule against the processor really run on the image
        assert preview["lengths"][i] == len(vision.encode(fmt.messages(rows[i]), processor)["input_ids"])
        shown = preview["rows"][i]
        assert [Path(p).name for p in shown["images"]] == [f"{i}.png"] and Path(shown["images"][0]).is_file()
        assert shown["image_tokens"] == 16


def test_preflight_names_a_missing_image_by_its_row(vlm, tmp_path):
    _, base, _ = vlm
    data = _copy_data(vlm, tmp_path)
    (data.parent / "imgs" / "2.png").unlink()
    out = _preflight(_config(base, data), tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if "[images]" in line]
    assert (
        len(lines) == 1 and "Row 3:" in lines[0] and "imgs/2.png" in lines[0] and "does not exist" in lines[0]
    )


@slow  # ~20 s: a preflight subprocess
def test_preflight_names_a_truncated_and_a_garbage_image_by_their_rows(vlm, tmp_path):
    _, base, _ = vlm
    data = _copy_data(vlm, tmp_path)
    png = data.parent / "imgs" / "1.png"
    png.write_bytes(png.read_bytes()[: png.stat().st_size // 2])  # a download cut short
    (data.parent / "imgs" / "4.png").write_bytes(b"this is not a PNG")
    out = _preflight(_config(base, data), tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if "[images]" in line]
    assert len(lines) == 2, out.stderr
    assert "Row 2:" in lines[0] and "imgs/1.png" in lines[0] and "cannot be read as an image" in lines[0]
    assert "Row 5:" in lines[1] and "imgs/4.png" in lines[1] and "cannot be read as an image" in lines[1]


@slow
def test_a_tiny_vlm_trains_lora_on_its_language_model_with_the_vision_tower_frozen(vlm_run):
    logged = [json.loads(line) for line in (vlm_run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logged if "loss" in m]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it learns the colours' names
    assert any("eval_loss" in m for m in logged)  # the held-out image rows were evaluated
    assert json.loads((vlm_run / "status.json").read_text())["state"] == "finished"
    adapter = vlm_run / "adapter"
    keys = load_file(str(adapter / "adapter_model.safetensors"))
    assert keys and all("language_model" in k for k in keys)
    assert not any(part in k for k in keys for part in VISION)
    assert (adapter / "processor_config.json").is_file()  # the processor travels with the adapter
    assert any((vlm_run / "checkpoints").glob("checkpoint-*"))


@slow
def test_the_merge_folds_the_adapter_and_leaves_the_vision_tower_byte_identical(vlm, vlm_run, tmp_path):
    from core import merge

    _, base, _ = vlm
    out = tmp_path / "merged"
    result = merge.merge_at(str(base), str(vlm_run / "adapter"), str(out), dtype="fp32")
    assert result.verification.passed, result.verification.lines()
    before, after = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after)
    vision = [k for k in before if any(part in k for part in VISION)]
    assert vision and all(
        before[k].numpy().tobytes() == after[k].numpy().tobytes() for k in vision
    )  # the vision tower and projector as they were
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all("language_model" in k for k in changed)
    assert (out / "processor_config.json").is_file()


def test_the_train_page_previews_image_rows_with_thumbnails_and_passes_preflight(vlm, workspace):
    from streamlit.testing.v1 import AppTest

    _, base, data = vlm
    at = AppTest.from_file(str(REPO / "pages" / "train.py"), default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = {
        "model": {"path": str(base)},
        "data": {"path": str(data), "max_length": 128},
        "training": {"per_device_train_batch_size": 2, "max_steps": 4},
    }
    at.run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert any(s.value.startswith("Preflight: no problems") for s in at.success)
    preview = at.dataframe[0].value
    assert len(preview) == 5 and preview["completion"].iloc[0].startswith("red")
    images = at.get("image")
    assert len(images) == 5  # one thumbnail per shown row's image
    assert [c for i in images for c in i.captions] == [f"row {n}: 16 image tokens" for n in range(1, 6)]
    assert any(c.value.startswith("Images of the first rows") for c in at.caption)
    assert at.get("vega_lite_chart"), "token length histogram"


def test_qlora_quantizes_the_language_model_and_keeps_the_vision_tower_in_its_dtype(vlm):
    import bitsandbytes as bnb

    from core.precision import Device, resolve
    from core.train.model import load_model

    _, base, data = vlm
    cfg = _config(base, data)
    cfg["quantization"] = {**cfg["quantization"], "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    model = load_model(cfg, resolve(cfg, Device.local()))
    linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision = {n: t for n, t in linears.items() if any(part in n for part in VISION)}
    language = {n: t for n, t in linears.items() if "language_model.layers" in n}
    assert vision and all(t is torch.nn.Linear for t in vision.values())
    assert language and all(t is bnb.nn.Linear4bit for t in language.values())


@slow
def test_a_tiny_vlm_trains_with_qlora_on_the_cpu(vlm, tmp_path):
    root, base, data = vlm
    cfg = _config(base, data, max_steps=2, logging_steps=1)
    cfg["quantization"] = {**cfg["quantization"], "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    done = train(cfg, tmp_path / "qlora")
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [json.loads(line) for line in (tmp_path / "qlora" / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in logged if "loss" in m] and all(
        math.isfinite(m["loss"]) for m in logged if "loss" in m
    )
    assert (tmp_path / "qlora" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_full_fine_tune_of_a_vlm_trains_the_language_model_with_the_vision_tower_frozen(vlm):
    from core.precision import Device, resolve
    from core.recipe import vision
    from core.recipe.data import load_rows
    from core.train.model import load_model, make_trainer

    _, base, data = vlm
    cfg = _config(base, data, max_steps=1)
    cfg["lora"] = {**cfg["lora"], "enabled": False}
    prec = resolve(cfg, Device.local())
    processor = vision.load_processor(base)
    train_ds, _ = vision.datasets(cfg, load_rows(cfg["data"]))
    trainer = make_trainer(cfg, prec, load_model(cfg, prec), processor, train_ds)
    grads = {n: p.requires_grad for n, p in trainer.model.named_parameters()}
    assert not any(g for n, g in grads.items() if any(part in n for part in VISION))
    assert all(g for n, g in grads.items() if "language_model.layers" in n)


@slow
def test_the_tuned_vlm_is_evaluated_against_its_base_on_the_held_out_image_rows(vlm_run):
    out = subprocess.run(
        [sys.executable, "-m", "core.eval", "--run", str(vlm_run), "--max-new-tokens", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval: chrF" in out.stdout and "Traceback" not in out.stderr
    summary = json.loads((vlm_run / "eval" / "eval-split" / "summary.json").read_text())["summary"]
    rows = [
        json.loads(line) for line in (vlm_run / "eval" / "eval-split" / "rows.jsonl").read_text().splitlines()
    ]
    assert summary["rows"] == 4 and all(Path(r["images"][0]).is_file() for r in rows)
    assert all(r["reference"] in {"red", "green", "blue", "yellow"} for r in rows)
    # the answer loss over the held-out answers is the trainer's own last eval_loss: the same rows, the same labels
    logged = [json.loads(line) for line in (vlm_run / "metrics.jsonl").read_text().splitlines()]
    last_eval = [m["eval_loss"] for m in logged if "eval_loss" in m][-1]
    tokens = sum(r["n_answer_tokens"] for r in rows)
    tuned = sum(r["tuned_loss_sum"] for r in rows) / tokens
    base = sum(r["base_loss_sum"] for r in rows) / tokens
    assert abs(tuned - last_eval) < 1e-3, (tuned, last_eval)
    assert tuned < base


@slow
def test_launch_on_the_train_page_trains_a_vlm_to_its_adapter(vlm, workspace, request):
    import time

    from streamlit.testing.v1 import AppTest

    from core.runs.launcher import stop_run

    _, base, data = vlm
    at = AppTest.from_file(str(REPO / "dashboard.py"), default_timeout=180)  # Launch switches to the Monitor
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = {
        "model": {"path": str(base), "dtype": "float32"},
        "data": {"path": str(data), "max_length": 128},
        "training": {"per_device_train_batch_size": 2, "max_steps": 3, "logging_steps": 1},
    }
    at.run()
    at.switch_page("pages/train.py").run()
    assert not at.exception, at.exception
    launch = at.button(key="tr_launch")
    assert not launch.disabled, [e.value for e in at.error]
    launch.click().run()
    assert not at.exception, at.exception
    run_dir = Path(at.session_state["monitor_run"])
    request.addfinalizer(lambda: stop_run(run_dir, grace_s=10))  # never leave a trainer behind on failure
    deadline = time.time() + 300
    status = {}
    while time.time() < deadline and status.get("state") not in ("finished", "failed"):
        time.sleep(1)
        with contextlib.suppress(OSError, ValueError):  # not written yet, or mid-write
            status = json.loads((run_dir / "status.json").read_text())
    assert status.get("state") == "finished", (run_dir / "stderr.log").read_text()[-2000:]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "adapter" / "processor_config.json").is_file()


def test_a_smoke_batch_of_image_rows_is_filled_to_max_length_and_trains_the_same_tokens(vlm):
    from core.recipe import vision
    from core.recipe.data import IGNORE_INDEX, load_rows

    _, base, data = vlm
    processor = vision.load_processor(base)
    fmt = vision.ImageChat({"path": str(data)})
    rows = [fmt.text_row(fmt.messages(r)) for r in load_rows({"path": str(data)}).select(range(2))]
    real = vision.ImageCollator(processor, 128)([dict(r) for r in rows])
    filled = vision.ImageCollator(processor, 128, fill=True)([dict(r) for r in rows])
    assert filled["input_ids"].shape == (2, 128) and real["input_ids"].shape[1] < 128
    assert bool(filled["attention_mask"].all())  # the filler is attended to, as a max_length row would be
    width = real["labels"].shape[1]
    assert torch.equal(filled["labels"][:, :width], real["labels"])
    assert bool((filled["labels"][:, width:] == IGNORE_INDEX).all())
    assert torch.equal(filled["pixel_values"], real["pixel_values"])


def _core_train(config: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.train", str(config), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


# a LLaVA tower 256 wide and 4 blocks deep on 56 px images (64 image tokens): its weights, activations and (trained)
# LoRA are a third of the step, not a rounding error next to the language model's
WIDE = dict(
    image_size=56, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4
)


@slow
@pytest.mark.parametrize(
    "tower,model,training",
    [
        (
            "tiny",
            {},
            {},
        ),  # LoRA on the language model, the tower frozen (it still runs with grad: checkpointing)
        ("wide", {}, {}),
        ("wide", {"freeze_vision": False}, {}),  # LoRA on the tower and projector too
        ("wide", {"freeze_vision": False}, {"gradient_checkpointing": False}),  # every block's tensors kept
        ("wide", {"qlora": True}, {}),  # the language model in 4-bit, the tower kept in its dtype
    ],
)
def test_the_smoke_peak_of_a_vlm_is_within_five_percent_of_its_plan(vlm, tmp_path, tower, model, training):
    """`python -m core.train run.yaml --smoke` on a tiny LLaVA: one real step at max_length measured by the tracker
    (smoke.json) against the plan.json the trainer wrote for that step, as for text and MoE models
    (benchmarks/RESULTS.md, the VLM section); and peft's trainable count is the plan's (the tower's LoRA included
    when model.freeze_vision is false)."""
    from core.demo.toy import build_tiny_vlm
    from core.recipe.config import dump_config

    _, base, data = vlm
    if tower == "wide":
        base = build_tiny_vlm(tmp_path / "wide", vision=WIDE)
    cfg = _config(base, data)
    cfg["quantization"]["load_in_4bit"] = bool(model.get("qlora"))
    cfg["model"].update({k: v for k, v in model.items() if k != "qlora"})
    cfg["training"].update(training)
    out = _core_train(
        dump_config(cfg, tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "smoke"), "--smoke"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    smoke = json.loads((tmp_path / "smoke" / "smoke.json").read_text())
    plan = json.loads((tmp_path / "smoke" / "plan.json").read_text())
    assert smoke["state"] == "finished" and smoke["max_length"] == 128 and smoke["measured_by"] == "tracker"
    assert plan["vlm"]["vision_frozen"] is model.get("freeze_vision", True)
    peak, est = smoke["peak_bytes"], smoke["estimate_bytes"]
    assert est == max(v for k, v in plan["phases"].items() if k != "eval") > 0
    assert abs(peak / est - 1) <= 0.05, f"measured {peak} vs planned {est}: {peak / est - 1:+.1%}"
    assert f"trainable params: {plan['trainable_params']:,} " in out.stdout


@slow
def test_the_dry_run_of_a_vlm_prints_its_plan_with_the_datas_largest_image(vlm, tmp_path):
    from PIL import Image

    from core.recipe.config import dump_config

    _, base, data = vlm
    sizes = [Image.open(p).size for p in sorted((data.parent / "imgs").glob("*.png"))]
    w, h = max(sizes, key=lambda s: s[0] * s[1])
    path = dump_config(_config(base, data), tmp_path / "run.yaml")
    out = _core_train(path, "--dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout[out.stdout.index("{") :])
    assert plan["vlm"]["image_size"] == f"{w}x{h}" and plan["vlm"]["images_per_row"] == 1
    assert plan["vlm"]["image_tokens_per_image"] == 16 and plan["tensor_peak_bytes"] > 0
    # the config's own image settings win over the data's
    cfg = _config(base, data)
    cfg["data"].update(image_size="640x480", images_per_row=2)
    out = _core_train(dump_config(cfg, tmp_path / "set.yaml"), "--dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    vlm_record = json.loads(out.stdout[out.stdout.index("{") :])["vlm"]
    assert vlm_record["image_size"] == "640x480" and vlm_record["images_per_row"] == 2


def test_the_run_config_takes_the_image_settings_and_refuses_bad_ones(tmp_path):
    from core.recipe.config import ConfigError, validate_config

    base = {"model": {"path": "m"}, "data": {"path": "d"}}
    cfg = validate_config(
        {
            "model": {"path": "m", "freeze_vision": False},
            "data": {"path": "d", "image_size": "1024x768", "max_pixels": 1_003_520, "images_per_row": 2},
        },
        here=False,
    )
    assert cfg["data"]["image_size"] == "1024x768" and cfg["model"]["freeze_vision"] is False
    assert "image_size" not in validate_config(base, here=False)["data"]  # absent: read from the data
    bad = {
        ("data", "image_size", "1024*768"): "must be WIDTHxHEIGHT",
        ("data", "image_size", "0x768"): "must be WIDTHxHEIGHT",
        ("data", "max_pixels", 0): "must be at least 1",
        ("data", "images_per_row", -1): "must be in [1, 1024]",
        ("data", "image_sizes", "1x1"): "Did you mean data.image_size?",
        ("model", "freeze_vison", False): "Did you mean model.freeze_vision?",
    }
    for (section, key, value), words in bad.items():
        raw = {**base, section: {**base[section], key: value}}
        with pytest.raises(ConfigError, match=re.escape(words)):
            validate_config(raw, here=False)
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: m}\ndata: {path: d, image_size: big}\n")
    out = _core_train(path, "--dry-run")
    assert out.returncode == 2 and "data.image_size must be WIDTHxHEIGHT" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_max_pixels_bounds_a_qwen_image_processor_and_is_ignored_elsewhere(vlm, tmp_path):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from core.recipe import vision

    qwen = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    grid = lambda: qwen(images=[Image.new("RGB", (200, 200))], return_tensors="pt")["image_grid_thw"].tolist()  # noqa: E731
    assert grid() == [[1, 8, 8]]
    vision.set_max_pixels(qwen, 56 * 56 * 2)
    assert grid() == [[1, 4, 4]]  # 200 px squeezed into 6,272 pixels: 56 x 56, 4 x 4 patches of 14
    _, base, data = vlm
    processor = vision.load_processor(base, max_pixels=1000)
    assert not vision.takes_max_pixels(processor.image_processor)  # LLaVA resizes to a fixed size
    cfg = _config(base, data)
    cfg["data"]["max_pixels"] = 1000
    done = _preflight(cfg, tmp_path)
    assert done.returncode == 0 and "data.max_pixels is ignored" in done.stdout


def test_image_settings_on_a_text_model_are_ignored_with_a_warning(tiny_llama, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"instruction": "Say hi", "output": "hi"}\n' * 8)
    cfg = {
        "model": {"path": str(tiny_llama), "freeze_vision": False},
        "data": {"path": str(tmp_path / "d.jsonl"), "image_size": "640x480"},
        "training": {"max_length": 64},
    }
    from core.recipe.config import validate_config

    done = _preflight(validate_config(cfg), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "data.image_size, model.freeze_vision are ignored" in done.stdout and "text model" in done.stdout


@slow
def test_a_tiny_qwen2_5_vl_trains_lora_with_its_vision_tower_frozen(tmp_path):
    # transformers builds a Qwen2.5-VL processor only with torchvision (its video processor); not installed on
    # every machine this suite runs on
    pytest.importorskip("torchvision")
    from core.demo.toy import build_image_dataset, build_tiny_vlm

    base = build_tiny_vlm(tmp_path / "qwen", "qwen2_5_vl")
    data = build_image_dataset(tmp_path / "data", rows=8)
    run_dir = tmp_path / "run"
    done = train(_config(base, data, max_steps=3, logging_steps=1), run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads(line).get("loss") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in losses if x is not None] and all(math.isfinite(x) for x in losses if x is not None)
    keys = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert keys and all("language_model" in k for k in keys) and not any("visual" in k for k in keys)


def test_the_qwen2_5_vl_builder_says_what_it_needs_without_torchvision(tmp_path):
    import importlib.util

    from core.demo.toy import build_tiny_vlm

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the builder works (the training test above)")
    with pytest.raises(ValueError, match="needs torchvision"):
        build_tiny_vlm(tmp_path / "qwen", "qwen2_5_vl")
    assert not (tmp_path / "qwen").exists()  # nothing half-written


def test_an_image_entry_without_a_file_is_named_and_a_path_key_is_read(vlm, tmp_path):
    from core.recipe import vision, vision_checks
    from core.recipe.data import load_rows

    _, base, _ = vlm
    data = _copy_data(vlm, tmp_path)
    rows = [json.loads(line) for line in data.read_text().splitlines()][:4]
    rows[1]["messages"][0]["content"][0] = {"type": "image"}  # as a Hub dataset with an images column has it
    rows[2]["messages"][0]["content"][0] = {"type": "image", "path": "imgs/2.png"}  # transformers' key
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(base, data)
    found = vision_checks.findings(cfg, load_rows(cfg["data"]), vision.load_processor(base))
    errors = [f for f in found if f.level == "error"]
    assert len(errors) == 1 and errors[0].rows == [2], [str(f) for f in found]
    assert errors[0].message.startswith("Row 2: an image entry names no file")


@slow
def test_try_it_asks_the_base_and_the_adapter_about_an_image(vlm, vlm_run):
    from core import merge

    _, base, data = vlm
    picture = data.parent / "imgs" / "1.png"  # a green square
    res = merge.try_adapter(
        base, vlm_run / "adapter", "What colour is this?", max_new_tokens=4, image=picture
    )
    assert "<image>" in res.prompt and "What colour is this?" in res.prompt
    assert isinstance(res.base_text, str) and isinstance(res.adapter_text, str)
    text_only = merge.try_adapter(base, vlm_run / "adapter", "What colour is this?", max_new_tokens=4)
    assert "<image>" not in text_only.prompt  # a VLM answers a text prompt too
    with pytest.raises(merge.MergeError, match="cannot be read"):
        merge.try_adapter(
            base, vlm_run / "adapter", "What colour?", image=data.parent / "imgs" / "missing.png"
        )


@slow
def test_the_merge_page_tries_a_vlm_adapter_on_an_image(vlm, vlm_run, workspace):
    from streamlit.testing.v1 import AppTest

    _, base, data = vlm
    run = workspace / "runs" / "vlm-1"
    run.mkdir(parents=True)
    for name in ("config.yaml", "status.json"):
        shutil.copy(vlm_run / name, run / name)
    shutil.copytree(vlm_run / "adapter", run / "adapter")
    at = AppTest.from_file(str(REPO / "pages" / "merge.py"), default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.run()
    assert not at.exception, at.exception
    assert at.text_input(key=f"merge_base_{run / 'adapter'}").value == str(base)
    at.text_input(key="merge_image").set_value(str(data.parent / "imgs" / "2.png")).run()
    at.text_area(key="merge_prompt").set_value("What colour is this?")
    at.slider(key="merge_max_new").set_value(8)
    at.button(key="merge_try").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert len(at.get("image")) == 1  # the picture asked about
    assert [m.value for m in at.markdown if m.value.startswith("**Base")] == [
        "**Base**",
        "**Base + adapter**",
    ]


@slow  # both pages' first renders import transformers and peft
def test_use_this_plan_carries_the_image_settings_to_the_train_form(vlm, workspace):
    """The Estimate page writes a VLM's image settings as the run config's own keys, and "Use this plan" (the
    handover the Train page reads) brings them into the Train form's config; none for a language model."""
    from streamlit.testing.v1 import AppTest

    from ui.fields import HANDOVER

    est = AppTest.from_file(str(REPO / "pages" / "estimate.py"), default_timeout=180)
    est.run()
    assert not est.exception, est.exception
    assert not any(
        k in est.session_state["estimate_config"]["data"] for k in ("image_size", "images_per_row")
    )
    est.selectbox(key="es_model").set_value("Qwen/Qwen2.5-VL-7B-Instruct")
    est.run()
    est.number_input(key="es_image_width").set_value(2048)
    est.number_input(key="es_max_pixels").set_value(1_003_520)
    est.number_input(key="es_images_per_row").set_value(2)
    est.checkbox(key="es_vision_frozen").uncheck()
    est.run()
    assert not est.exception, est.exception
    handed = est.session_state["estimate_config"]
    assert handed["data"]["image_size"] == "2048x1024" and handed["data"]["max_pixels"] == 1_003_520
    assert handed["data"]["images_per_row"] == 2 and handed["model"]["freeze_vision"] is False
    lines = "\n".join(i.value for i in est.info)
    assert "2 image(s) per row of 2048x1024 px" in lines and "trained" in lines  # the plan read those keys

    _, base, data = vlm
    train = AppTest.from_file(str(REPO / "pages" / "train.py"), default_timeout=180)
    train.session_state["workspace"] = str(workspace)
    train.session_state["train_config"] = _config(base, data)
    train.session_state[HANDOVER] = handed
    train.run()
    assert not train.exception, train.exception
    cfg = train.session_state["train_config"]
    assert cfg["data"]["image_size"] == "2048x1024" and cfg["data"]["images_per_row"] == 2
    assert cfg["data"]["max_pixels"] == 1_003_520 and cfg["model"]["freeze_vision"] is False
    assert cfg["model"]["path"] == str(base)  # the preset is not a local folder: the form keeps its model
    caption = next(c.value for c in train.caption if c.value.startswith("Prefilled from"))
    assert "data.image_size" in caption


def test_plan_to_config_writes_a_vlm_plans_images_back_as_the_run_configs_keys(vlm):
    from dataclasses import asdict, replace

    from core.estimate.from_config import plan_for_config, plan_to_config

    _, base, data = vlm
    cfg = _config(base, data)
    plan = replace(
        plan_for_config(cfg, 24, "cuda"),
        image_width=640,
        image_height=480,
        images_per_row=2,
        max_pixels=200_704,
        vision_frozen=False,
    )
    back = plan_to_config(asdict(plan), cfg)
    assert back["data"]["image_size"] == "640x480" and back["model"]["freeze_vision"] is False
    assert plan_for_config(back, 24, "cuda") == plan  # the inverse of the one mapping


@slow
def test_freeze_vision_false_trains_lora_on_the_tower_and_the_merge_folds_it_there(vlm, tmp_path):
    from core import merge

    _, base, data = vlm
    cfg = _config(base, data, max_steps=3, logging_steps=1)
    cfg["model"]["freeze_vision"] = False
    run_dir = tmp_path / "run"
    done = train(cfg, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    keys = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for part in (*VISION, "language_model"):
        assert any(part in k for k in keys), (
            part
        )  # LoRA on the tower and projector, and on the language model
    result = merge.merge_at(str(base), str(run_dir / "adapter"), str(tmp_path / "merged"), dtype="fp32")
    assert result.verification.passed, result.verification.lines()
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(tmp_path / "merged" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("vision_tower" in k for k in changed) and any("language_model" in k for k in changed)
