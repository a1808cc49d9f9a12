"""Run config: defaults, strict validation with key paths, YAML round trip, the planner's plan mapping."""

import pytest
import yaml

from core.estimate.from_config import plan_to_config
from core.recipe.config import ConfigError, default_config, dump_config, load_config, validate_config


def minimal(**sections):
    cfg = {"model": {"path": "some/model"}, "data": {"path": "data.jsonl"}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def test_defaults_fill_every_section():
    cfg = validate_config(minimal())
    assert set(cfg) == {"method", "model", "quantization", "lora", "data", "training", "distributed"}
    assert cfg["lora"]["r"] == default_config()["lora"]["r"]
    assert cfg["model"]["path"] == "some/model"


@pytest.mark.parametrize(
    "sections, path",
    [
        (
            {"training": {"learning_rat": 1e-4}},
            "training.learning_rat: unknown key. Did you mean training.learning_rate?",
        ),
        ({"lora": {"r": 0}}, "lora.r must be in [1, 4096]"),
        ({"lora": {"lora_dropout": 1.0}}, "lora.lora_dropout must be in [0, 1)"),
        ({"training": {"learning_rate": -1}}, "training.learning_rate must be in (0, 1]"),
        ({"training": {"optim": "adamw_magic"}}, "training.optim must be one of"),
        (
            {"training": {"per_device_train_batch_size": 2.5}},
            "training.per_device_train_batch_size must be a whole",
        ),
        ({"training": {"max_steps": 0}}, "training.max_steps must be -1"),
        (
            {"quantization": {"bnb_4bit_quant_type": "int4"}},
            "quantization.bnb_4bit_quant_type must be one of",
        ),
        ({"data": {"columns": {"answer": "output"}}}, "data.columns has unknown key 'answer'"),
        ({"training": {"max_length": 4}}, "training.max_length must be in [8, 1048576]"),
        ({"model": {"dtype": "float8"}}, "model.dtype must be one of"),
        ({"lora": {"use_rslora": "yes"}}, "lora.use_rslora must be true or false"),
    ],
)
def test_bad_values_name_the_key_path(sections, path):
    with pytest.raises(ConfigError) as err:
        validate_config(minimal(**sections))
    assert path in str(err.value)


def test_unknown_section_and_missing_paths():
    with pytest.raises(ConfigError, match="optimizer: unknown section"):
        validate_config(minimal(optimizer={"lr": 1}))
    with pytest.raises(ConfigError, match="model.path is required"):
        validate_config({"data": {"path": "x.jsonl"}})
    with pytest.raises(ConfigError, match="data.path is required"):
        validate_config({"model": {"path": "m"}})


def test_conflicting_flags():
    with pytest.raises(ConfigError, match="bf16 and training.fp16"):
        validate_config(minimal(training={"bf16": True, "fp16": True}))
    with pytest.raises(ConfigError, match="load_in_4bit needs lora.enabled"):
        validate_config(minimal(quantization={"load_in_4bit": True}, lora={"enabled": False}))


def test_yaml_round_trip_and_errors(tmp_path):
    cfg = validate_config(minimal(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    path = dump_config(cfg, tmp_path / "run.yaml")
    assert load_config(path) == cfg
    assert not list(tmp_path.glob(".*tmp"))  # no temp file left behind
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(minimal(training={"epochs": 3})))
    with pytest.raises(ConfigError, match="training.epochs: unknown key"):
        load_config(tmp_path / "typo.yaml")


def test_plan_to_config_maps_qlora_plan():
    plan = {
        "tuning": "qlora",
        "lora_r": 32,
        "lora_alpha": 64,
        "lora_dropout": 0.1,
        "target_modules": ["q_proj", "k_proj"],
        "batch_size": 8,
        "seq_len": 1024,
        "gradient_checkpointing": True,
        "attn": "sdpa",
        "optim": "paged_adamw_8bit",
        "load_dtype": "bf16",
        "quant_type": "nf4",
        "double_quant": False,
    }
    cfg = plan_to_config(plan, base=minimal())
    assert cfg["model"]["path"] == "some/model"  # the plan named no model: the base's stays
    assert cfg["quantization"]["load_in_4bit"] is True
    assert cfg["quantization"]["bnb_4bit_use_double_quant"] is False
    assert (cfg["lora"]["r"], cfg["lora"]["lora_alpha"], cfg["lora"]["lora_dropout"]) == (32, 64, 0.1)
    assert cfg["lora"]["target_modules"] == ["q_proj", "k_proj"]
    assert cfg["training"]["per_device_train_batch_size"] == 8
    assert cfg["training"]["gradient_checkpointing"] is True
    assert cfg["training"]["optim"] == "paged_adamw_8bit"
    assert cfg["training"]["max_length"] == 1024
    assert cfg["model"]["dtype"] == "bfloat16"
    assert cfg["quantization"]["bnb_4bit_compute_dtype"] == "bfloat16"


def test_plan_to_config_takes_the_estimate_plan_dataclass():
    estimate = pytest.importorskip("core.estimate.bill")
    plan = estimate.Plan(
        model="org/model-7b", tuning="qlora", lora_r=8, batch_size=4, seq_len=512, compute_dtype="fp16"
    )
    cfg = plan_to_config(plan.to_dict(), base=minimal())
    assert cfg["model"]["path"] == "org/model-7b"
    assert cfg["quantization"]["load_in_4bit"] is True
    assert (
        cfg["lora"]["r"],
        cfg["training"]["per_device_train_batch_size"],
        cfg["training"]["max_length"],
    ) == (
        8,
        4,
        512,
    )
    assert cfg["training"]["fp16"] is True and cfg["training"]["bf16"] is False
    assert plan_to_config(plan, base=minimal()) == cfg  # the dataclass itself works too


def test_plan_to_config_tolerates_missing_keys_and_objects():
    class Plan:  # stands in for core.estimate.bill.Plan: attribute access, most fields absent
        tuning = "full"
        batch_size = 2

    cfg = plan_to_config(Plan(), base=minimal())
    assert cfg["lora"]["enabled"] is False
    assert cfg["training"]["per_device_train_batch_size"] == 2
    assert cfg["lora"]["r"] == default_config()["lora"]["r"]
    partial = plan_to_config({})  # no base paths: an unvalidated dict the page completes
    assert partial["model"]["path"] is None


# ---- the config is the libraries' own schema (issue #10) ------------------------------------------------------


def test_training_takes_every_sft_config_key_users_set():
    """Keys of TrainingArguments/SFTConfig that the old 19-key whitelist refused."""
    cfg = validate_config(
        minimal(
            training={
                "dataloader_num_workers": 0,
                "report_to": "none",
                "seed": 7,
                "per_device_eval_batch_size": 2,
                "neftune_noise_alpha": 5.0,
                "packing": True,
                "lr_scheduler_kwargs": {"min_lr": 1e-6},
            }
        )
    )
    assert cfg["training"]["neftune_noise_alpha"] == 5.0 and cfg["training"]["packing"] is True


def test_keys_from_other_tools_and_older_releases_read_under_todays_names():
    cfg = validate_config(
        minimal(training={"group_by_length": True, "max_seq_length": 256, "evaluation_strategy": "no"})
    )
    assert cfg["training"]["train_sampling_strategy"] == "group_by_length"  # transformers 5's name
    assert cfg["training"]["max_length"] == 256 and cfg["training"]["eval_strategy"] == "no"
    legacy = validate_config({"model": {"path": "m"}, "data": {"path": "d", "max_length": 96}})
    assert legacy["training"]["max_length"] == 96 and "max_length" not in legacy["data"]


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"training": {"output_dir": "/tmp/x"}}, "training.output_dir is set by the engine"),
        ({"training": {"resume_from_checkpoint": True}}, "--resume"),
        ({"training": {"r": 8}}, "r belongs in the lora section (lora.r)"),
        ({"training": {"lr": 1e-4}}, "It is called training.learning_rate here"),
        (
            {"lora": {"lora_alpha": 16.5}},
            "lora.lora_alpha must be a whole number",
        ),  # the planner refused it later
        ({"training": {"lr_scheduler_type": "cosin"}}, "Did you mean 'cosine'?"),
        ({"training": {"report_to": 3}}, "training.report_to must be"),
        ({"trainig": {}}, "Did you mean training?"),
    ],
)
def test_problems_come_back_as_one_sentence_with_the_key_path(sections, message):
    with pytest.raises(ConfigError) as err:
        validate_config(minimal(**sections))
    assert message in str(err.value)


