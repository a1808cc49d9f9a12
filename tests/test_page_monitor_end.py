"""The Monitor at a run's end (#40 item 5, #37 item 3): a finished run says where it ended and why (an early stop
with the checkpoint it kept), its final and best figures, its adapter, and leads to Evaluate and Merge (the Merge
page opens on that run's adapter)."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest
from test_page_monitor import PAGE, finished_run

from core.rundir import write_status

DASHBOARD = str(Path(__file__).resolve().parents[1] / "dashboard.py")


def test_a_finished_run_sums_itself_up_and_opens_merge_on_its_adapter(workspace, tiny_llama):
    run_dir = finished_run(workspace, tiny_llama, "ended")
    early = {"step": 6, "best_step": 3, "metric": "eval_loss", "best": 1.25, "patience": 1}
    write_status(
        run_dir,
        early_stop=early,
        reason="stopped early at step 6: eval_loss did not improve for 1 evaluations; the adapter is the best "
        "checkpoint, step 3 (eval_loss 1.25)",
    )
    at = AppTest.from_file(DASHBOARD, default_timeout=60)  # the router: the buttons switch pages
    at.session_state["workspace"] = str(workspace)
    at.session_state["monitor_run"] = str(run_dir)
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception, at.exception
    said = " ".join(m.value for m in at.markdown)
    assert "Finished at step 6" in said and "Final loss" in said and "Best eval loss" in said
    captions = [c.value for c in at.caption]
    assert any(c.startswith("Stopped early at step 6") and "step 3" in c for c in captions), captions
    assert any(str(run_dir / "adapter") in c for c in captions)
    at.button(key="mon_merge").click().run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Merge & Export"
    assert at.session_state["merge_adapter_choice"] == "ended (finished)"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
