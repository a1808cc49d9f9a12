"""The Train page through AppTest, on a tiny local model and a small JSONL dataset (the demo takes minutes to
build on 2 cores, so a stand-in config with the same shape is seeded as the form's starting point)."""

import json
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.recipe.config import default_config
from tests.fake_gpu import BusyNvml

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "train.py")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"instruction": f"Add one to {i}", "output": f"{i + 1}"} for i in range(60)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def wrong_columns(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "reply": f"a{i}"}) + "\n" for i in range(5)))
    return path


def tiny_config(model: Path, data: Path) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"path": str(data), "max_length": 64},
        "training": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 20},
    }


def _page(workspace: Path, config: dict | None = None) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    if config is not None:
        at.session_state["train_config"] = config
    at.run()
    assert not at.exception, at.exception
    return at


def _files(workspace: Path) -> set[str]:
    return {str(p.relative_to(workspace)) for p in workspace.rglob("*")}


def test_demo_default_without_assets_offers_to_build_them(workspace):
    at = _page(workspace)
    assert any("not built yet" in i.value for i in at.info)
    assert any(b.label == "Build the demo assets" for b in at.button)
    assert at.text_input(key="tr_model_path").value == str((workspace / "demo" / "base").resolve())
    # Issue #40 item 4: a first visit showed two red errors (the demo's folder and dataset do not exist) before the
    # user had done anything; the page invites them to build the demo instead, and Launch waits for it
    assert not at.error, [e.value for e in at.error]
    assert any(c.value.startswith("Build the demo assets (above), or point") for c in at.caption)
    assert at.button(key="tr_launch").disabled
    assert _files(workspace) == set()
    # a path the user typed is theirs: a missing one is an error again
    at.text_input(key="tr_data_path").set_value(str(workspace / "mine.jsonl")).run()
    assert any("mine.jsonl" in e.value for e in at.error), [e.value for e in at.error]
    assert not any("demo/base" in e.value for e in at.error)  # the demo's folder still waits for the build


def test_valid_config_shows_preview_preflight_and_verdict(workspace, tiny_llama, dataset):
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    assert not at.error, [e.value for e in at.error]
    assert any(s.value.startswith("Preflight: no problems") for s in at.success)
    assert any(s.value.startswith("**Fits**") for s in at.success)  # the plan's verdict for this config
    preview = at.dataframe[0].value
    assert len(preview) == 5 and preview["completion"].iloc[0].startswith("1")
    assert at.get("vega_lite_chart"), "token length histogram"
    assert not at.button(key="tr_launch").disabled
    assert at.text_input(key="tr_data_path").value == str(dataset)


BAD_INPUTS = [
    (
        "text_input",
        "tr_model_path",
        "/nonexistent/model",
        "Model folder (model.path): the folder /nonexistent/model does not exist",
    ),
    # each message names the field by its label, and the YAML key in brackets (issue #16)
    ("number_input", "tr_lr", 0.0, "Learning rate (training.learning_rate) must be in (0, 1]"),
    ("number_input", "tr_lr", -1e-4, "Learning rate (training.learning_rate) must be in (0, 1]"),
    (
        "number_input",
        "tr_batch",
        0,
        "Batch size (per device) (training.per_device_train_batch_size) must be in [1, 65536]",
    ),
    ("text_input", "tr_name", "../escape", "Run name '../escape' is not allowed"),
]


@pytest.mark.parametrize(("kind", "key", "value", "message"), BAD_INPUTS, ids=lambda v: str(v)[:20])
def test_bad_input_shows_message_and_launches_nothing(
    workspace, tiny_llama, dataset, kind, key, value, message
):
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    before = _files(workspace)
    getattr(at, kind)(key=key).set_value(value).run()
    assert any(message in e.value for e in at.error), [e.value for e in at.error]
    assert at.button(key="tr_launch").disabled
    assert _files(workspace) == before
    assert not (workspace.parent / "escape").exists()


