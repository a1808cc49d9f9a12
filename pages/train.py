"""Train page: set up a run (prefilled from the Estimate page's plan, else the demo), check it, smoke-test it,
launch it. UI only: checks, estimates, previews and processes are core's (runs_admin, runs, data, preflight)."""

import streamlit as st

from core import jobs
from core.demo.build import demo_dir, demo_ready
from core.recipe.config import ConfigError, validate_config
from core.workspace import WorkspaceError, default_workspace
from ui.jobs import follow
from ui.queue_panels import queue_buttons
from ui.routing import leave_legacy_mode
from ui.train_form import config_form, demo_waiting
from ui.train_panels import (
    launch_button,
    preflight_panel,
    preview_panel,
    smoke_panel,
    verdict_panel,
    yaml_panel,
)

leave_legacy_mode()
st.title("Train")
workspace = st.session_state.get("workspace") or str(default_workspace())
demo_model = str((demo_dir(workspace) / "base").resolve())
previous = st.session_state.get("tr_workspace")
if previous is not None and previous != workspace:
    # The workspace changed in the sidebar: a form still on the old workspace's demo follows to the new one's
    # (else Build would build here while the form trains there).
    old_demo = str(demo_dir(previous).resolve())
    if str(st.session_state.get("tr_model_path") or "").startswith(old_demo):
        for key in [k for k in st.session_state if k.startswith("tr_") or k == "train_config"]:
            del st.session_state[key]
st.session_state["tr_workspace"] = workspace
if not demo_ready(workspace) and st.session_state.get("tr_model_path") in (None, demo_model):
    st.info(
        "**Start with the demo**: a tiny pretrained model and an instruction dataset it learns in a minute or two "
        f"on a CPU, built into {demo_dir(workspace)} (they are not built yet). The form below is set up for it; "
        "or point its Model folder and Dataset file at your own."
    )
    demo_job = jobs.latest(workspace, "demo", key=str(demo_dir(workspace).resolve()))
    if demo_job is not None and not demo_job.done:
        follow(
            lambda: jobs.read(demo_job.path),
            lambda view: st.info(
                "Building the demo assets as a background job (a minute or two on a CPU): "
                + (view.progress.get("log") or ["starting…"])[-1]
            ),
        )
    elif st.button("Build the demo assets", icon=":material/build:", type="primary"):
        try:
            jobs.start(
                workspace,
                "demo",
                {"out": str(demo_dir(workspace).resolve())},
                key=str(demo_dir(workspace).resolve()),
            )
        except (jobs.JobError, WorkspaceError, OSError) as exc:
            st.error(str(exc))
        else:
            st.rerun()
    if demo_job is not None and demo_job.state == "failed":
        st.error(f"Building the demo failed: {demo_job.error}")
elif st.session_state.pop("tr_demo_refill", None) is None and (
    (job := jobs.latest(workspace, "demo", key=str(demo_dir(workspace).resolve()))) is not None
    and job.state == "finished"
    and st.session_state.get("tr_demo_built") != str(job.path)
):
    st.session_state["tr_demo_built"] = str(job.path)
    for key in [
        k for k in st.session_state if (k.startswith("tr_") and k != "tr_demo_built") or k == "train_config"
    ]:
        del st.session_state[key]  # refill the form from the demo config
    st.session_state["tr_demo_refill"] = True
    st.rerun()
raw, errors, name = config_form(workspace)
# only the unbuilt demo's folder and file are missing: nothing for the user to fix, the demo to build
waiting = bool(errors) and set(errors) <= demo_waiting(workspace, raw)
cfg = None
if not errors:
    try:
        cfg = validate_config(raw)
    except ConfigError as exc:
        st.error(str(exc))
st.divider()
st.subheader("Memory plan")
if cfg:
    verdict_panel(cfg)
elif waiting:
    st.caption(
        "Build the demo assets (above) to see the estimate, the data preview and the preflight report."
    )
else:
    st.caption("Fix the marked fields to see the estimate, the data preview and the preflight report.")
blocked = None
if waiting:
    blocked = "Build the demo assets (above), or point Model folder and Dataset file at your own, to launch."
elif errors:
    blocked = f"Fix the {len(errors)} problem(s) marked above to launch."
if cfg:
    st.subheader("Dataset preview")
    preview_panel(cfg)
    st.subheader("Preflight")
    if preflight_panel(workspace, cfg):
        blocked = "Preflight found errors: fix them to launch."
st.subheader("Smoke test and launch")
if cfg and not errors:
    smoke_panel(workspace, cfg, name)
launch_button(workspace, cfg, name, blocked)
queue_buttons(workspace, cfg, name, blocked)
st.divider()
yaml_panel(raw, errors)
