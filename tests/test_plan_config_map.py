"""The Plan <-> run config mapping (issue #38 item 2), recorded: for a broad set of run configs (every method x full /
LoRA / QLoRA x levers, a VLM and a mixture-of-experts model) the Plan plan_for_config gives, the config
plan_to_config gives back (on the config itself, on a bare base, and for a plan dict in the aliases pages and old
plan.json files use), all compared with tests/data/plan_config_map.json; and config -> plan -> config -> plan is a
fixed point. PLAN_CONFIG_MAP_RECORD=1 rewrites the record (only where the mapping is meant to change)."""

import copy
import json
import os
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest

from core.estimate.from_config import plan_for_draft, plan_to_config
from core.estimate.plan import Plan, upgraded

RECORD = Path(__file__).parent / "data" / "plan_config_map.json"
LLAMA = "meta-llama/Llama-2-7b-hf"
REWARDS = [{"type": "match", "column": "answer"}]
TUNINGS = {
    "full": {"lora": {"enabled": False}},
    "lora": {},
    "qlora": {"quantization": {"load_in_4bit": True, "bnb_4bit_use_double_quant": False}},
}
# levers: what a run config can say that the plan reads (the first is none)
LEVERS = {
    "plain": {},
    "levers": {
        "training": {
            "padding_free": True,
            "activation_offloading": True,
            "gradient_checkpointing": False,
            "optim": "paged_adamw_8bit",
            "per_device_train_batch_size": 4,
        },
        "model": {"attn_implementation": "flash_attention_2", "dtype": "bfloat16"},
        "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},
    },
    "packing-fp16-eval": {
        "training": {
            "packing": True,
            "packing_strategy": "wrapped",
            "bf16": False,
            "fp16": True,
            "per_device_eval_batch_size": 3,
            "eval_samples": 2,
        },
        "data": {"eval_split": 0.1},
        "quantization": {"bnb_4bit_quant_type": "fp4"},
    },
    "fp32-eager-gpus": {
        "training": {"bf16": False, "max_length": 300},
        "model": {"attn_implementation": "eager"},
        "distributed": {"gpus": 2, "strategy": "fsdp", "cpu_offload": True},
    },
    "liger-flex": {  # liger is not installed here: planned for another machine (an unvalidated config back)
        "training": {"use_liger_kernel": True, "disable_dropout": False},
        "model": {"attn_implementation": "flex_attention", "reference_path": "ref/model"},
    },
}
METHOD_TRAINING = {
    "sft": {},
    "dpo": {"precompute_ref_log_probs": True},
    "kto": {},
    "grpo": {
        "num_generations": 4,
        "max_prompt_length": 128,
        "max_completion_length": 64,
        "beta": 0.04,
        "steps_per_generation": 2,
        "num_generations_eval": 2,
    },
}


def _merge(raw: dict, extra: dict) -> dict:
    out = copy.deepcopy(raw)
    for section, values in extra.items():
        out.setdefault(section, {}).update(copy.deepcopy(values))
    return out


def _raw(model: str, method: str, tuning: str, lever: str) -> dict:
    raw = {"method": method, "model": {"path": model}, "data": {"path": "unused.jsonl"}}
    if method == "grpo":
        raw["rewards"] = REWARDS
    raw = _merge(raw, {"training": METHOD_TRAINING[method]})
    raw = _merge(raw, TUNINGS[tuning])
    raw = _merge(raw, LEVERS[lever])
    if method == "grpo" and lever == "fp32-eager-gpus":
        raw["training"].pop("max_length")  # GRPOConfig has none
    if method != "sft":  # SFTConfig's own keys
        for key in ("packing", "packing_strategy", "padding_free"):
            raw["training"].pop(key, None)
    if method not in ("dpo", "kto"):
        raw["training"].pop("disable_dropout", None)
        raw["model"].pop("reference_path", None)
    if method == "grpo":  # GRPOConfig has none of these
        for key in ("eval_samples", "activation_offloading"):
            raw["training"].pop(key, None)
    return raw


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A VLM's and a mixture-of-experts model's config.json (all the planner reads of a model folder here)."""
    from core.demo.toy import tiny_config
    from core.demo.toy_vlm import tiny_vlm_config

    root = tmp_path_factory.mktemp("models")
    tiny_vlm_config("smolvlm").save_pretrained(root / "vlm")
    tiny_config("qwen3_moe", num_hidden_layers=2).save_pretrained(root / "moe")
    return root


def cases(models: Path) -> dict[str, dict]:
    out = {
        f"{method}-{tuning}-{lever}": _raw(LLAMA, method, tuning, lever)
        for method in METHOD_TRAINING
        for tuning in TUNINGS
        for lever in LEVERS
    }
    for method in ("sft", "dpo"):
        for tuning in ("lora", "qlora"):
            out[f"vlm-{method}-{tuning}"] = _merge(
                _raw(str(models / "vlm"), method, tuning, "plain"),
                {
                    "data": {"image_size": "640x480", "max_pixels": 200_704, "images_per_row": 2},
                    "model": {"freeze_vision": False},
                },
            )
        out[f"vlm-{method}-defaults"] = _raw(str(models / "vlm"), method, "lora", "plain")
        out[f"moe-{method}-qlora"] = _merge(
            _raw(str(models / "moe"), method, "qlora", "plain"),
            {
                "lora": {
                    "target_modules": ["q_proj", "v_proj"],
                    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                }
            },
        )
    return out


def _here(raw: dict) -> bool:
    """Can this machine validate the config (plan_to_config validates a config with both paths)?"""
    return not raw["training"].get("use_liger_kernel")


def _base(cfg: dict, raw: dict) -> dict:
    return cfg if _here(raw) else {**cfg, "data": {**cfg["data"], "path": None}}


def _bare(raw: dict) -> dict:
    """A base that says little: the model, the data and the method (plan_to_config writes the rest)."""
    out = {
        "method": raw["method"],
        "model": {"path": LLAMA},
        "data": {"path": "unused.jsonl" if _here(raw) else None},
    }
    if raw["method"] == "grpo":
        out["rewards"] = REWARDS
    return out


def _aliased(plan: Plan) -> dict:
    """The plan as a dict in the other names plan_to_config reads (old plan.json files, the pages' own dicts)."""
    d = asdict(plan)
    renames = {
        "batch_size": "micro_batch_size",
        "attn": "attn_implementation",
        "load_dtype": "dtype",
        "quant_type": "bnb_4bit_quant_type",
    }
    if plan.method != "grpo":
        renames["seq_len"] = "max_length"
    for old, new in renames.items():
        d[new] = d.pop(old)
    d["lora"] = {
        "r": d.pop("lora_r"),
        "alpha": d.pop("lora_alpha"),
        "dropout": d.pop("lora_dropout"),
        "target_modules": d.pop("target_modules"),
        "target_parameters": d.pop("target_parameters"),
    }
    d.pop("compute_dtype")  # the load dtype stands for it
    return d


# What a plan takes from the config beyond its own settings: whether the run evaluates (data.eval_split), a
# preference method's reference model and dropout (model.reference_path, training.disable_dropout). A bare base
# has none of these, so a plan written into one gives them back as the defaults do.
FROM_THE_BASE = ("eval_batch_size", "eval_samples", "eval_generations", "reference", "lora_dropout")


def _plan(cfg: dict) -> Plan:
    return plan_for_draft(cfg, 24.0, "cuda")


def _same(a: Plan, b: Plan, where: str, skip=()):
    diff = {
        f.name: (getattr(a, f.name), getattr(b, f.name))
        for f in fields(Plan)
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)
    }
    assert not diff, f"{where}: {diff}"