def test_dataset_without_needed_columns_is_named(workspace, tiny_llama, wrong_columns):
    at = _page(workspace, tiny_config(tiny_llama, wrong_columns))
    errors = [e.value for e in at.error]
    assert any("Cannot tell the data format" in e and "question, reply" in e for e in errors), errors
    at.selectbox(key="tr_format").set_value("alpaca").run()
    errors = [e.value for e in at.error]
    assert any("format alpaca needs the column(s) instruction, output" in e for e in errors), errors
    assert at.button(key="tr_launch").disabled
    assert _files(workspace) == set()


def test_uploading_a_bad_yaml_shows_the_error_and_keeps_the_form(workspace, tiny_llama, dataset):
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    bad = b"model:\n  path: /x\ntraining:\n  learning_rate: 0\n"
    at.file_uploader(key="tr_upload").set_value(("bad.yaml", bad, "application/x-yaml")).run()
    assert any("bad.yaml was not loaded" in e.value and "training.learning_rate" in e.value for e in at.error)
    assert at.text_input(key="tr_model_path").value == str(tiny_llama)


def test_uploading_a_good_yaml_fills_the_form(workspace, tiny_llama, dataset):
    from core.recipe.config import config_to_yaml, validate_config

    cfg = validate_config(tiny_config(tiny_llama, dataset))
    cfg["lora"]["r"], cfg["training"]["learning_rate"] = 4, 5e-4
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    at.file_uploader(key="tr_upload").set_value(
        ("run.yaml", config_to_yaml(cfg).encode(), "application/x-yaml")
    )
    at.run()
    assert not at.exception, at.exception
    assert at.number_input(key="tr_r").value == 4
    assert at.number_input(key="tr_lr").value == pytest.approx(5e-4)


def test_an_uploaded_yaml_never_switches_on_trust_remote_code(workspace, tiny_llama, dataset):
    from core.recipe.config import config_to_yaml, validate_config

    cfg = validate_config(tiny_config(tiny_llama, dataset))
    cfg["model"]["trust_remote_code"] = True
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    at.file_uploader(key="tr_upload").set_value(
        ("remote.yaml", config_to_yaml(cfg).encode(), "application/x-yaml")
    )
    at.run()
    assert not at.exception, at.exception
    assert at.checkbox(key="tr_trust").value is False
    assert any("remote.yaml asks for trust_remote_code" in w.value for w in at.warning)
    at.checkbox(key="tr_trust").check().run()  # the visible control the user ticks
    assert not any("asks for trust_remote_code" in w.value for w in at.warning)


def test_an_uploaded_yaml_with_aliases_is_refused(workspace, tiny_llama, dataset):
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    bomb = b"a: &a [x, x]\nb: &b [*a, *a]\nmodel: {path: /x}\n"
    at.file_uploader(key="tr_upload").set_value(("bomb.yaml", bomb, "application/x-yaml")).run()
    assert any("bomb.yaml was not loaded" in e.value and "alias" in e.value for e in at.error)


@pytest.mark.slow  # one real training step in a subprocess: ~15 s
def test_smoke_test_shows_measured_peak_next_to_estimate(workspace, tiny_llama, dataset):
    from core.runs.admin import latest_smoke, smoke_result

    at = _page(workspace, tiny_config(tiny_llama, dataset))
    at.button(key="tr_smoke").click().run()
    assert not at.exception, at.exception
    # the smoke test is its own process: the page returned at once and follows it (a reload reattaches)
    run = latest_smoke(workspace, at.text_input(key="tr_name").value)
    assert run is not None
    deadline = time.time() + 300
    while smoke_result(run) is None and time.time() < deadline:
        time.sleep(0.2)
    at.run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Measured peak"].endswith("iB") and metrics["Estimated peak"].endswith("iB")
    assert float(metrics["Seconds per step"]) > 0
    smoke = [d for d in (workspace / "smoke").iterdir()]
    assert len(smoke) == 1 and (smoke[0] / "smoke.json").is_file()
    result = json.loads((smoke[0] / "smoke.json").read_text())
    assert result["estimate_bytes"] > 0 and result["peak_bytes"] > 0  # both sides of the comparison are real
    assert not (workspace / "runs").exists()  # a smoke test is not a run


