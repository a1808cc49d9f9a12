"""The Train page in a new user's first hour (issue #40 item 4), through AppTest on real components: a plan made
for a card does not turn the CPU demo into a 4-bit run, Reset brings the demo back, the page's demo build writes
run.yaml as the CLI's does, and a refused upload is said once."""

from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from core.demo.build import RUN_CONFIG, demo_config

REPO = Path(__file__).resolve().parent.parent
PAGE = str(REPO / "pages" / "train.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a CUDA GPU does")
def test_a_qlora_plan_keeps_the_forms_precision_on_a_cpu_until_the_user_insists(workspace):
    """'Use this plan' from a QLoRA plan with a paged 8-bit optimizer made the CPU demo an 11-minute 4-bit run that
    bitsandbytes warned may be silently incorrect."""
    at = AppTest.from_file(str(REPO / "dashboard.py"), default_timeout=180).run()
    at.radio(key="es_tuning").set_value("qlora").run()
    at.selectbox(key="es_optim").set_value("paged_adamw_8bit").run()
    at.number_input(key="es_r").set_value(24).run()
    at.button(key="est_use_plan").click().run()
    assert not at.exception, at.exception
    assert at.radio(key="tr_tuning").value == "lora" and at.selectbox(key="tr_optim").value == "adamw_torch"
    assert at.number_input(key="tr_r").value == 24  # what a CPU run can use still comes across
    note = next(w.value for w in at.warning if "no CUDA GPU" in w.value)
    assert "quantization.load_in_4bit True" in note and "silently incorrect" in note
    assert "training.optim 'paged_adamw_8bit'" in note and "GPU memory" in note
    caption = next(c.value for c in at.caption if c.value.startswith("Prefilled from"))
    took = caption.split("it changed the form's defaults: ")[1]
    assert "load_in_4bit" not in took and "lora.r 16 → 24" in took  # it lists what it took, not more
    # and what the form holds against the plan (issue #51): not the plan's 4-bit base nor its optimizer
    assert "except quantization.load_in_4bit False (planned True)" in caption, caption
    assert "training.optim 'adamw_torch' (planned 'paged_adamw_8bit')" in caption, caption

    at.button(key="tr_cpu_insist").click().run()  # the user insists
    assert not at.exception, at.exception
    assert (
        at.radio(key="tr_tuning").value == "qlora"
        and at.selectbox(key="tr_optim").value == "paged_adamw_8bit"
    )
    assert at.number_input(key="tr_r").value == 24  # the rest of the form as it was
    assert not any("no CUDA GPU" in w.value for w in at.warning)

    at.button(key="tr_reset").click().run()  # and back to the demo as it comes
    assert not at.exception, at.exception
    assert at.radio(key="tr_tuning").value == "lora" and at.selectbox(key="tr_optim").value == "adamw_torch"
    assert at.number_input(key="tr_r").value == 16  # the demo's defaults (its assets are not built here)
    assert any(c.value.startswith("Prefilled from the demo defaults (reset)") for c in at.caption)


def test_a_refused_upload_is_said_once_not_after_later_unrelated_edits(workspace, tiny_llama, tmp_path):
    import json

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = {
        "model": {"path": str(tiny_llama)},
        "data": {"path": str(data)},
        "training": {"max_length": 64, "max_steps": 5},
    }
    at.run()
    bad = b"model:\n  path: /x\ntraining:\n  learning_rate: 0\n"
    at.file_uploader(key="tr_upload").set_value(("bad.yaml", bad, "application/x-yaml")).run()
    assert any("bad.yaml was not loaded" in e.value for e in at.error)
    at.number_input(key="tr_r").set_value(4).run()  # an edit that has nothing to do with the upload
    assert not at.exception, at.exception
    assert not any("was not loaded" in e.value for e in at.error), [e.value for e in at.error]
    assert at.number_input(key="tr_r").value == 4


