"""The Train page's GRPO form through AppTest (issue #34 item 1): GRPO as a method with its own fields, the
reward-functions editor (presets with settings and weights, the user's own code only with its tick box), the
prompts preview with their answers, preflight, "Use the demo's prompts" (its warm start built by a background job),
and the YAML round trip. On the tiny local model and a small prompts file."""

import time
from pathlib import Path

import pytest

from core.recipe.config import config_to_yaml, validate_config
from tests.test_page_train import _files, _page


def grpo_form_config(model: Path, data: Path, **over) -> dict:
    return {
        "method": "grpo",
        "model": {"path": str(model)},
        "data": {"path": str(data)},
        "rewards": [{"type": "match", "column": "answer"}],
        "training": {
            "per_device_train_batch_size": 4,
            "num_generations": 2,
            "max_completion_length": 8,
            "max_steps": 4,
        },
        **over,
    }


def _errors(at) -> list[str]:
    return [e.value for e in at.error]


def test_grpo_shows_its_fields_its_prompts_with_answers_and_preflight(workspace, tiny_llama, prompts):
    at = _page(workspace, grpo_form_config(tiny_llama, prompts))
    assert "GRPO (prompts + reward functions)" in at.radio(key="tr_method").options
    assert at.radio(key="tr_method").value == "grpo"
    assert not _errors(at), _errors(at)
    for key, value in (("tr_num_generations", 2), ("tr_max_completion_length", 8), ("tr_beta", 0.0)):
        assert at.number_input(key=key).value == value
    assert at.selectbox(key="tr_loss_type").value == "dapo" and at.checkbox(key="tr_log_completions").value
    assert at.number_input(
        key="tr_max_length"
    ).disabled  # GRPO's lengths are its prompt and completion fields
    assert "max_length" not in at.session_state["train_config"]["training"]
    preview = next(d.value for d in at.dataframe if "prompt" in d.value.columns)
    assert list(preview.columns) == ["prompt", "answer"] and preview["answer"].iloc[0] == "ABC"
    rows = len(prompts.read_text().splitlines())
    assert any(c.value.startswith(f"{rows} prompts. GRPO:") for c in at.caption)
    assert any(s.value.startswith("Preflight: no problems") for s in at.success)
    assert not at.button(key="tr_launch").disabled


def test_a_reward_reading_a_column_the_data_lacks_is_a_preflight_error(workspace, tiny_llama, prompts):
    cfg = grpo_form_config(tiny_llama, prompts, rewards=[{"type": "match", "column": "solution"}])
    at = _page(workspace, cfg)
    assert any(
        "**reward_column**" in e
        and "'solution', which the data does not have (its columns: prompt, answer)" in e
        for e in _errors(at)
    ), _errors(at)
    assert at.button(key="tr_launch").disabled


def test_the_editor_adds_presets_with_their_settings_and_a_weight_each(workspace, tiny_llama, prompts):
    at = _page(workspace, grpo_form_config(tiny_llama, prompts))
    at.selectbox(key="tr_rw_new").set_value("format").run()
    at.button(key="tr_rw_add").click().run()
    at.text_input(key="tr_rw1_pattern").set_value("[A-Z]+").run()
    at.number_input(key="tr_rw1_weight").set_value(0.5).run()
    at.selectbox(key="tr_rw_new").set_value("length").run()
    at.button(key="tr_rw_add").click().run()
    at.radio(key="tr_rw2_length_kind").set_value("target").run()
    at.number_input(key="tr_rw2_tokens").set_value(5).run()
    at.text_input(key="tr_rw2_name").set_value("brief").run()
    at.selectbox(key="tr_rw0_extract").set_value("last_number").run()
    at.checkbox(key="tr_rw0_numeric").check().run()
    cfg = at.session_state["train_config"]
    assert cfg["rewards"] == [
        {"type": "match", "column": "answer", "extract": "last_number", "numeric": True},
        {"type": "format", "pattern": "[A-Z]+"},
        {"type": "length", "name": "brief", "target": 5},
    ]
    assert cfg["training"]["reward_weights"] == [1.0, 0.5, 1.0]
    assert validate_config(cfg)["rewards"] == cfg["rewards"]  # a config the trainer takes as it is
    at.button(key="tr_rw1_remove").click().run()
    cfg = at.session_state["train_config"]
    assert [s["type"] for s in cfg["rewards"]] == ["match", "length"]
    assert "reward_weights" not in cfg["training"]  # all 1 again: TRL's default, left out
    at.text_input(key="tr_rw2_name").set_value("bad name!").run()
    assert any("rewards[1].name must be a short word" in e for e in _errors(at)), _errors(at)


def test_own_reward_code_is_refused_until_its_tick_box_is_ticked(workspace, tiny_llama, prompts, own_reward):
    at = _page(workspace, grpo_form_config(tiny_llama, prompts))
    at.selectbox(key="tr_rw_new").set_value("python").run()
    at.button(key="tr_rw_add").click().run()
    at.text_input(key="tr_rw1_path").set_value(str(own_reward)).run()
    refused = [e for e in _errors(at) if "Run my reward code" in e]
    assert refused == [
        f"rewards[1] runs the code of {own_reward} in the trainer: tick 'Run my reward code' (set "
        "rewards[1].trust_code: true) if you trust that file."
    ]
    assert at.button(key="tr_launch").disabled
    at.checkbox(key="tr_rw1_trust_code").check().run()  # the visible control the user ticks
    assert not _errors(at), _errors(at)
    assert at.session_state["train_config"]["rewards"][1] == {
        "type": "python",
        "path": str(own_reward),
        "function": "reward",
        "trust_code": True,
    }