# ---- core.runs.admin: the checks and the planner mapping behind the page ---------------------------------------


def test_check_fields_reports_every_bad_field_at_once(tiny_llama, dataset):
    from core.runs.admin import check_fields

    raw = tiny_config(tiny_llama, dataset)
    raw["training"].update(learning_rate=0, per_device_train_batch_size=0)
    raw["lora"] = {"r": 0}
    errors = check_fields(raw)
    assert set(errors) == {"training.learning_rate", "training.per_device_train_batch_size", "lora.r"}
    assert all(msg.startswith(path) for path, msg in errors.items())  # each sentence names its field
    assert check_fields(tiny_config(tiny_llama, dataset)) == {}


def test_plan_for_config_describes_the_run(tiny_llama, dataset):
    from core.estimate.from_config import plan_for_config
    from core.recipe.config import validate_config

    cfg = validate_config(tiny_config(tiny_llama, dataset))
    cfg["quantization"]["load_in_4bit"] = True
    cfg["lora"].update(r=4, target_modules=["q_proj", "v_proj"])
    cfg["training"].update(gradient_checkpointing=True, optim="paged_adamw_8bit")
    plan = plan_for_config(cfg, gpu_gb=48, device="cuda", expandable_segments=True)
    assert (plan.tuning, plan.lora_r, plan.target_modules) == ("qlora", 4, "q_proj,v_proj")
    assert (plan.batch_size, plan.seq_len, plan.gpu_gb) == (2, 64, 48.0)
    assert plan.gradient_checkpointing and plan.optim == "paged_adamw_8bit"
    assert plan.expandable_segments and plan.model == str(tiny_llama)
    assert plan.method == "sft"  # an SFT config plans an SFT run, whatever the Estimate page last showed
    cpu = plan_for_config(cfg, device="cpu", batch_size=1)
    assert (cpu.compute_dtype, cpu.autocast, cpu.batch_size) == (
        "fp32",
        False,
        1,
    )  # the trainer never autocasts on CPU


def _handed(model, **training) -> dict:
    """A run config as the Estimate page hands it over ("Use this plan"): its own draft, no data path."""
    cfg = default_config()
    cfg["model"]["path"] = str(model)
    cfg["training"].update(training)
    return cfg


def test_config_from_the_estimate_page_fills_the_form_key_for_key(workspace, tiny_llama, dataset):
    from ui.fields import HANDOVER

    handed = _handed(tiny_llama, per_device_train_batch_size=3, max_length=64, optim="adagrad")
    handed["lora"]["r"], handed["model"]["dtype"] = 4, "float32"
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = tiny_config(tiny_llama, dataset)  # the data path comes from here
    at.session_state[HANDOVER] = handed
    at.run()
    assert not at.exception, at.exception
    assert at.number_input(key="tr_batch").value == 3 and at.number_input(key="tr_r").value == 4
    assert at.selectbox(key="tr_dtype").value == "float32"
    # a value the library takes but the form does not list: said, and the form's default used
    assert any("training.optim 'adagrad' is not available here" in w.value for w in at.warning)
    assert at.selectbox(key="tr_optim").value == "adamw_torch"
    assert at.text_input(key="tr_data_path").value == str(dataset)  # the Estimate page plans no data
    caption = next(c.value for c in at.caption if c.value.startswith("Prefilled from"))
    assert "training.per_device_train_batch_size 2 → 3" in caption and "lora.r 16 → 4" in caption


