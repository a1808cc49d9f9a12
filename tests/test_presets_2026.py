"""Issue 46 item 7: the bundled presets of the families users pick in 2026 (Qwen3.5, Qwen3-Next, Gemma 4, Llama 4
Scout, Nemotron-H) plan offline through the CLI, and the planner's parameter count of each is within 5% of the size
its publisher gives.

Each preset is the published config.json of its model, read from a copy in a public GitHub repository (the address
below), less bookkeeping keys (architectures, dtype, transformers_version, initializer_range, use_cache, auto_map,
quantization_config). Gemma 4 and Llama 4 Scout are published as vision-language models whose image side this
planner does not model yet: their presets are the config.json's text_config, the language model a text fine-tune
trains, so their counts leave the vision tower out. The Qwen3.5 presets are the whole published vision-language
config, as the Qwen2.5-VL preset is. Where the published figure is the Hub's safetensors count it also holds
weights transformers does not build (Qwen3.5's multi-token-prediction layer), so those plans count a little less.
"""

import json

import pytest

from tests.test_estimate_cli import estimate_main

AIC = "https://github.com/ai-dynamo/aiconfigurator/blob/095f58a51c4ca8e61b66ec108d86f223f8d559ce/aic-core/src/aiconfigurator_core/model_configs/"

# preset id: (published total parameters, where that figure is published, the config.json the preset was read from)
PUBLISHED = {
    "Qwen/Qwen3.5-2B": (
        2.27e9,
        "the Hub's safetensors count of Qwen/Qwen3.5-2B, 2.27B",
        "https://github.com/SiliconBadgers/architecture/blob/442d2344bbd761784ded47cacf16e38814dbf3a0/research/"
        "2026-10-02-vector-control/inputs/2B.json (a copy of huggingface.co/Qwen/Qwen3.5-2B/blob/main/config.json)",
    ),
    "Qwen/Qwen3.5-27B": (
        27.78e9,
        "the Hub's safetensors count of Qwen/Qwen3.5-27B at fc05daec, 27.78B",
        AIC + "Qwen--Qwen3.5-27B_config.json",
    ),
    "Qwen/Qwen3.5-35B-A3B": (
        35.95e9,
        "the Hub's safetensors count of Qwen/Qwen3.5-35B-A3B at 59d61f3c, 35.95B",
        AIC + "Qwen--Qwen3.5-35B-A3B_config.json",
    ),
    "Qwen/Qwen3-Next-80B-A3B-Thinking": (
        80e9,
        "the model card: 80B parameters in total, 3B activated",
        "https://github.com/ai-dynamo/aiconfigurator/blob/1b7cfb10a6fa06880ad7911db5ddb949882ff76a/src/"
        "aiconfigurator/model_configs/Qwen--Qwen3-Next-80B-A3B-Thinking_config.json",
    ),
    "google/gemma-4-26B-A4B": (
        25.81e9,
        "the Hub's safetensors count of google/gemma-4-26B-A4B-it (the same architecture) at 4d7ae498, 25.81B",
        AIC + "google--gemma-4-26B-A4B_config.json (text_config)",
    ),
    "google/gemma-4-31B-it": (
        31.27e9,
        "the Hub's safetensors count of google/gemma-4-31B-it at 842da379, 31.27B",
        AIC
        + "nvidia--Gemma-4-31B-IT-NVFP4_config.json (text_config; NVIDIA's NVFP4 checkpoint of the model, its "
        "quantization_config left out)",
    ),
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": (
        108.64e9,
        "the Hub's safetensors count of meta-llama/Llama-4-Scout-17B-16E-Instruct at 92f3b159, 108.64B",
        AIC + "meta-llama--Llama-4-Scout-17B-16E-Instruct_config.json (text_config)",
    ),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (
        31.58e9,
        "the Hub's safetensors count of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 at bf77c317, 31.58B",
        AIC + "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16_config.json",
    ),
    "nvidia/Nemotron-H-56B-Base-8K": (
        56e9,
        "the model's name and NVIDIA's Nemotron-H family table: 56B",
        AIC + "nvidia--Nemotron-H-56B-Base-8K_config.json",
    ),
}


def test_every_2026_preset_is_bundled():
    from core.estimate.specs import preset_ids

    assert set(PUBLISHED) <= set(preset_ids())


@pytest.mark.parametrize("model", list(PUBLISHED))
def test_a_2026_preset_plans_offline_at_its_published_size(model):
    proc = estimate_main("--model", model, "--gpu-gb", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    published, where, _config = PUBLISHED[model]
    assert abs(out["total_params"] / published - 1) <= 0.05, (model, out["total_params"], where)
    assert out["model_source"].startswith("model numbers from: the bundled preset"), out["model_source"]