def test_method_is_checked():
    with pytest.raises(ConfigError, match="method must be one of sft"):
        validate_config({**minimal(), "method": "ppo"})


def test_yaml_numbers_without_a_dot_and_full_round_trip(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "model: {path: m}\ndata: {path: d.jsonl}\ntraining: {learning_rate: 2e-4, warmup_steps: 10}\n"
    )
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg["training"]["learning_rate"] == 2e-4  # YAML 1.1 reads 2e-4 as a string
    dumped = dump_config(cfg, tmp_path / "again.yaml")
    assert load_config(dumped) == cfg and yaml.safe_load(dumped.read_text()) == cfg


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    (tmp_path / "bomb.yaml").write_text(bomb)
    with pytest.raises(ConfigError, match="alias"):
        load_config(tmp_path / "bomb.yaml")


def test_a_number_too_long_for_python_is_one_sentence(tmp_path):
    """A 5,000-digit integer: Python refuses to convert it (ValueError inside the YAML reader); one sentence."""
    (tmp_path / "long.yaml").write_text("model: {path: m}\ntraining: {max_steps: 1" + "0" * 4999 + "}\n")
    with pytest.raises(ConfigError, match="holds a number of more than 4,300 digits"):
        load_config(tmp_path / "long.yaml")


def test_the_libraries_check_the_combination(tmp_path):
    from core.recipe.config import check_with_libraries

    check_with_libraries(validate_config(minimal(training={"packing": True, "packing_strategy": "bfd"})))
    with pytest.raises(ConfigError, match="^training: "):
        check_with_libraries(
            validate_config(
                minimal(
                    training={
                        "eval_strategy": "steps",
                        "load_best_model_at_end": True,
                        "save_strategy": "epoch",
                    }
                )
            )
        )


def test_schema_is_read_from_the_installed_libraries():
    import dataclasses

    from trl import SFTConfig

    from core.recipe.config import section_schema
    from core.recipe.config_keys import OWN_TRAINING, OWNED

    sft_fields = {f.name for f in dataclasses.fields(SFTConfig) if f.init}
    # the library's fields less the engine's, plus the cockpit's own (training.eval_samples)
    assert set(section_schema("training")) == (sft_fields - set(OWNED["training"])) | set(OWN_TRAINING)


def test_an_old_and_a_new_spelling_of_one_key_are_refused_not_dropped():
    """Issue #21 item 19: max_length and max_seq_length together kept one silently."""
    from core.recipe.config import ConfigError, validate_config

    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    with pytest.raises(
        ConfigError, match=r"training.max_seq_length and training.max_length are both set \(256 and 128\)"
    ):
        validate_config({**base, "training": {"max_length": 128, "max_seq_length": 256}})
    assert validate_config({**base, "training": {"max_seq_length": 256}})["training"]["max_length"] == 256