def test_plan_for_a_hub_model_keeps_the_local_model_and_its_sizes(workspace):
    """Estimate a preset (no weights here), then Train: the plan's 2048 tokens must not land on a 256-position
    model; the LoRA settings still come across."""
    from ui.fields import HANDOVER

    handed = _handed("meta-llama/Llama-2-7b-hf", per_device_train_batch_size=7, max_length=2048)
    handed["lora"]["r"] = 8
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = None
    at.session_state[HANDOVER] = handed
    at.run()
    assert not at.exception, at.exception
    assert at.text_input(key="tr_model_path").value.endswith("demo/base")
    # The demo is not built here, so the form starts from the default config: its length, not the plan's 2048.
    assert at.number_input(key="tr_max_length").value == default_config()["training"]["max_length"] != 2048
    assert at.number_input(key="tr_batch").value != 7
    assert at.number_input(key="tr_r").value == 8


def test_viewing_the_estimate_page_does_not_change_the_train_form(workspace):
    """Issue #16: merely opening the Estimate page (it keeps its config in the session) left the demo run with
    the plan's QLoRA/dtype settings. Only 'Use this plan' hands the config over, and the form lists what it took."""
    from ui.fields import HANDOVER

    planned = _handed("meta-llama/Llama-2-7b-hf")
    planned["lora"]["enabled"], planned["model"]["dtype"] = False, "bfloat16"
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["estimate_config"] = planned
    at.run()
    assert not at.exception, at.exception
    assert at.radio(key="tr_tuning").value == "lora" and at.selectbox(key="tr_dtype").value == "auto"
    assert any("Prefilled from the demo model and dataset" in c.value for c in at.caption)

    at.session_state[HANDOVER] = at.session_state["estimate_config"]  # now the user clicked "Use this plan"
    at.run()
    assert at.radio(key="tr_tuning").value == "full" and at.selectbox(key="tr_dtype").value == "bfloat16"
    caption = next(c.value for c in at.caption if c.value.startswith("Prefilled from"))
    assert "lora.enabled True → False" in caption and "model.dtype 'auto' → 'bfloat16'" in caption


def test_estimate_page_use_this_plan_hands_its_run_config_over():
    from pathlib import Path as _P

    from ui.fields import HANDOVER

    at = AppTest.from_file(str(_P(PAGE).parent.parent / "dashboard.py"), default_timeout=180).run()
    assert not at.exception, at.exception
    assert HANDOVER not in at.session_state  # viewing the landing Estimate page hands nothing over
    at.number_input(key="es_r").set_value(24).run()
    at.radio(key="es_tuning").set_value("full").run()
    at.text_input(key="es_gpus").set_value("2").run()
    at.selectbox(key="es_strategy").set_value("ddp").run()
    at.button(key="est_use_plan").click().run()
    assert not at.exception, at.exception
    handed = at.session_state[HANDOVER]
    assert handed == at.session_state["estimate_config"]  # the page's own run config, not a translation
    assert (handed["lora"]["r"], handed["lora"]["enabled"]) == (24, False)
    # on the Train page
    assert at.number_input(key="tr_r").value == 24 and at.radio(key="tr_tuning").value == "full"
    assert at.text_input(key="tr_gpus").value == "2" and at.selectbox(key="tr_strategy").value == "ddp"
    batch, accum = at.number_input(key="tr_batch").value, at.number_input(key="tr_accum").value
    assert any(
        f"each step trains {batch} × {accum} × 2 = {batch * accum * 2} rows" in c.value for c in at.caption
    )


def test_a_run_on_two_gpus_is_written_with_its_distributed_section(workspace, tiny_llama, dataset):
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = tiny_config(tiny_llama, dataset)
    at.run()
    assert not any("each step trains" in c.value for c in at.caption)  # one GPU: nothing to say
    at.text_input(key="tr_gpus").set_value("2").run()
    assert not at.exception, at.exception
    assert at.session_state["train_config"]["distributed"]["gpus"] == 2
    assert not [e.value for e in at.error]


