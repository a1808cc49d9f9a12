"""The Merge & Export page through Streamlit's AppTest: lists a finished run, tries it, merges it, reports bad input."""

import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parent.parent
PAGE = str(REPO / "pages" / "merge.py")


@pytest.fixture()
def finished_run(tiny_llama, workspace) -> Path:
    """A run directory as the trainer leaves it: config.yaml naming the base, status finished, adapter/."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = workspace / "runs" / "demo-1"
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_llama)),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    model.save_pretrained(str(run / "adapter"))
    (run / "config.yaml").write_text(f"model:\n  path: {tiny_llama}\nquantization:\n  load_in_4bit: false\n")
    (run / "status.json").write_text(json.dumps({"state": "finished", "reason": None, "step": 10}))
    return run


def _app(workspace: Path) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    return at


def test_page_lists_run_tries_and_merges(finished_run, tiny_llama, workspace):
    at = _app(workspace).run()
    assert not at.exception
    assert at.title[0].value == "Merge & Export"
    assert at.selectbox(key="merge_adapter_choice").value == "demo-1 (finished)"
    assert at.text_input(key=f"merge_base_{finished_run / 'adapter'}").value == str(tiny_llama)

    at.text_area(key="merge_prompt").set_value("Hi")
    at.slider(key="merge_max_new").set_value(8)
    at.button(key="merge_try").click().run()
    assert not at.exception and not at.error
    assert [m.value for m in at.markdown if m.value.startswith("**Base")] == [
        "**Base**",
        "**Base + adapter**",
    ]

    assert at.text_input(key=f"merge_name_{finished_run / 'adapter'}").value == "demo-1-merged"
    at.button(key="merge_check").click().run()
    assert not at.error and any("Ready to merge" in s.value for s in at.success)
    assert any("RAM needed" in m.label for m in at.metric)

    at.button(key="merge_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    _wait_for_merge_job(workspace)  # a background process (core.jobs): the page reattaches on its next run
    at.run()
    out = workspace / "exports" / "demo-1-merged"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert any("PASSED" in s.value for s in at.success)
    assert any("model.safetensors" in str(df.value) for df in at.dataframe)

    # A fresh session (a server restart): the default target has moved on to "-2", and the finished merge of
    # this adapter is still what the page shows (issue #21 item 14)
    fresh = _app(workspace).run()
    assert fresh.text_input(key=f"merge_name_{finished_run / 'adapter'}").value == "demo-1-merged-2"
    assert any("PASSED" in s.value for s in fresh.success)

    # Merging again into the same folder is refused (the default name now moves on to a free one).
    at.text_input(key=f"merge_name_{finished_run / 'adapter'}").set_value("demo-1-merged")
    at.button(key="merge_go").click().run()
    _wait_for_merge_job(workspace)
    at.run()
    assert any("already exists" in e.value for e in at.error)


def _wait_for_merge_job(workspace, timeout=300):
    import time

    from core import jobs

    deadline = time.time() + timeout
    while time.time() < deadline:
        job = jobs.latest(workspace, "merge")
        if job is not None and job.done:
            return job
        time.sleep(0.2)
    raise AssertionError("the merge job did not end")


def test_page_bad_inputs_show_errors(finished_run, workspace, tmp_path):
    at = _app(workspace).run()
    at.text_input(key=f"merge_name_{finished_run / 'adapter'}").set_value("../escape").run()
    assert any("not allowed" in e.value for e in at.error)
    assert not (workspace.parent / "escape").exists()

    at.text_input(key=f"merge_base_{finished_run / 'adapter'}").set_value(str(tmp_path / "missing")).run()
    assert any("no config.json" in e.value for e in at.error)

    at.selectbox(key="merge_adapter_choice").set_value("Another adapter folder…").run()
    at.text_input(key="merge_adapter_dir").set_value(str(tmp_path)).run()
    assert any("no adapter_config.json" in e.value for e in at.error)
    assert not at.exception


def test_page_without_runs_asks_for_a_folder(workspace):
    at = _app(workspace).run()
    assert not at.exception
    assert at.selectbox(key="merge_adapter_choice").value == "Another adapter folder…"


def test_merge_anyway_is_offered_only_once_the_base_does_not_match(
    finished_run, tiny_llama, workspace, tmp_path
):
    """Issue #40 item 5: 'Merge anyway' was offered before there was any mismatch to override."""
    from core.demo.toy import build_tiny_model

    at = _app(workspace).run()
    assert not at.exception, at.exception
    assert "merge_force" not in [c.key for c in at.checkbox]  # the adapter's own base: nothing to override
    assert not any("may not belong" in w.value for w in at.warning)
    other = build_tiny_model(
        tmp_path / "other", "llama", num_hidden_layers=3
    )  # every adapter tensor still fits
    at.text_input(key=f"merge_base_{finished_run / 'adapter'}").set_value(str(other)).run()
    assert not at.exception, at.exception
    warning = next(w.value for w in at.warning if "may not belong" in w.value)
    assert "num_hidden_layers 2 vs 3" in warning
    assert "merge_force" in [c.key for c in at.checkbox]


def test_merge_progress_says_what_it_does_before_anything_is_counted():
    """Issue #40 item 5: the progress bar started with 'Preflight: 0/0 tensors, 0 B of 0 B written'."""
    from core.merge import progress_sentence

    assert progress_sentence({}) == "Preflight: reading the adapter and the base, checking RAM and disk…"
    assert progress_sentence({"phase": "preflight", "preflight": {}}) == "Preflight passed: the merge starts…"
    assert progress_sentence({"phase": "merge", "done": 0, "total": 0}).startswith("Preflight: reading")
    counted = progress_sentence(
        {"phase": "merge", "done": 3, "total": 24, "bytes_done": 2 * 2**20, "bytes_total": 9 * 2**20}
    )
    assert counted == "Merging: 3/24 tensors, 2.0 MB of 9.0 MB written"
