"""Issue #16: the landing page (Estimate) of a freshly started server renders within 3 s: its form at once (even
on a fresh clone, while the first model is counted under a spinner), its verdict within 3 s once the spec cache
exists.

Timed from the first page request until the verdict (with its GiB figures) and the memory bill chart are drawn
in a real browser, each time a freshly started server process and a new browser context (no HTTP cache):

- an empty spec cache, as on a fresh clone: the preset is built on torch's meta device and peft finds its
  LoRA targets (imports of torch, transformers and peft: seconds). Printed, and the cache must be written.
- the cache that first server wrote, as on every later start: no torch import at all. Three fresh servers
  (this box's two cores are shared by the browser and the server, single starts vary by ~0.6 s); their median
  time to the verdict is asserted <= 3 s. The bill chart is drawn 1-2 s after the verdict (altair and pandas
  load after the verdict is sent, then the browser loads and compiles Vega for its first chart); printed.
"""

import re
import statistics
import time
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, CHROMIUM_ARGS, exceptions_on, streamlit_server, wait_idle

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

GOAL_S = 3.0
VERDICT = re.compile(r"(FITS|TIGHT|DOES NOT FIT) — [\d.]+ GiB of [\d.]+ GiB")
BILL_DRAWN = '[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg'


def first_render(browser, tmp_path: Path, name: str, cache: Path) -> dict[str, float]:
    """Start a fresh server whose spec cache is `cache`; seconds from the first request to each milestone."""
    ws = tmp_path / f"ws-{name}"
    ws.mkdir()
    with streamlit_server(ws, tmp_path / f"logs-{name}", env={"XDG_CACHE_HOME": str(cache)}) as url:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.goto("about:blank")  # the browser's own start is not the server's
        t0 = time.perf_counter()
        page.goto(url + "/")
        # the page itself: its title and the plan form (the bill follows once the model is counted)
        page.get_by_role("heading", name="Estimate").first.wait_for(state="visible", timeout=60_000)
        page.get_by_text("Batch size (per device)").first.wait_for(state="visible", timeout=60_000)
        shown = time.perf_counter() - t0
        page.get_by_text(VERDICT).first.wait_for(state="visible", timeout=60_000)
        verdict = time.perf_counter() - t0
        page.locator(BILL_DRAWN).first.wait_for(state="visible", timeout=60_000)
        bill = time.perf_counter() - t0
        wait_idle(page)
        assert exceptions_on(page) == []
        context.close()
    return {"page": shown, "verdict": verdict, "bill": bill}


def test_a_fresh_server_renders_the_landing_page_within_three_seconds(tmp_path):
    from playwright.sync_api import sync_playwright

    cache = tmp_path / "cache"  # empty: nothing from this machine's own ~/.cache
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        empty = first_render(browser, tmp_path, "empty-cache", cache)
        written = sorted(f.name.split("-")[0] for f in cache.glob("lora-cockpit/model-specs-*/*.json"))
        warm = [first_render(browser, tmp_path, f"warm-cache-{i}", cache) for i in range(3)]
        browser.close()
    verdict = statistics.median(w["verdict"] for w in warm)
    print(
        "\nfirst render of the Estimate page by a fresh server, seconds from the request:\n"
        f"  empty spec cache (fresh clone; torch, transformers, peft imported): page and form {empty['page']:.2f}, "
        f"verdict {empty['verdict']:.2f}, bill chart {empty['bill']:.2f}\n"
        f"  spec cache of an earlier run, three servers: verdict {_each(warm, 'verdict')} (median "
        f"{verdict:.2f}), bill chart {_each(warm, 'bill')}"
    )
    assert written == ["spec", "targets"], written  # the first server filled the cache for the next ones
    assert verdict <= GOAL_S, f"median verdict after {verdict:.2f} s on a fresh server (goal {GOAL_S} s)"
    # a fresh clone: the page and its form are there at once, the bill says what it is doing while it counts
    assert empty["page"] <= GOAL_S, f"the page took {empty['page']:.2f} s to show with an empty cache"


def _each(runs: list[dict], key: str) -> str:
    return " / ".join(f"{r[key]:.2f}" for r in runs)
