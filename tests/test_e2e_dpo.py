"""A DPO run from the Train page, in a real browser against a real `streamlit run` server (issue #13): choose DPO,
take the demo's preference pairs, launch; the Monitor charts the rewards and the preference accuracy live, the
run's reward accuracy on held-out pairs rises, and Runs lists it as a DPO run. Screenshots: e2e-screenshots/dpo-*."""

import json
import re
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, CHROMIUM_ARGS, REPO, exceptions_on, streamlit_server, wait_idle
from tests.test_e2e_flow import nav, wait_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

SHOTS = REPO / "e2e-screenshots"


def test_dpo_run_from_the_train_page_is_charted_on_the_monitor(tmp_path, demo_built):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(exist_ok=True)
    ws = tmp_path / "ws"
    ws.mkdir()
    # the session's 200-step demo build (conftest.py), a copy of our own; the page's Build is e2e_flow's test
    demo_built.copy(ws / "demo")
    with streamlit_server(ws, tmp_path / "logs") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(60_000)

        page.goto(url + "/")
        wait_idle(page)
        nav(page, "Train")
        page.get_by_text("DPO (preference pairs)").click()
        wait_idle(page)
        page.get_by_role("button", name="Use the demo's preference pairs").click()
        wait_text(page, r"Prefilled from the demo's DPO settings", 60)
        wait_text(page, r"512 pairs", 120)
        wait_text(page, r"Preflight: no problems", 120)
        wait_idle(page)
        assert not exceptions_on(page)
        page.screenshot(path=str(SHOTS / "dpo-01-train.png"))
        page.get_by_role("button", name="Launch").click()

        wait_text(page, r"Monitor", 60)
        accuracy = wait_text(page, r"last accuracy ([\d.]+)", 300, fail=r"The run failed")
        assert 0.0 <= float(accuracy.group(1)) <= 1.0
        wait_text(page, r"State\s+finished", 600, fail=r"The run failed")
        wait_idle(page)
        assert not exceptions_on(page)
        page.screenshot(path=str(SHOTS / "dpo-02-monitor.png"))

        run_dir = next((ws / "runs").iterdir())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        heldout = [m["eval_rewards/accuracies"] for m in metrics if "eval_rewards/accuracies" in m]
        assert heldout and heldout[-1] >= 0.8, heldout
        assert (run_dir / "adapter" / "adapter_config.json").is_file()

        nav(page, "Runs")
        wait_text(page, re.escape(run_dir.name), 30)
        wait_idle(page)
        assert not exceptions_on(page)
        page.screenshot(path=str(SHOTS / "dpo-03-runs.png"))
        # the table is a canvas: what it shows for this run, from the function that fills it
        from core.monitor.summary import summarize_runs

        row = next(r for r in summarize_runs(ws / "runs") if r.name == run_dir.name)
        assert row.method == "dpo" and row.reward_accuracy >= 0.8 and row.reward_source == "eval"
        browser.close()
