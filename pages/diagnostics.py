"""Diagnostics page: what this machine can train with and what to fix, the report `lora-cockpit doctor` prints,
with a copy button for a bug report. UI only: core.doctor collects the facts (core.machine's, the planner's own)
and words the problems."""

import json

import streamlit as st

from core import doctor
from core.workspace import default_workspace
from ui.routing import leave_legacy_mode

leave_legacy_mode()


# torch and bitsandbytes are imported on the first check (seconds); a minute's cache keeps reruns instant
@st.cache_data(ttl=60, show_spinner="Checking this machine…")
def _report(workspace: str) -> dict:
    return doctor.collect(workspace)


workspace = st.session_state.get("workspace") or str(default_workspace())
st.title("Diagnostics")
st.caption(
    "What this machine can train with: torch's build, the GPUs and who holds their memory, bitsandbytes, the "
    "optional kernels, the disks of the workspace and the Hugging Face cache. The same report as `lora-cockpit "
    "doctor` in a terminal; copy it into a bug report with the button at its top right."
)
if st.button("Check again", icon=":material/refresh:"):
    _report.clear()
report = _report(workspace)

for problem in report["problems"]:
    (st.error if problem["blocks"] else st.warning)(problem["text"])
if report["ok"]:
    st.success("Nothing blocks training on this machine.")
st.code(doctor.format_text(report), language=None, wrap_lines=True)
st.download_button(
    "Download as JSON",
    json.dumps(report, indent=2),
    file_name="lora-cockpit-doctor.json",
    mime="application/json",
    help="The same facts as `lora-cockpit doctor --json`.",
)
