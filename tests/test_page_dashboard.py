"""AppTest: the router renders its default page and the sidebar reports GPUs without crashing."""

from streamlit.testing.v1 import AppTest

from tests.conftest import REPO


def test_router_renders_sidebar_with_gpu_status_and_workspace(workspace):
    at = AppTest.from_file(str(REPO / "dashboard.py"), default_timeout=60).run()
    assert not at.exception
    sidebar_text = " ".join(m.value for m in at.sidebar.markdown) + " ".join(
        c.value for c in at.sidebar.caption
    )
    assert "GPUs" in sidebar_text
    assert "no NVIDIA GPU found" in sidebar_text or "GiB" in sidebar_text
    ws_input = at.sidebar.text_input[0]
    assert ws_input.value == str(workspace)


def test_router_keeps_the_workspace_chosen_earlier_in_the_session(workspace):
    # AppTest drops sidebar elements on reruns under st.navigation, so the choice is seeded in session state.
    at = AppTest.from_file(str(REPO / "dashboard.py"), default_timeout=60)
    at.session_state["workspace"] = str(workspace / "other")
    at.run()
    assert not at.exception
    assert at.sidebar.text_input[0].value == str(workspace / "other")


def test_the_first_screen_says_where_the_app_writes_and_where_relative_paths_start(
    workspace, tmp_path, monkeypatch
):
    """#49 item 1: one caption in the sidebar; relative paths start in the folder the app was started in."""
    start = tmp_path / "start"
    start.mkdir()
    monkeypatch.chdir(start)
    at = AppTest.from_file(str(REPO / "dashboard.py"), default_timeout=60).run()
    assert not at.exception
    said = " ".join(c.value for c in at.sidebar.caption)
    assert f"Writes under {workspace}." in said and f"Relative paths you type start in {start}." in said, said
