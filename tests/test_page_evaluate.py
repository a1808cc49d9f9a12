"""The Evaluate page through AppTest, on a real run (trained in this process by the trainer's own code path) and
its real evaluation job (core.jobs, a process of its own)."""

import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_page_monitor import finished_run

from core import jobs

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "evaluate.py")


@pytest.mark.slow  # a real 6-step run and its evaluation job (~25 s)
def test_a_bad_data_file_is_named_by_the_pages_field_not_the_clis_flag(workspace, tiny_llama):
    """Issue #51: the page said "--data: line 1 of … is not valid JSON", a flag its user never typed. The message
    names the page's own field, and the fix its reader can make there."""
    run = finished_run(workspace, tiny_llama, "to-evaluate")
    bad = workspace / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"\n')  # one line, its closing brace missing
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["workspace"] = str(workspace)
    at.session_state["eval_run"] = str(run)
    at.run()
    at.radio(key="ev_source").set_value("A data file").run()
    at.text_input(key="ev_data").set_value(str(bad)).run()
    at.button(key="ev_go").click().run()
    assert not at.exception, at.exception
    run_dir = at.selectbox(key="ev_run").value
    deadline = time.time() + 300
    while not jobs.latest(str(workspace), "eval", key=run_dir).done:
        assert time.time() < deadline, "the evaluation job did not end"
        time.sleep(0.5)
    at.run()
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    label = at.text_input(key="ev_data").label
    assert errors == [
        f"{label.split(' (')[0]}: line 1 of {bad} is not valid JSON (a JSON Lines file has one object per line): "
        "fix or remove that line."
    ], errors
    assert label.startswith("Data file (") and "--data" not in errors[0]
