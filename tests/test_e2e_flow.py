"""The new user's path, end to end in a real browser against a real `streamlit run` server:
Estimate -> Train (build demo, smoke test, launch) -> Monitor (live points, reload reattaches) -> Runs ->
Merge & Export (try, merge, verification). Screenshots of each step go to e2e-screenshots/flow-*.png."""

import re
import time
from pathlib import Path

import pytest

from tests.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    REPO,
    Requests,
    errors_on,
    exceptions_on,
    streamlit_server,
    wait_idle,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

SHOTS = REPO / "e2e-screenshots"


def metric(page, label: str) -> str:
    box = page.locator(
        '[data-testid="stMetric"]', has=page.locator(f'[data-testid="stMetricLabel"]:has-text("{label}")')
    )
    return box.first.locator('[data-testid="stMetricValue"]').inner_text()


def wait_text(page, pattern: str, timeout_s: float, fail: str | None = None) -> re.Match:
    """Poll the page text until `pattern` appears (live fragments redraw on their own); stop early on `fail`."""
    deadline = time.time() + timeout_s
    while True:
        text = page.inner_text("body")
        m = re.search(pattern, text)
        if m:
            return m
        if fail and re.search(fail, text):
            raise AssertionError(f"{fail!r} appeared while waiting for {pattern!r}: {text[-1500:]}")
        assert not exceptions_on(page), exceptions_on(page)
        if time.time() > deadline:
            raise AssertionError(
                f"{pattern!r} did not appear in {timeout_s} s; page says: {page.inner_text('body')[-1500:]}"
            )
        page.wait_for_timeout(500)


class Steps:
    def __init__(self, page):
        self.page, self.n = page, 0

    def shot(self, name: str):
        self.n += 1
        wait_idle(self.page)
        assert exceptions_on(self.page) == [], f"exception box at step {name}"
        self.page.screenshot(path=str(SHOTS / f"flow-{self.n:02d}-{name}.png"))


def nav(page, title: str):
    page.locator('[data-testid="stSidebarNav"] a', has_text=title).first.click()
    page.wait_for_timeout(500)
    wait_idle(page)


