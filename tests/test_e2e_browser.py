"""End to end in a real browser: a real `streamlit run` server driven by headless Chromium.

Screenshots of every step go to e2e-screenshots/ (printed by the test).
"""

from pathlib import Path

import pytest

from tests.browser import CHROMIUM, CHROMIUM_ARGS, REPO, Requests, exceptions_on, streamlit_server, wait_idle

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

SHOTS = REPO / "e2e-screenshots"
# "train" first: a server whose first request is a page URL must still route through dashboard.py.
PAGES = ["train", "", "monitor", "runs", "merge"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ws = tmp_path_factory.mktemp("e2e_ws")
    with streamlit_server(ws, ws / "logs") as url:
        yield url, ws


def test_every_page_loads_without_an_exception_box(browser, server):
    url, _ = server
    SHOTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    requests = Requests(page, url)
    for path in PAGES:
        page.goto(f"{url}/{path}")
        wait_idle(page)
        page.wait_for_selector('[data-testid="stSidebar"]')
        page.screenshot(path=str(SHOTS / f"page-{path or 'estimate'}.png"), full_page=True)
        assert exceptions_on(page) == [], f"page /{path} raised"
        sidebar = page.inner_text('[data-testid="stSidebar"]')
        assert "Workspace" in sidebar and "Merge & Export" in sidebar, (
            f"/{path} was not routed: {sidebar[:200]}"
        )
        assert "no NVIDIA GPU found" in page.inner_text(
            '[data-testid="stSidebar"]'
        ) or "GiB" in page.inner_text('[data-testid="stSidebar"]')
    # used offline: nothing is fetched from outside 127.0.0.1 (the tab icon was a Material Symbols SVG from
    # fonts.gstatic.com), and nothing the pages ask for fails
    assert requests.urls and requests.outside() == [], requests.outside()
    assert requests.failed() == [], requests.failed()
    print(f"screenshots in {SHOTS}")
