"""AppTest: the Diagnostics page renders `lora-cockpit doctor`'s report of this machine in a copyable code block,
each problem above it; and the router lists it."""

import torch
from streamlit.testing.v1 import AppTest

from core import gpu
from tests.conftest import REPO
from tests.fake_gpu import BusyNvml

PAGE = str(REPO / "pages" / "diagnostics.py")


def _page(workspace) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["workspace"] = str(workspace)
    at.session_state["_routed"] = True
    return at.run()


def test_diagnostics_shows_this_machines_report_to_copy(workspace):
    at = _page(workspace)
    assert not at.exception
    report = at.code[0].value  # st.code: the block with the copy button
    assert torch.__version__ in report and f"Workspace      {workspace}: writable" in report
    assert report.rstrip().endswith("Nothing blocks training.")
    assert [s.value for s in at.success] == ["Nothing blocks training on this machine."]
    assert not at.error


def test_diagnostics_names_a_blocking_problem_with_its_fix_with_nvml_mocked(workspace, monkeypatch):
    monkeypatch.setattr(gpu, "NvmlSource", BusyNvml)
    at = _page(workspace / "other")  # another workspace: its own cached report
    assert not at.exception
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert at.error[0].value.startswith("torch is the CPU build but an NVIDIA GPU is present")
        assert "download.pytorch.org/whl/cu128" in at.error[0].value
        assert not at.success
    assert any("GPU 1 (NVIDIA RTX 4090)" in w.value for w in at.warning)
    assert "GPU 1          NVIDIA RTX 4090" in at.code[0].value


def test_the_router_serves_the_diagnostics_page(workspace):
    at = AppTest.from_file(str(REPO / "dashboard.py"), default_timeout=120)
    at.session_state["workspace"] = str(workspace / "routed")
    at.switch_page("pages/diagnostics.py").run()
    assert not at.exception
    assert at.title[0].value == "Diagnostics" and "Nothing blocks training." in at.code[0].value
