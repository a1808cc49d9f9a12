"""LoRA Cockpit: the router and the shared sidebar. Run with `streamlit run dashboard.py`."""

from pathlib import Path

import streamlit as st

from core import gpu
from core.runs.queue import QueueError
from core.runs.supervisor import ensure_running
from core.workspace import WorkspaceError, default_workspace
from ui.hub_panels import endpoint_caption

# An emoji, not ":material/flight:": Streamlit fetches a Material icon favicon from fonts.gstatic.com, and the app
# is used offline (no request leaves 127.0.0.1); an emoji favicon is an inline SVG.
st.set_page_config(page_title="LoRA Cockpit", page_icon="✈️", layout="wide")


@st.cache_data(ttl=30, show_spinner=False)
def _gpus():
    devices, reason = gpu.detect_gpus()
    return [d.__dict__ for d in devices], reason


def sidebar():
    with st.sidebar:
        st.markdown("### GPUs")
        devices, reason = _gpus()
        if devices:
            for d in devices:
                total = f"{d['memory_total'] / 2**30:.0f} GiB" if d["memory_total"] else gpu.NA
                st.markdown(f"**{d['index']}** · {d['name']} · {total}")
        else:
            st.caption(reason or "no NVIDIA GPU found")
        st.markdown("### Workspace")
        ws = st.text_input(
            "Folder for runs and exports",
            value=st.session_state.get("workspace", str(default_workspace())),
            help="Everything the app writes goes under this folder: run directories, demo assets, merges.",
        )
        st.session_state["workspace"] = str(Path(ws).expanduser())
        # the first screen says where the app writes, and from where the paths typed in it are read (the folder it
        # was started in: `lora-cockpit` does not leave it)
        st.caption(
            f"Writes under {Path(ws).expanduser().resolve()}. Relative paths you type start in {Path.cwd()}."
        )
        endpoint_caption()


def restart_queue():
    """A queue left with work (the app or the machine restarted, its supervisor killed) goes on: once per
    session and workspace, its supervisor is started when none lives (never a second one: core.runs.supervisor)."""
    ws = st.session_state["workspace"]
    if st.session_state.get("_queue_checked") == ws:
        return
    st.session_state["_queue_checked"] = ws
    try:
        ensure_running(ws)
    except (QueueError, WorkspaceError) as exc:
        st.sidebar.warning(f"Run queue: {exc}")


PAGES = [
    st.Page("pages/estimate.py", title="Estimate", icon=":material/calculate:", default=True),
    st.Page("pages/train.py", title="Train", icon=":material/rocket_launch:"),
    st.Page("pages/monitor.py", title="Monitor", icon=":material/monitoring:"),
    st.Page("pages/runs.py", title="Runs", icon=":material/folder_open:"),
    st.Page("pages/evaluate.py", title="Evaluate", icon=":material/fact_check:"),
    st.Page("pages/merge.py", title="Merge & Export", icon=":material/merge:"),
    st.Page("pages/models.py", title="Models", icon=":material/download:"),
    st.Page("pages/diagnostics.py", title="Diagnostics", icon=":material/troubleshoot:"),
]

page = st.navigation(PAGES)
sidebar()
restart_queue()
# This session has been through the router (see the legacy-mode guard at the top of each page).
st.session_state["_routed"] = True
page.run()
