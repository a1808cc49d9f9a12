"""GRPO on the demo from the Train page, in a real browser against a real `streamlit run` server (issue #34, "Done
when"): choose GRPO, take the demo's prompts (its warm start built by the page's background job) with the
exact-match reward, launch; the Monitor charts the reward and tables the sample completions with their rewards.
Screenshots: e2e-screenshots/grpo-*."""

import json
from pathlib import Path

import pytest

from core import rundir
from core.monitor.completions import COMPLETIONS
from tests.browser import CHROMIUM, CHROMIUM_ARGS, REPO, exceptions_on, streamlit_server, wait_idle
from tests.test_e2e_flow import nav, wait_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

SHOTS = REPO / "e2e-screenshots"


def test_grpo_on_the_demo_from_the_train_page_is_charted_with_its_completions(tmp_path, demo_built):
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
        page.get_by_text("GRPO (prompts + reward functions)").click()
        wait_idle(page)
        page.get_by_role("button", name="Use the demo's prompts").click()
        # no warm start yet: a background job builds it, then the form fills itself
        wait_text(page, r"Prefilled from the demo's GRPO settings, on grpo-base", 400, fail=r"failed")
        assert (ws / "demo" / "grpo-base" / "config.json").is_file()
        wait_text(page, r"512 prompts", 120)
        wait_text(page, r"Preflight: no problems", 120)
        wait_idle(page)
        # the reward it is scored by: exact match against the prompts' answer column
        assert page.get_by_label("Reward 1").input_value() == "Exact / numeric match with an answer column"
        assert page.get_by_role("textbox", name="Answer column").input_value() == "answer"
        max_steps = page.get_by_label("Max steps (-1: epochs)")
        max_steps.fill("10")  # two logging steps: a reward curve and two steps of completions
        max_steps.press("Enter")
        wait_idle(page)
        assert not exceptions_on(page)
        page.get_by_text("Rewards", exact=True).scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "grpo-01-train.png"))
        page.get_by_role("button", name="Launch").click()

        wait_text(page, r"Monitor", 60)
        reward = wait_text(page, r"last reward ([\d.]+)", 600, fail=r"The run failed")
        assert 0.0 <= float(reward.group(1)) <= 1.0
        wait_text(page, r"Sample completions and their rewards", 60)
        wait_text(page, r"each reward function's score \(match\)", 60)
        wait_text(page, r"State\s+finished", 600, fail=r"The run failed")
        wait_idle(page)
        assert not exceptions_on(page)
        page.get_by_text("last reward").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "grpo-02-monitor.png"))
        page.get_by_text("Sample completions and their rewards").scroll_into_view_if_needed()
        table = page.locator('[data-testid="stDataFrame"]').last
        assert table.is_visible()
        page.screenshot(path=str(SHOTS / "grpo-03-completions.png"))

        run_dir = next((ws / "runs").iterdir())
        config = (run_dir / rundir.CONFIG).read_text()
        assert "method: grpo" in config and "type: match" in config
        metrics = [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines() if line]
        assert [m["step"] for m in metrics if "reward" in m] == [5, 10]
        assert sorted(p.name for p in (run_dir / COMPLETIONS).iterdir()) == [
            "completions_00005.parquet",
            "completions_00010.parquet",
        ]
        browser.close()
