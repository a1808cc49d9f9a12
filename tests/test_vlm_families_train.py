"""Issue #47 item 4: tiny Gemma 4 and LLaVA-OneVision (an any-res family) VLMs, saved with their real processors
(core.demo.toy_vlm_families), train SFT with LoRA through `python -m core.train` on image conversations, merge
verified and are evaluated against their base.

Both processor classes hold a video processor, which transformers builds only with torchvision: without it the
training test skips and the builder says what it needs. Mistral 3 is not here: its PixtralProcessor needs
torchvision too (its image tokens are checked through the PIL image processor in tests/test_vlm_families.py)."""

import importlib.util
import json
import math

import pytest
from safetensors.torch import load_file

from tests.cli import in_process, train
from tests.test_vlm_train import _config

FAMILIES = ("gemma4", "llava_onevision")
VISION = ("vision_tower", "multi_modal_projector", "embed_vision")
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.mark.slow  # per family: a core.train subprocess (~10 s), the merge and the evaluation
@pytest.mark.skipif(not HAS_TORCHVISION, reason="the processors hold a video processor: it needs torchvision")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_family_vlm_trains_merges_and_is_evaluated(family, tmp_path):
    from core import merge
    from core.demo.toy import build_image_dataset
    from core.demo.toy_vlm_families import build_family_vlm
    from core.eval.cli import main as eval_main

    base = build_family_vlm(tmp_path / "base", family)
    data = build_image_dataset(tmp_path / "data", rows=8)
    run_dir = tmp_path / "run"
    done = train(_config(base, data, max_steps=3, logging_steps=1), run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logged if "loss" in m]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    keys = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert keys and all("language_model" in k for k in keys)
    assert not any(part in k for k in keys for part in VISION)  # the vision tower frozen, no LoRA on it

    result = merge.merge_at(str(base), str(run_dir / "adapter"), str(tmp_path / "merged"), dtype="fp32")
    assert result.verification.passed, result.verification.lines()

    out = in_process(eval_main, "--run", run_dir, "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval: answer loss" in out.stdout
    summary = json.loads((run_dir / "eval" / "eval-split" / "summary.json").read_text())["summary"]
    assert summary["rows"] == 2


@pytest.mark.skipif(HAS_TORCHVISION, reason="torchvision is installed: the builder works (the test above)")
@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_builder_says_it_needs_torchvision(family, tmp_path):
    from core.demo.toy_vlm_families import build_family_vlm

    with pytest.raises(ValueError, match="needs torchvision"):
        build_family_vlm(tmp_path / family, family)
    assert not (tmp_path / family).exists()  # nothing half-written


def test_any_res_images_with_different_tile_counts_are_padded_to_one_batch():
    import torch

    from core.recipe.image_column import cat_images

    one, four = torch.ones(1, 1, 3, 4, 4), torch.ones(1, 4, 3, 4, 4)
    batch = cat_images([one, four])
    assert batch.shape == (2, 4, 3, 4, 4)
    assert batch[0, 0].eq(1).all() and batch[0, 1:].eq(0).all() and batch[1].eq(1).all()
    flat = cat_images([torch.ones(3, 8), torch.ones(5, 8)])  # Qwen-VL's patches: rows of one width
    assert flat.shape == (8, 8)