def test_the_pages_demo_build_writes_run_yaml_as_the_cli_does(workspace):
    """The Train page's Build (the "demo" background job) left no run.yaml; `python -m core.demo` writes one."""
    from core.jobs.__main__ import run_demo
    from core.recipe.config import load_config

    result = run_demo({"out": str(workspace / "demo"), "pretrain_steps": 3}, lambda **_: None)
    run_yaml = workspace / "demo" / RUN_CONFIG
    assert result["run_config"] == str(run_yaml)
    assert load_config(run_yaml) == demo_config(out=workspace / "demo")  # the run the form starts from
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.run()
    assert not at.exception, at.exception
    caption = next(c.value for c in at.caption if c.value.startswith("Prefilled from the demo"))
    assert f"python -m core.train {run_yaml.resolve()}" in caption


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a CUDA GPU shows")
def test_on_a_cpu_the_plan_is_the_processs_ram_against_the_ram_free(workspace, tiny_llama, tmp_path):
    """The plan read '65.4 MiB of 24 GiB (0%)' and '(0% of the card)' on a CPU: tensor bytes against all the RAM,
    while the process holds ten times that."""
    import json

    import psutil

    from core.estimate.ram import RUNTIME_BYTES
    from core.fmt import mem

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = {
        "model": {"path": str(tiny_llama)},
        "data": {"path": str(data)},
        "training": {"max_length": 64, "max_steps": 5, "padding_free": True},
    }
    at.run()
    assert not at.exception, at.exception
    verdict = next(s.value for s in at.success if s.value.startswith("**Fits**"))
    assert "in this machine's RAM (no CUDA GPU" in verdict, verdict
    assert f"+ about {mem(RUNTIME_BYTES)} for Python, torch and the training libraries" in verdict
    free = float(verdict.split(" of ")[-1].split(" free")[0].split()[0])  # "of 12.34 GiB free (…)"
    assert free <= psutil.virtual_memory().total / 2**30
    captions = [c.value for c in at.caption]
    assert not any("of the card" in c for c in captions), captions
    # the data's largest batch, said the same way
    assert any("of the RAM free" in c for c in captions), captions


def _prefilled(at) -> str:
    return next(c.value for c in at.caption if c.value.startswith("Prefilled from"))


@pytest.mark.slow  # builds the demo assets as the page's background job (a few pretraining steps)
def test_the_estimate_hand_off_says_what_the_form_holds_before_and_after_the_demo_is_built(workspace):
    """Issue #51: the same plan handed over said "it matches the form's settings" before the demo was built and "it
    set lora.r 8 → 16, …" once the build refilled the form, which showed 16 all along. Both now say what the form
    holds against the plan, then what the plan changed, naming what it changed."""
    import time

    from core import jobs
    from core.demo.build import demo_dir
    from ui.fields import HANDOVER

    at = AppTest.from_file(str(REPO / "dashboard.py"), default_timeout=180).run()
    at.button(key="est_use_plan").click().run()
    assert not at.exception, at.exception
    plan = at.session_state[HANDOVER]
    before = _prefilled(at)
    # a preset is not a local folder: the model and its sizes stay the form's, every other planned setting is held
    assert (
        "the form holds every other setting it planned; it changed nothing in the form's defaults." in before
    )
    assert at.number_input(key="tr_r").value == plan["lora"]["r"] == 16

    folder = str(demo_dir(str(workspace)).resolve())
    jobs.start(str(workspace), "demo", {"out": folder, "pretrain_steps": 3}, key=folder)  # what Build starts
    deadline = time.time() + 300
    while not jobs.latest(str(workspace), "demo", key=folder).done:
        assert time.time() < deadline, "the demo build did not finish"
        time.sleep(0.5)
    assert jobs.latest(str(workspace), "demo", key=folder).state == "finished"
    at.run()  # the page refills the form from the demo run's settings, and the plan goes over them again
    assert not at.exception, at.exception
    after = _prefilled(at)
    assert (
        "the form holds every other setting it planned; it changed the demo run's settings: lora.r 8 → 16"
        in after
    )
    assert at.number_input(key="tr_r").value == 16 and at.number_input(key="tr_batch").value == 16
    assert "(planned" not in after  # nothing planned is missing but what the preset's note names