def test_the_gpus_a_loaded_config_names_survive_the_form_and_can_be_picked(workspace, tiny_llama, dataset):
    """distributed.gpus [1, 3] (which cards, nvidia-smi's numbers) is shown and written back as ids, not turned
    into a count; the field takes a count, ids, or one GPU alone ([1]); anything else is one sentence."""
    cfg = tiny_config(tiny_llama, dataset)
    cfg["distributed"] = {"gpus": [1, 3], "strategy": "ddp"}
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = cfg
    at.run()
    assert not at.exception, at.exception
    assert at.text_input(key="tr_gpus").value == "[1, 3]"
    assert at.session_state["train_config"]["distributed"]["gpus"] == [1, 3]
    assert any("each step trains" in c.value and "× 2 =" in c.value for c in at.caption)
    for typed, written in (("[1]", [1]), ("0, 2", [0, 2]), ("1", 1)):
        at.text_input(key="tr_gpus").set_value(typed).run()
        assert at.session_state["train_config"]["distributed"]["gpus"] == written, typed
    at.text_input(key="tr_gpus").set_value("two").run()
    assert not at.exception, at.exception
    said = [e.value for e in at.error]
    assert any("distributed.gpus) must be a count (2) or a non-empty list of GPU ids" in e for e in said), (
        said
    )


def test_launch_into_a_workspace_that_cannot_be_created_is_one_sentence(tiny_llama, dataset):
    """Issue #16: a workspace under /proc gave a raw FileNotFoundError traceback on Launch."""
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = "/proc/lora-cockpit-cannot-exist"
    at.session_state["train_config"] = tiny_config(tiny_llama, dataset)
    at.run()
    at.button(key="tr_launch").click().run()
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    assert any("Cannot create the runs folder /proc/lora-cockpit-cannot-exist/runs" in e for e in errors), (
        errors
    )


def test_changing_the_workspace_moves_the_demo_form_and_its_build_button(tmp_path):
    """Issue #16: after a workspace change in the sidebar, Build did nothing and the form kept the old demo."""
    first, second = tmp_path / "ws1", tmp_path / "ws2"
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(first)
    at.run()
    assert at.text_input(key="tr_model_path").value.startswith(str(first))
    at.session_state["workspace"] = str(second)
    at.run()
    assert not at.exception, at.exception
    assert at.text_input(key="tr_model_path").value.startswith(str(second))
    assert any(str(second / "demo") in i.value for i in at.info)  # the banner names the new workspace
    assert any(b.label == "Build the demo assets" for b in at.button)


def test_preflight_of_a_large_dataset_is_a_background_job(workspace, tiny_llama, tmp_path):
    """Issue #11: a full-dataset preflight ran in the script thread (a reload lost it, the page blocked)."""
    from core import jobs

    big = tmp_path / "big.jsonl"
    big.write_text(
        "".join(json.dumps({"instruction": f"Say {i}", "output": str(i)}) + "\n" for i in range(6000))
    )
    at = _page(workspace, tiny_config(tiny_llama, big))
    assert any("checking all 6,000 rows as a background job" in i.value for i in at.info)
    assert at.button(key="tr_launch").disabled  # not before the data is checked
    job = jobs.latest(workspace, "preflight")
    deadline = time.time() + 300
    while not jobs.read(job.path).done:
        assert time.time() < deadline, "the preflight job did not end"
        time.sleep(0.2)
    assert jobs.read(job.path).state == "finished", jobs.read(job.path).error
    at.run()  # a new script run (a reload) finds the finished job by its config
    assert not at.exception, at.exception
    assert any("no problems found" in s.value for s in at.success), [e.value for e in at.error]
    assert not at.button(key="tr_launch").disabled
    assert len(list((workspace / "jobs").glob("preflight-*"))) == 1  # found again, not started again


