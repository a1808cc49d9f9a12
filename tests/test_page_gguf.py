"""The GGUF step on the Merge & Export page (issue #14): one click from an adapter (merge, then GGUF) and the
GGUF tab for an existing export, each a background job whose verified report and Modelfile the page shows."""

import importlib.util
import shutil

import pytest
from test_page_merge import _app, _wait_for_merge_job, finished_run  # noqa: F401 - the fixture is used by name

from core import jobs


@pytest.mark.slow
def test_merge_then_gguf_in_one_click_and_the_gguf_tab(finished_run, workspace):  # noqa: F811
    at = _app(workspace).run()
    at.checkbox(key="merge_then_gguf").check().run()
    at.selectbox(key="merge_gguf_type").set_value("q8_0").run()
    at.button(key="merge_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    job = _wait_for_merge_job(workspace)
    assert job.state == "finished", job.error
    gguf = workspace / "exports" / "demo-1-merged-q8_0.gguf"
    assert gguf.is_file() and gguf.with_suffix(".Modelfile").is_file()
    at.run()
    texts = " ".join(s.value for s in at.success)
    assert "verify (" in texts and "tokenizer round-trip" in texts
    assert any(c.value.startswith("ollama create") for c in at.code)
    # issue #40 item 5: say that llama.cpp's own check did not run and how to have it; offer the files
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama.cpp read-back: skipped (llama-cpp-python is not installed: `pip install" in texts
    labels = [b.proto.label for b in at.get("download_button")]
    assert any(label.startswith("Download demo-1-merged-q8_0.gguf (") for label in labels), labels
    assert any(label.startswith("Download demo-1-merged-q8_0.Modelfile (") for label in labels), labels

    # the same type again (issue #21 item 18: Convert was greyed out without a reason): the file is kept, the
    # export would take the next name, and the finished export's report stays shown
    at.selectbox(key="gguf_type").set_value("q8_0").run()
    assert not at.button(key="gguf_go").disabled
    assert any(
        "demo-1-merged-q8_0-2.gguf" in c.value and "exists already and is kept" in c.value for c in at.caption
    )
    # the GGUF tab converts the same export to another type, as its own job
    at.selectbox(key="gguf_type").set_value("f16").run()
    assert any("about" in c.value and "tensors" in c.value for c in at.caption)  # the size estimate
    at.button(key="gguf_go").click().run()
    assert not at.exception, at.exception
    import time

    deadline = time.time() + 300
    while (j := jobs.latest(workspace, "gguf")) is None or not j.done:
        assert time.time() < deadline, "the GGUF job did not end"
        time.sleep(0.2)
    assert j.state == "finished", j.error
    assert (workspace / "exports" / "demo-1-merged-f16.gguf").is_file()


def test_try_it_offers_the_prompts_the_adapter_was_trained_on(tmp_path, tiny_llama, workspace):
    """Issue #16: Try it's generic default prompt gave the demo adapter gibberish; it now starts from a prompt of
    the run's own training data (and the user's own text stays theirs)."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = workspace / "runs" / "upper"
    data = tmp_path / "train.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Uppercase: {w}"},
                {"role": "assistant", "content": w.upper()},
            ]
        }
        for w in ("cat", "dog")
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_llama)), LoraConfig(r=2, target_modules=["q_proj"])
    ).save_pretrained(str(run / "adapter"))
    (run / "config.yaml").write_text(f"model: {{path: {tiny_llama}}}\ndata: {{path: {data}}}\n")
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 1}))
    at = _app(workspace).run()
    assert not at.exception, at.exception
    assert at.text_area(key="merge_prompt").value == "Uppercase: cat"
    at.text_area(key="merge_prompt").set_value("my own").run()
    assert at.text_area(key="merge_prompt").value == "my own"
    assert not at.warning  # no "default value and session state" clash


def test_the_type_list_says_which_types_need_llama_cpps_quantizer_and_refuses_them_without_it(
    finished_run,  # noqa: F811 - the fixture, by name
    tiny_llama,
    workspace,
    monkeypatch,
):
    """Issue #40 item 5: q4_k_m / q5_k_m / q6_k were offered as any other type and failed only after Convert."""
    monkeypatch.setenv("LORA_COCKPIT_NO_LLAMA_CPP", "1")  # as a machine without llama-cpp-python
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # and without llama-quantize
    shutil.copytree(tiny_llama, workspace / "exports" / "tiny")
    at = _app(workspace).run()
    assert not at.exception, at.exception
    gtype = at.selectbox(key="gguf_type")
    assert "q8_0" in gtype.options and "q4_k_m · needs llama.cpp's quantizer (not installed)" in gtype.options
    assert "q6_k · needs llama.cpp's quantizer (not installed)" in gtype.options
    assert not at.button(key="gguf_go").disabled
    gtype.set_value("q4_k_m").run()
    warning = next(w.value for w in at.warning if "needs llama.cpp's quantizer" in w.value)
    assert "pip install llama-cpp-python" in warning and "f16, bf16, q8_0, q5_0, q4_0" in warning
    assert at.button(key="gguf_go").disabled  # refused before Convert, with the sentence above
    assert jobs.latest(workspace, "gguf") is None
    # the one-click merge then GGUF refuses the same way, before the merge starts
    at.checkbox(key="merge_then_gguf").check().run()
    at.selectbox(key="merge_gguf_type").set_value("q5_k_m").run()
    at.button(key="merge_go").click().run()
    assert any(e.value.startswith("Not started: q5_k_m needs llama.cpp's quantizer") for e in at.error)
    assert jobs.latest(workspace, "merge") is None
