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
# The width of each table's content and of the box it has (Glide's scroller), in px.
OVERFLOW = """() => [...document.querySelectorAll('[data-testid=stDataFrame] .dvn-scroller')]
    .map(s => [s.scrollWidth, s.clientWidth])"""
# "train" first: a server whose first request is a page URL must still route through dashboard.py.
PAGES = ["train", "", "monitor", "runs", "merge"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def seed_runs(ws):
    """Two finished runs as the trainer leaves them, one QLoRA, both evaluated: the Runs table's widest rows."""
    import json

    for name, qlora in (("base-20261203-153012", False), ("qlora-lr-sweep-20261203-160544", True)):
        run = ws / "runs" / name
        evaluation = run / "eval" / "heldout-20261203-161000"
        evaluation.mkdir(parents=True)
        (run / "config.yaml").write_text(
            "model: {path: m}\ndata: {path: d.jsonl}\ntraining: {learning_rate: 0.0003}\nlora: {r: 64}\n"
            f"quantization: {{load_in_4bit: {str(qlora).lower()}}}\n"
        )
        (run / "status.json").write_text(
            json.dumps(
                {"state": "finished", "step": 150, "max_steps": 150, "started": 1000.0, "ended": 1180.0}
            )
        )
        points = [{"time": 1000.0 + s, "step": s, "loss": 2 / s, **({"eval_loss": 3 / s} if s % 50 == 0 else {})}
                  for s in range(10, 151, 10)]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
        (evaluation / "settings.json").write_text(json.dumps({"data": "heldout.jsonl"}))
        line = "eval: exact match 0% -> 95% · loss 2.31 -> 0.42 (20 held-out rows)"
        (evaluation / "summary.json").write_text(json.dumps({"summary": {}, "lines": [line]}))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ws = tmp_path_factory.mktemp("e2e_ws")
    seed_runs(ws)
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
        # the router's page list arrives a moment after the first script run is idle: read the sidebar after it
        page.wait_for_selector('[data-testid="stSidebarNav"] a:has-text("Merge & Export")', timeout=30_000)
        page.screenshot(path=str(SHOTS / f"page-{path or 'estimate'}.png"), full_page=True)
        assert exceptions_on(page) == [], f"page /{path} raised"
        sidebar = page.inner_text('[data-testid="stSidebar"]')
        assert "Workspace" in sidebar and "Merge & Export" in sidebar, (
            f"/{path} was not routed: {sidebar[:200]}"
        )
        assert "no NVIDIA GPU found" in page.inner_text(
            '[data-testid="stSidebar"]'
        ) or "GiB" in page.inner_text('[data-testid="stSidebar"]')
        # every table fits the page at 1400 px: the Runs table's eval, lr, r and 4-bit columns were cut off
        for scrolled, shown in page.evaluate(OVERFLOW):
            assert scrolled <= shown, f"/{path}: a table {scrolled} px wide in {shown} px"
    # used offline: nothing is fetched from outside 127.0.0.1 (the tab icon was a Material Symbols SVG from
    # fonts.gstatic.com), and nothing the pages ask for fails
    assert requests.urls and requests.outside() == [], requests.outside()
    assert requests.failed() == [], requests.failed()
    print(f"screenshots in {SHOTS}")