def test_new_user_flow_from_plan_to_verified_export(tmp_path):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(exist_ok=True)
    ws = tmp_path / "ws"
    ws.mkdir()
    with streamlit_server(ws, tmp_path / "logs") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(60_000)
        requests = Requests(
            page, url
        )  # every request of the whole tour: none may leave the server (offline use)
        s = Steps(page)

        # Estimate: a preset, its verdict in words; QLoRA a choice beside LoRA, the GPUs by name.
        page.goto(url + "/")
        wait_idle(page)
        verdict = wait_text(page, r"(FITS|TIGHT|DOES NOT FIT) — [\d.]+ GiB of [\d.]+ GiB", 60).group(0)
        assert metric(page, "Peak phase") in {"forward", "backward", "optimizer"}
        assert page.get_by_role("radio", name="QLoRA (4-bit base)").count() == 1
        gpu = page.get_by_role("combobox", name="GPU", exact=True).input_value()
        if "no NVIDIA GPU found" in page.inner_text('[data-testid="stSidebar"]'):  # else the card found here
            assert gpu == "RTX 4090 · 24 GB (23.99 GiB)", gpu
        s.shot("estimate")

        # Train: a first visit shows no error before the user acts (the demo's paths wait for Build), then build
        # the demo assets, smoke-test one step, launch a run long enough to watch.
        nav(page, "Train")
        assert errors_on(page) == [], errors_on(page)
        wait_text(page, r"Start with the demo", 10)
        page.get_by_role("button", name="Build the demo assets").click()
        # a background job (core.jobs): the page follows it and refills the form when it is done
        wait_text(page, r"Building the demo assets as a background job", 60)
        page.wait_for_selector("text=Start with the demo", state="detached", timeout=300_000)
        wait_idle(page, 300_000)
        assert (ws / "demo" / "base" / "config.json").is_file()
        max_steps = page.get_by_label("Max steps (-1: epochs)")
        max_steps.fill("1000")  # 1-3 minutes here: long enough to watch it live and reload
        max_steps.press("Enter")
        logging = page.get_by_label("Log every (steps)")
        logging.fill("10")
        logging.press("Enter")
        wait_idle(page)
        s.shot("train-form")
        page.get_by_role("button", name="Smoke test").click()
        wait_text(page, r"Seconds per step", 300, fail=r"Smoke test failed|no result after")
        wait_idle(page, 300_000)
        assert re.fullmatch(r"[\d.,]+ (B|KiB|MiB|GiB)", metric(page, "Measured peak"))
        s.shot("train-smoke")
        page.get_by_role("button", name="Launch").click()

        # Monitor: the live run gains points while we watch; no GPU here, said without an error.
        wait_text(page, r"Monitor", 60)
        first = int(wait_text(page, r"(\d+) train-loss points charted", 240).group(1))
        wait_text(page, r"No GPU samples \(.*\): charting the process's CPU memory", 30)
        later = first
        deadline = time.time() + 120
        while later <= first and time.time() < deadline:
            page.wait_for_timeout(1000)
            m = re.search(r"(\d+) train-loss points charted", page.inner_text("body"))
            later = int(m.group(1)) if m else later
        assert later > first, "the loss chart did not gain points while the run was live"
        assert metric(page, "State") == "running"
        s.shot("monitor-live")

        # Viewing the Estimate page first did not change the demo run (issue #16): the run trains the demo
        # config with the two edits made in the form, nothing from the plan (no "Use this plan" click).
        from core.demo.build import demo_config
        from core.recipe.config import load_config

        run_dir = next((ws / "runs").iterdir())
        expected = demo_config(out=ws / "demo")
        expected["training"].update(max_steps=1000, logging_steps=10)
        got = load_config(run_dir / "config.yaml")
        differ = {
            f"{section}.{k}": (got[section].get(k), expected[section].get(k))
            for section in expected
            if isinstance(expected[section], dict)
            for k in set(got.get(section) or {}) | set(expected[section])
            if (got.get(section) or {}).get(k) != expected[section].get(k)
        }
        assert got == expected, differ

        # Reload mid-run: a new session reattaches to the same live run from its directory.
        run_name = run_dir.name
        page.reload()
        wait_idle(page)
        wait_text(page, re.escape(run_name) + r" · updated", 60)  # the live panel names the run it follows
        assert metric(page, "State") == "running"
        again = int(wait_text(page, r"(\d+) train-loss points charted", 60).group(1))
        assert again >= later, "points were lost on reload"
        s.shot("monitor-reloaded")

        # Let it finish (the adapter is written at the end).
        wait_text(page, r"State\s+finished", 600, fail=r"The run failed")
        wait_idle(page)
        assert metric(page, "State") == "finished"
        s.shot("monitor-finished")

        # Runs: listed with its figures.
        nav(page, "Runs")
        table = wait_text(page, re.escape(run_name), 30)
        assert table
        s.shot("runs")

        # Merge & Export: try the adapter, merge it, verification passes.
        nav(page, "Merge & Export")
        prompt = page.get_by_label("Prompt")
        prompt.fill("Uppercase: lorax")  # the demo's task, on a word it never saw
        prompt.press("Control+Enter")
        wait_idle(page)
        page.get_by_role("button", name="Generate with base and adapter").click()
        wait_text(page, r"s for both", 180)
        wait_idle(page, 180_000)
        assert "LORAX" in page.inner_text("body"), "the adapter did not learn the demo task"
        s.shot("merge-try")
        page.get_by_role("tab", name="Merge & export").click()
        assert page.get_by_label("Merge anyway").count() == 0  # the run's own base: nothing to override
        page.get_by_role("button", name="Merge and export").click()
        wait_text(page, r"verification \((full|quick)\): PASSED", 300, fail=r"FAILED|Error|0/0 tensors")
        exports = list((ws / "exports").iterdir())
        assert len(exports) == 1 and (exports[0] / "config.json").is_file()
        s.shot("merge-done")
        browser.close()
    # used offline: nothing left 127.0.0.1 (the tab icon came from fonts.gstatic.com) and nothing failed
    assert requests.urls and requests.outside() == [], requests.outside()
    assert requests.failed() == [], requests.failed()
    print(f"\nscreenshots in {SHOTS} (verdict on the Estimate page: {verdict})")