def test_a_new_dataset_is_judged_by_its_own_columns_and_a_broken_line_is_named(
    workspace, tiny_llama, tmp_path
):
    """Issue #16: a CSV with other columns was judged as 'chat' (the demo's format stayed); a broken JSONL named
    no row."""
    base = tiny_config(tiny_llama, tmp_path / "unused.jsonl")
    base["data"]["format"] = "chat"
    at = _page(workspace, base)
    csv = tmp_path / "qa.csv"
    csv.write_text("question,reply\nhi,hello\n")
    at.text_input(key="tr_data_path").set_value(str(csv)).run()
    assert at.selectbox(key="tr_format").value == "auto"
    assert any("Cannot tell the data format" in e.value and "question, reply" in e.value for e in at.error)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output"\n')
    at.text_input(key="tr_data_path").set_value(str(broken)).run()
    assert any("line 2 of" in e.value and "is not valid JSON" in e.value for e in at.error), [
        e.value for e in at.error
    ]


# -- DPO (issue #13) ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pairs") / "prefs.jsonl"
    rows = [{"prompt": f"Uppercase: w{i}", "chosen": f"W{i}!", "rejected": f"W{i}"} for i in range(20)]
    rows[3] = {"prompt": "Uppercase: same", "chosen": "SAME", "rejected": "SAME"}  # a pair with no preference
    rows[7] = {"prompt": "Uppercase: gone", "chosen": "", "rejected": "GONE"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dpo_method_shows_pairs_side_by_side_and_pair_checks_with_rows(workspace, tiny_llama, pairs):
    cfg = {**tiny_config(tiny_llama, pairs), "method": "dpo", "data": {"path": str(pairs)}}
    cfg["training"] = {**cfg["training"], "max_length": 64}
    at = _page(workspace, cfg)
    assert at.radio(key="tr_method").value == "dpo"
    assert at.number_input(key="tr_beta").value == 0.1 and at.selectbox(key="tr_format").value == "auto"
    preview = at.dataframe[0].value
    assert {"prompt", "chosen", "rejected"} <= set(preview.columns) and preview["chosen"].iloc[0] == "W0!"
    problems = " ".join(e.value for e in at.error) + " ".join(w.value for w in at.warning)
    assert "rows 8" in problems and "rows 4" in problems, (
        problems
    )  # an empty chosen answer, an identical pair
    assert "position_limit" not in problems
    assert at.button(key="tr_launch").disabled  # the empty chosen answer is an error
    yaml_text = at.session_state["train_config"]
    assert yaml_text["method"] == "dpo" and yaml_text["training"]["beta"] == 0.1


def test_switching_back_to_sft_drops_the_dpo_keys(workspace, tiny_llama, dataset):
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    at.radio(key="tr_method").set_value("dpo").run()
    assert at.session_state["train_config"]["method"] == "dpo"
    assert "beta" in at.session_state["train_config"]["training"]
    at.radio(key="tr_method").set_value("sft").run()
    cfg = at.session_state["train_config"]
    assert cfg["method"] == "sft" and "beta" not in cfg["training"] and not at.exception


def test_lever_checkboxes_write_the_run_config_and_liger_without_its_package_is_one_sentence(
    workspace, tiny_llama, dataset
):
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    assert "padding_free" not in at.session_state["train_config"]["training"]
    at.checkbox(key="tr_padding_free").check().run()
    assert at.session_state["train_config"]["training"]["padding_free"] is True
    at.checkbox(key="tr_liger").check().run()
    assert not at.exception
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:  # this machine (and CI): no liger-kernel, no GPU
        assert any(
            "Liger kernels (CUDA) (training.use_liger_kernel) needs the liger-kernel" in e.value
            for e in at.error
        )
        assert at.button(key="tr_launch").disabled
    at.radio(key="tr_method").set_value("dpo").run()  # padding-free is SFT's: a DPO config drops it
    assert "padding_free" not in at.session_state["train_config"]["training"] and not at.exception


def test_the_memory_plan_also_gives_the_peak_of_the_datas_largest_batch(workspace, tiny_llama, dataset):
    """Issue #12, real lengths: the verdict is for the bound (every row max_length); the data's rows are short, so
    the largest batch they can form is named with its own peak."""
    cfg = tiny_config(tiny_llama, dataset)
    cfg["training"] = {**cfg["training"], "padding_free": True, "per_device_train_batch_size": 4}
    at = _page(workspace, cfg)
    text = next(c.value for c in at.caption if "largest batch holds" in c.value)
    tokens = int(text.split("largest batch holds ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < tokens < 4 * 64 and "not 256" in text


@pytest.mark.slow  # builds the demo assets (a few pretraining steps)
def test_the_preference_demo_buttons_fill_the_form_without_false_warnings(workspace):
    """Issue #21 item 17: 'Use the demo's preference pairs' warned that data.format 'standard' is not a format
    (checked against SFT's), and trained on the demo base while `core.demo --run-dpo` trains on the SFT-merged
    model. Now: no warning, and the SFT-merged demo model when there is one."""
    import shutil

    from core.demo.build import build_demo

    demo = build_demo(workspace / "demo", pretrain_steps=3, log=lambda _m: None)
    at = _page(workspace)
    for method, button in (("dpo", "tr_demo_dpo"), ("kto", "tr_demo_kto")):
        at.radio(key="tr_method").set_value(method).run()
        at.button(key=button).click().run()
        assert not at.exception, at.exception
        assert not [w.value for w in at.warning], [w.value for w in at.warning]
        assert at.session_state["tr_method"] == method and at.text_input(key="tr_model_path").value.endswith(
            "/base"
        )
    shutil.copytree(demo / "base", demo / "sft-merged")  # what core.demo --run-dpo leaves: the SFT run merged
    at.button(key="tr_demo_kto").click().run()
    assert at.text_input(key="tr_model_path").value == str((demo / "sft-merged").resolve())
    assert any("on sft-merged" in c.value for c in at.caption)


def test_sample_answers_at_each_eval_is_a_field_and_off_stays_out_of_the_yaml(workspace, tiny_llama, dataset):
    """Issue #24: training.eval_samples on the form (it was YAML-only); 0 (off) is not written."""
    at = _page(workspace, tiny_config(tiny_llama, dataset))
    assert at.number_input(key="tr_eval_samples").value == 0
    assert "eval_samples" not in at.session_state["train_config"]["training"]
    at.number_input(key="tr_eval_samples").set_value(3).run()
    assert not at.exception and at.session_state["train_config"]["training"]["eval_samples"] == 3


def test_a_gpu_another_process_holds_is_named_before_launch_mocked_gpu_driver(
    workspace, tiny_llama, dataset, monkeypatch
):
    from core import gpu
    from core.estimate import from_config

    monkeypatch.setattr(gpu, "NvmlSource", BusyNvml)
    cards = tuple(BusyNvml().devices())
    monkeypatch.setattr(
        from_config, "local_card", lambda: from_config.Card("cuda", 24.0, "the RTX 4090", 2, cards)
    )
    cfg = tiny_config(tiny_llama, dataset)
    cfg["distributed"] = {"gpus": [1]}
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = cfg
    at.run()
    assert not at.exception, at.exception
    busy = [w.value for w in at.warning if w.value.startswith("GPU 1 already has")]
    assert len(busy) == 1 and "23.8 of 24 GiB in use (pid 4242: 23.5 GiB)" in busy[0], busy
    assert "0.2 GiB left; end that process, or pick another GPU" in busy[0]
    at.text_input(key="tr_gpus").set_value("[0]").run()  # the free card: nothing to say
    assert not [w.value for w in at.warning if "already has" in w.value]
