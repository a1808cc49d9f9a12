"""Evaluate page: the base against the tuned model on held-out rows, as a background job (core.eval via
core.jobs); stored evaluations are shown again without recomputing. UI only."""

import contextlib
from pathlib import Path

import streamlit as st

from core import jobs
from core.eval.heldout import PAGE_DATA
from core.eval.results import SCORED, list_results, read_result
from core.eval.scores import NORMALIZATION
from core.monitor.watch import run_method
from core.recipe import methods
from core.runs.launcher import list_runs
from core.workspace import default_workspace
from ui.eval_panels import progress, show_result
from ui.jobs import follow
from ui.routing import follow_choice, leave_legacy_mode

leave_legacy_mode()


def start(ws: str, run_dir: str) -> None:
    c1, c2, c3 = st.columns([2, 1, 1])
    source = c1.radio(
        "Held-out rows", ["The run's eval split", "A data file"], key="ev_source", horizontal=True
    )
    data = None
    if source == "A data file":
        data = st.text_input(
            f"{PAGE_DATA.name} (.jsonl, .json, .csv, .parquet: questions and answers, a DPO / KTO run's pairs or "
            "rated answers, a GRPO run's prompts with their answer column)",  # the name the job's messages use
            key="ev_data",
        ).strip()
    limit = c2.number_input("Rows (0: all)", min_value=0, value=0, step=10, key="ev_limit")
    new_tokens = c3.number_input("New tokens (0: auto)", min_value=0, value=0, step=8, key="ev_tokens")
    job = jobs.latest(ws, "eval", key=run_dir)
    running = job is not None and not job.done
    if st.button(
        "Evaluate", type="primary", key="ev_go", disabled=running or (source == "A data file" and not data)
    ):
        params = {
            "run": run_dir,
            "data": data or None,
            "limit": int(limit) or None,
            "max_new_tokens": int(new_tokens) or None,
        }
        try:
            jobs.start(ws, "eval", params, key=run_dir)
        except jobs.JobError as exc:
            st.error(str(exc))
            return
        st.rerun()
    if job is None:
        return
    if not job.done:
        follow(lambda: jobs.latest(ws, "eval", key=run_dir), progress)
    elif job.state == "failed":
        st.error(job.error or "The evaluation failed.")
    else:
        done = job.result or {}
        if done.get("folder") and st.session_state.get("ev_shown_job") != str(job.path):
            st.session_state["ev_shown_job"] = str(job.path)  # a finished job's result is the one shown, once
            st.session_state["ev_result"] = Path(done["folder"]).name
        if done.get("reused"):
            st.caption("Evaluated before with these settings: the stored result is shown, not recomputed.")
        if done.get("note"):
            st.caption(done["note"])


st.title("Evaluate")
st.caption(
    "Greedy answers of the base (adapter off) and of the tuned model (adapter on) to held-out prompts, scored as "
    "the run's method asks."
)
workspace = st.session_state.get("workspace") or str(default_workspace())
runs = list_runs(workspace)
if not runs:
    st.info(f"No runs yet in {Path(workspace) / 'runs'}. Train one first; it can be evaluated here.")
    st.stop()
paths = [str(r.path) for r in runs]
follow_choice(paths, "eval_run", "ev_run", "ev_for")  # a run chosen on another page (Runs, Monitor)
by_path = {str(r.path): r for r in runs}
run_dir = st.selectbox(
    "Run", paths, key="ev_run", format_func=lambda p: f"{by_path[p].name} · {by_path[p].state}"
)
st.session_state["eval_run"] = run_dir
with contextlib.suppress(ValueError):  # a config naming no known method: the evaluation says what is wrong
    kind = methods.get(run_method(run_dir)).eval_kind
    st.caption(f"This run: {SCORED[kind]}" + (f" {NORMALIZATION}" if kind == "answers" else ""))
start(workspace, run_dir)
stored = list_results(run_dir)
if stored:
    st.subheader("Results")
    by_name = {r.name: r.folder for r in stored}
    name = st.selectbox(
        "Evaluation", list(by_name), key="ev_result", help="Stored in the run folder under eval/"
    )
    result = read_result(by_name[name])
    if result is not None:
        show_result(result)