def _flat(d: dict) -> dict:
    return {
        f"{k}.{sub}" if isinstance(v, dict) else k: sv
        for k, v in d.items()
        for sub, sv in (v.items() if isinstance(v, dict) else [(None, v)])
    }


def _delta(got: dict, reference: dict) -> dict:
    """`got` as the keys (section.key) where it differs from `reference`; "<absent>" for a key it lacks."""
    got, reference = _flat(got), _flat(reference)
    out = {k: v for k, v in got.items() if k not in reference or reference[k] != v}
    return {**out, **{k: "<absent>" for k in reference if k not in got}}


def _record(models: Path) -> dict:
    from core.recipe.config import default_config, validate_config

    default = default_config()

    out = {}
    for name, raw in cases(models).items():
        cfg = validate_config(raw, here=False)
        plan = _plan(cfg)
        back = plan_to_config(plan, _base(cfg, raw))
        edited = replace(
            plan,
            batch_size=plan.batch_size + 1,
            seq_len=plan.seq_len + 64,
            attn="flash",
            compute_dtype="fp16",
            gradient_checkpointing=not plan.gradient_checkpointing,
            lora_r=64,
            optim="adamw_torch_fused",
            gpus=4,
            strategy="fsdp",
        )
        out[name] = {
            "plan": _delta(asdict(plan), asdict(Plan())),
            "config": _delta(back, default),
            "bare": _delta(plan_to_config(plan, _bare(raw)), default),
            "edited": _delta(plan_to_config(edited, _base(cfg, raw)), default),
            "aliased": _delta(plan_to_config(_aliased(plan), _bare(raw)), default),
        }
    text = json.dumps(out, indent=1, sort_keys=True, default=str)
    return json.loads(text.replace(str(models), "<models>"))


def test_the_mapping_is_what_was_recorded(models):
    got = _record(models)
    if os.environ.get("PLAN_CONFIG_MAP_RECORD"):
        RECORD.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(RECORD.read_text())
    assert sorted(got) == sorted(want)
    for name in want:
        want[name]["plan"] = upgraded(want[name]["plan"])  # recorded in the plan's names before #48
        for part in want[name]:
            assert got[name][part] == want[name][part], f"{name}: {part}"


def test_config_plan_config_plan_is_a_fixed_point(models):
    from core.recipe.config import validate_config

    for name, raw in cases(models).items():
        cfg = validate_config(raw, here=False)
        plan = _plan(cfg)
        back = plan_to_config(plan, _base(cfg, raw))
        _same(_plan(back), plan, f"{name}: config -> plan -> config -> plan")
        _same(_plan(plan_to_config(plan, _bare(raw))), plan, f"{name}: on a bare base", FROM_THE_BASE)
        again = plan_to_config(_plan(back), back)
        assert again == back, f"{name}: plan -> config is not idempotent"


def test_the_table_names_every_plan_field_once_and_each_key_once():
    from core.estimate.config_map import DERIVED, ROWS, RUN

    named = [row.field for row in ROWS] + [row.also for row in ROWS if row.also] + list(DERIVED) + list(RUN)
    assert sorted(named) == sorted(f.name for f in fields(Plan))  # every field, none twice
    keys = [row.key for row in ROWS]
    assert len(keys) == len(set(keys))  # one config key, one plan field
