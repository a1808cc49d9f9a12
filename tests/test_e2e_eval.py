"""Evaluate in a real browser against a real `streamlit run` server (issue #24): a finished demo run with samples
on; the Monitor shows the held-out answers of its two evaluations changing; one click evaluates it on the Evaluate page,
which shows the summary lines and the per-row table. Screenshots: e2e-screenshots/eval-*."""

from pathlib import Path

import pytest

from tests.browser import CHROMIUM, REPO, exceptions_on, open_app, streamlit_server, wait_idle
from tests.test_e2e_flow import nav, wait_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
]

SHOTS = REPO / "e2e-screenshots"


def test_finished_demo_run_is_evaluated_from_the_page(tmp_path, monkeypatch, demo_built):
    from playwright.sync_api import sync_playwright

    from core.demo.build import demo_config
    from core.rundir import latest_samples
    from core.runs.launcher import create_run, launch, wait_for

    SHOTS.mkdir(exist_ok=True)
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launched trainer: a tiny model, one thread is fastest
    demo = demo_built.copy(ws / "demo")  # the session's 200-step demo build (conftest.py)
    cfg = demo_config(out=demo)
    # evaluations at steps 5 and 10: the table shows both answers of each held-out prompt
    cfg["training"].update(max_steps=10, eval_steps=5, save_steps=10, eval_samples=3)
    run_dir = create_run(ws, "demo-eval", cfg)
    launch(run_dir)
    info = wait_for(run_dir, timeout=600)
    assert info.state == "finished", (info.reason, (run_dir / "stderr.log").read_text()[-2000:])

    with streamlit_server(ws, tmp_path / "logs") as url, sync_playwright() as p:
        browser, page = open_app(p, url)

        nav(page, "Monitor")
        wait_text(page, r"Answers on held-out prompts", 60)
        wait_text(page, r"answer \(step 10\)", 30)
        table = " ".join(page.locator('[data-testid="stTable"]').last.inner_text().split())
        assert "previous step" in table, table
        # each row's "changed" says whether its step-10 answer differs from its step-5 one, as the run's files
        # have them (whether any answer changed is the training's business, not the page's)
        for sample in latest_samples(run_dir):
            assert sample["step"] == 10 and sample["previous_step"] == 5, sample
            changed = "yes" if sample["answer"] != sample["previous"] else "no"
            said = " ".join(f"{sample['answer']} {sample['previous']} 5 {changed}".split())
            assert said in table, (said, table)
        page.screenshot(path=str(SHOTS / "eval-01-monitor-samples.png"), full_page=True)

        page.get_by_role("button", name="Evaluate", exact=True).click()  # the finished run's summary
        wait_idle(page)
        wait_text(page, r"Held-out rows", 60)
        page.get_by_role("button", name="Evaluate", exact=True).click()
        m = wait_text(page, r"eval: exact match (\d+(?:\.\d)?%) -> (\d+(?:\.\d)?%)", 600, fail=r"failed")
        wait_idle(page)
        assert float(m.group(2).rstrip("%")) > float(m.group(1).rstrip("%")), m.group(0)
        wait_text(page, r"eval: chrF", 10)
        assert page.locator('[data-testid="stDataFrame"]').count() >= 2  # the figures and the per-row table
        assert page.get_by_role("button", name="Download CSV").count() == 1
        assert not exceptions_on(page)
        page.screenshot(path=str(SHOTS / "eval-02-evaluate.png"), full_page=True)
        assert (run_dir / "eval" / "eval-split" / "rows.jsonl").is_file()
        browser.close()
