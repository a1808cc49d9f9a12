"""A model folder's config.json read as transformers reads it: a config that transformers itself saved (its tagged
non-finite floats, `{"__float__": "Infinity"}`, in every Mamba-2 family's time_step_limit) gives the planner the same
config `AutoConfig.from_pretrained` gives, and plans; the decoding never touches anything but the tags."""

import json
import math

import pytest

from core.estimate.model_config import load_model_config
from core.files import decode_config_floats
from tests.test_estimate_cli import estimate_main

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2)
# the families whose default config holds inf (time_step_limit = (0.0, inf)): saved tagged by transformers 5
MAMBA_FAMILIES = {
    "mamba2": dict(TINY, num_heads=8, head_dim=16, n_groups=1, state_size=16),
    "bamba": dict(
        TINY,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        attn_layer_indices=[1],
    ),
    "granitemoehybrid": dict(
        TINY,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        layer_types=["mamba", "attention"],
    ),
}


def saved_by_transformers(tmp_path, model_type: str):
    from transformers import AutoConfig

    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **MAMBA_FAMILIES[model_type]).save_pretrained(folder)
    assert '"__float__"' in (folder / "config.json").read_text()  # what this test is about
    return folder


@pytest.mark.parametrize("model_type", sorted(MAMBA_FAMILIES))
def test_a_config_transformers_saved_reads_as_autoconfig_reads_it_and_plans(tmp_path, model_type):
    from transformers import AutoConfig

    folder = saved_by_transformers(tmp_path, model_type)
    ours = load_model_config(str(folder)).to_dict()
    theirs = AutoConfig.from_pretrained(folder).to_dict()
    ours.pop("_name_or_path"), theirs.pop("_name_or_path")  # where it was read from, nothing else
    assert ours == theirs
    assert math.isinf(ours["time_step_limit"][1])
    if (
        model_type == "mamba2"
    ):  # no attention layer at all: the per-layer planner's (tests/test_layer_plan.py)
        return
    proc = estimate_main("--model", str(folder), "--json", "--gpu-gb", "24", "--lora-r", "4")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["trainable_params"] > 0


def test_only_transformers_float_tags_are_decoded_and_the_input_is_left_as_it_was():
    fields = {
        "a": {"__float__": "Infinity"},
        "b": [0.0, {"__float__": "-Infinity"}, {"__float__": "NaN"}],
        "c": {"__float__": "1e400"},  # not a tag transformers writes: kept as it is, as transformers keeps it
        "d": {"__float__": "Infinity", "other": 1},
        "e": {"nested": [{"__float__": "Infinity"}]},
    }
    before = json.dumps(fields)
    out = decode_config_floats(fields)
    assert out["a"] == math.inf and out["b"][1] == -math.inf and math.isnan(out["b"][2])
    assert out["c"] == {"__float__": "1e400"} and out["d"] == {"__float__": "Infinity", "other": 1}
    assert out["e"]["nested"][0] == math.inf
    assert json.dumps(fields) == before  # a cached preset dict is never edited in place


def test_a_deeply_nested_config_decodes_without_exhausting_the_stack():
    deep = current = {}
    for _ in range(100_000):
        current["x"] = {}
        current = current["x"]
    current["x"] = {"__float__": "Infinity"}
    out = decode_config_floats(deep)
    for _ in range(100_001):
        out = out["x"]
    assert out == math.inf