def test_a_grpo_config_round_trips_through_the_form(workspace, tiny_llama, prompts, own_reward):
    """Every GRPO field and every kind of reward set away from its default: read back, the same config."""
    cfg = validate_config(
        grpo_form_config(
            tiny_llama,
            prompts,
            rewards=[
                {
                    "type": "match",
                    "column": "answer",
                    "extract": "regex",
                    "pattern": "([A-Z]+)",
                    "name": "exact",
                },
                {"type": "match", "column": "answer", "extract": "none", "numeric": False},  # defaults, given
                {"type": "format", "pattern": "[A-Z]+"},
                {"type": "length", "max": 6},
                {"type": "python", "path": str(own_reward), "function": "reward", "trust_code": True},
            ],
        )
    )
    cfg["training"].update(
        num_generations=4,
        max_completion_length=16,
        max_prompt_length=64,
        beta=0.04,
        temperature=0.7,
        loss_type="grpo",
        scale_rewards="batch",
        num_iterations=2,
        log_completions=False,
        reward_weights=[1.0, 1.0, 0.5, 0.25, 2.0],
    )
    cfg = validate_config(cfg)
    at = _page(workspace, cfg)
    assert not _errors(at), _errors(at)
    assert validate_config(at.session_state["train_config"]) == cfg


def test_an_uploaded_yaml_never_ticks_the_reward_code_box(workspace, tiny_llama, prompts, own_reward):
    cfg = grpo_form_config(
        tiny_llama,
        prompts,
        rewards=[{"type": "python", "path": str(own_reward), "function": "reward", "trust_code": True}],
    )
    at = _page(workspace, grpo_form_config(tiny_llama, prompts))
    yaml_text = config_to_yaml(validate_config(cfg)).encode()
    at.file_uploader(key="tr_upload").set_value(("grpo.yaml", yaml_text, "application/x-yaml")).run()
    assert not at.exception, at.exception
    assert at.checkbox(key="tr_rw0_trust_code").value is False
    assert any("grpo.yaml asks to run its own reward code" in w.value for w in at.warning)
    assert any("tick 'Run my reward code'" in e for e in _errors(at))
    at.checkbox(key="tr_rw0_trust_code").check().run()
    assert not any("asks to run its own reward code" in w.value for w in at.warning)


def test_switching_to_sft_drops_the_rewards_and_back_keeps_them(workspace, tiny_llama, prompts):
    cfg = grpo_form_config(tiny_llama, prompts, rewards=[{"type": "format", "pattern": "[A-Z]+"}])
    at = _page(workspace, cfg)
    at.radio(key="tr_method").set_value("sft").run()
    sft = at.session_state["train_config"]
    assert "rewards" not in sft and "reward_weights" not in sft["training"]
    assert "num_generations" not in sft["training"]
    at.radio(key="tr_method").set_value("grpo").run()
    assert at.session_state["train_config"]["rewards"] == [{"type": "format", "pattern": "[A-Z]+"}]


@pytest.mark.slow  # builds a 3-step demo and the warm start (5 SFT steps, merged) in a background job: ~40 s
def test_use_the_demos_prompts_builds_the_warm_start_as_a_job_then_fills_the_form(workspace):
    from core import jobs
    from core.demo.build import build_demo

    demo = build_demo(workspace / "demo", pretrain_steps=3, log=lambda _m: None)
    at = _page(workspace)
    at.radio(key="tr_method").set_value("grpo").run()
    before = _files(workspace)
    at.button(key="tr_demo_grpo").click().run()
    assert not at.exception, at.exception
    job = jobs.latest(workspace, "warm_start", key=str(demo.resolve()))
    assert job is not None and not (demo / "grpo-base").exists()
    assert any("Building the GRPO demo's warm start" in i.value for i in at.info)
    assert at.button(key="tr_demo_grpo").disabled  # one build at a time
    deadline = time.time() + 300
    while not jobs.read(job.path).done and time.time() < deadline:
        time.sleep(1)
    assert jobs.read(job.path).state == "finished", jobs.read(job.path).error
    at.run()  # the page's next tick: the form is filled from the finished job
    assert not at.exception, at.exception
    assert at.session_state["tr_method"] == "grpo"
    assert at.text_input(key="tr_model_path").value == str((demo / "grpo-base").resolve())
    assert at.text_input(key="tr_data_path").value == str((demo / "grpo_train.jsonl").resolve())
    assert at.session_state["train_config"]["rewards"] == [{"type": "match", "column": "answer"}]
    assert any("Prefilled from the demo's GRPO settings, on grpo-base" in c.value for c in at.caption)
    assert not (set(_files(workspace)) - before) & {"runs"}  # nothing launched
