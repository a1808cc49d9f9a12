"""A merge is a background job, not page code (issue #11): start a merge in a real browser, reload the page
while it runs, and the page reattaches to it, shows its progress and then its verified result."""

import json
import time
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, CHROMIUM_ARGS, exceptions_on, streamlit_server, wait_idle
from tests.test_e2e_flow import nav, wait_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]


def _finished_run(ws: Path) -> Path:
    """A base of ~85M parameters (a few seconds to merge and verify on a CPU) and a finished run's adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from core.demo.toy import build_tiny_model

    base = build_tiny_model(
        ws / "base", "llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_shard_size="100MB",
    )  # fmt: skip
    run = ws / "runs" / "big-1"
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base)),
        LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False),
    )
    model.save_pretrained(str(run / "adapter"))
    (run / "config.yaml").write_text(f"model:\n  path: {base}\nquantization:\n  load_in_4bit: false\n")
    (run / "status.json").write_text(json.dumps({"state": "finished", "reason": None, "step": 10}))
    return run


def test_reload_mid_merge_reattaches_to_the_job(tmp_path):
    from playwright.sync_api import sync_playwright

    from core import jobs

    ws = tmp_path / "ws"
    _finished_run(ws)
    with streamlit_server(ws, tmp_path / "logs") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(url)
        wait_idle(page)
        nav(page, "Merge & Export")
        page.get_by_role("tab", name="Merge & export").click()
        page.get_by_role("button", name="Merge and export").click()
        deadline = time.time() + 60
        while (job := jobs.latest(ws, "merge")) is None and time.time() < deadline:
            time.sleep(0.1)
        assert job is not None and not job.done, "the merge did not start as a job"

        page.reload()  # the script run that started the merge is gone; the job is not
        wait_idle(page)
        page.get_by_role("tab", name="Merge & export").click()
        running = not jobs.latest(ws, "merge").done
        if running:  # reattached while it runs: its progress is on the page
            wait_text(page, r"(Preflight|Merging|Verifying|Done): \d+/\d+ tensors", 60)
            assert "reloading this page reattaches" in page.inner_text("body")
        wait_text(page, r"verification \((full|quick)\): PASSED", 600, fail=r"FAILED|Error")
        assert exceptions_on(page) == []
        assert running, "the merge ended before the reload: make the base larger so the test sees it run"
        exports = list((ws / "exports").iterdir())
        assert [e.name for e in exports] == ["big-1-merged"] and (exports[0] / "config.json").is_file()
        browser.close()
