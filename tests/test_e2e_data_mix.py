"""A data mix from the Train page, in a real browser against a real `streamlit run` server (issue #50, its
browser test): the demo's dataset plus a second local JSONL added with "Mix in another source" and a weight, the
preview and its length histogram drawn from both sources, a short run launched, and the mix as drawn (rows per
source, RUN/mix.json) on the Runs page. Screenshots: e2e-screenshots/mix-*."""

import json
import re
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, REPO, errors_on, exceptions_on, open_app, streamlit_server, wait_idle
from tests.test_e2e_flow import nav, wait_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

SHOTS = REPO / "e2e-screenshots"
WORDS = [f"{a}{b}x" for a in "klmnopqr" for b in "aeiou"]  # 40 words the demo's char tokenizer reads


def _enter(page, locator, value: str) -> None:
    locator.fill(value)
    locator.press("Enter")
    wait_idle(page)


def test_a_second_source_is_mixed_launched_and_shown_on_the_runs_page(tmp_path, demo_built):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(exist_ok=True)
    ws = tmp_path / "ws"
    ws.mkdir()
    demo_built.copy(ws / "demo")  # the session's demo build: the form starts on its model and train.jsonl
    extra = ws / "extra.jsonl"  # a second chat source, 40 rows
    extra.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Uppercase: {w}"},
                                     {"role": "assistant", "content": w.upper()}]}) + "\n"
            for w in WORDS
        )
    )  # fmt: skip
    with streamlit_server(ws, tmp_path / "logs") as url, sync_playwright() as p:
        browser, page = open_app(p, url)
        nav(page, "Train")
        assert errors_on(page) == [], errors_on(page)
        _enter(page, page.get_by_label("Max steps (-1: epochs)"), "4")

        # the form's Dataset file becomes source 1; source 2 is the extra file at weight 3
        page.get_by_role("button", name="Mix in another source").click()
        wait_idle(page)
        assert page.get_by_role("textbox", name="Source 1", exact=True).input_value() == str(
            (ws / "demo" / "train.jsonl").resolve()
        )
        _enter(page, page.get_by_role("textbox", name="Source 2", exact=True), str(extra))
        _enter(page, page.get_by_role("spinbutton", name="Weight", exact=True).nth(1), "3")
        wait_text(page, r"40 rows, format chat", 60)  # source 2's own line under its row

        # the mix's preview: rows drawn from both sources, and the histogram of the drawn rows' lengths
        drawn = wait_text(page, r"([\d,]+) rows drawn from 2 sources \(([^)]*)\)", 60)
        assert "train.jsonl" in drawn.group(2) and "extra.jsonl" in drawn.group(2), drawn.group(0)
        previewed = {
            m[0]: int(m[1].replace(",", "")) for m in re.findall(r"(\S+) ([\d,]+) of [\d,]+", drawn.group(2))
        }
        assert set(previewed) == {"train.jsonl", "extra.jsonl"} and all(previewed.values()), drawn.group(0)
        assert page.locator('[data-testid="stVegaLiteChart"]').count() >= 1, "no length histogram"
        wait_text(page, r"Preflight: no problems", 60)
        wait_idle(page)
        assert errors_on(page) == [] and exceptions_on(page) == [], (errors_on(page), exceptions_on(page))
        page.get_by_text("rows drawn from 2 sources").scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "mix-01-train.png"))

        page.get_by_role("button", name="Launch").click()
        wait_text(page, r"Monitor", 60)
        wait_text(page, r"State\s+finished", 180, fail=r"The run failed")
        run_dir = next((ws / "runs").iterdir())
        record = json.loads((run_dir / "mix.json").read_text())
        assert [s["source"] for s in record["sources"]] == ["train.jsonl", "extra.jsonl"], record
        assert [s["weight"] for s in record["sources"]] == [1.0, 3.0], record
        # the preview drew what the run drew (the same seed and rule)
        assert {s["source"]: s["drawn"] for s in record["sources"]} == previewed, (record, previewed)

        # Runs: the run's mix as drawn, a line per source with its rows
        nav(page, "Runs")
        wait_text(page, re.escape(f"Data mix of {run_dir.name}, as drawn"), 30)
        shown = page.locator('[data-testid="stCode"]').last.inner_text()
        for i, s in enumerate(record["sources"]):
            line = (
                f"source {i}     {s['source']}: weight {s['weight']}, {s['drawn']} of {s['available']} rows"
            )
            assert line in shown, shown
        assert exceptions_on(page) == []
        page.locator('[data-testid="stCode"]').last.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "mix-02-runs.png"))
        browser.close()
