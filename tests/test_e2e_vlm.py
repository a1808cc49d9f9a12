"""A vision-language model trained from the Train page, in a real browser against a real `streamlit run` server
(issue #36, "Done when"): a tiny random LLaVA and a small dataset of coloured PNG squares (core.demo.toy's
builders) go into the form; the dataset preview shows the rows' images as thumbnails; Launch; the Monitor charts
the loss and sees the run finish, and the run folder holds the LoRA adapter. Screenshots: e2e-screenshots/vlm-*."""

import json
import time
from pathlib import Path

import pytest

from core import rundir
from tests.browser import CHROMIUM, CHROMIUM_ARGS, REPO, exceptions_on, streamlit_server, wait_idle
from tests.test_e2e_flow import nav, wait_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

SHOTS = REPO / "e2e-screenshots"


def _set(page, label: str, value: str) -> None:
    """Type into the form's field and commit it (Enter reruns the script)."""
    box = page.get_by_label(label, exact=True)
    box.fill(value)
    box.press("Enter")
    wait_idle(page)


def test_a_vlm_trains_from_the_train_page_with_its_images_previewed(tmp_path):
    from playwright.sync_api import sync_playwright

    from core.demo.toy import build_image_dataset, build_tiny_vlm

    SHOTS.mkdir(exist_ok=True)
    model = build_tiny_vlm(tmp_path / "vlm", "llava")
    data = build_image_dataset(tmp_path / "images", rows=16)
    ws = tmp_path / "ws"
    ws.mkdir()
    with streamlit_server(ws, tmp_path / "logs") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(60_000)

        page.goto(url + "/")
        wait_idle(page)
        nav(page, "Train")
        _set(page, "Model folder", str(model))
        _set(page, "Dataset file", str(data))
        # a few quick CPU steps, each logged: a loss point per step
        _set(page, "Max length (tokens)", "128")
        _set(page, "Batch size (per device)", "2")
        _set(page, "Gradient accumulation", "1")
        _set(page, "Max steps (-1: epochs)", "3")
        _set(page, "Log every (steps)", "1")
        wait_text(page, r"16 rows, format", 120)
        # the preview draws each row's image as the model will see it
        wait_text(page, r"Images of the first rows", 60)
        thumbs = page.locator('[data-testid="stImage"] img')
        thumbs.first.wait_for(state="visible", timeout=30_000)
        assert thumbs.count() >= 1
        # a decoded picture, not a broken link: the server served the PNG the dataset row names
        assert thumbs.first.evaluate("img => img.complete && img.naturalWidth > 0")
        wait_text(page, r"Preflight: no problems", 120)
        wait_idle(page)
        assert not exceptions_on(page)
        thumbs.first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "vlm-01-train.png"))
        page.get_by_role("button", name="Launch").click()

        wait_text(page, r"Monitor", 60)
        wait_text(page, r"State\s+finished", 240, fail=r"The run failed")
        points = int(wait_text(page, r"(\d+) train-loss points charted", 60).group(1))
        assert points == 3  # logged every step
        wait_idle(page)
        assert not exceptions_on(page)
        # once the trainer has exited, the page around the panels says so too: the picker, Stop (issue #40)
        picker = page.locator('[data-testid="stSelectbox"]').first

        def picker_says() -> str:  # the chosen run's label: drawn as text or held in the search input
            inputs = picker.locator("input")
            return picker.inner_text() + " " + " ".join(i.input_value() for i in inputs.all())

        deadline = time.time() + 60
        while "· finished" not in picker_says() and time.time() < deadline:
            time.sleep(0.5)
        assert "· finished" in picker_says() and "· live" not in picker_says(), picker_says()
        stop = page.get_by_role("button", name="Stop")
        deadline = time.time() + 30  # the page follows the trainer until it has exited, then Stop is off
        while not stop.is_disabled() and time.time() < deadline:
            time.sleep(0.5)
        assert stop.is_disabled()
        page.screenshot(path=str(SHOTS / "vlm-02-monitor.png"))

        run_dir = next((ws / "runs").iterdir())
        metrics = [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines() if line]
        assert [m["loss"] for m in metrics if "loss" in m], metrics
        assert (run_dir / "adapter" / "adapter_config.json").is_file()
        browser.close()
