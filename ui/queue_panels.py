"""The run queue on the pages: Add to queue and Sweep these on the Train page; the queue, its entries' plan
verdicts and a sweep's points ranked on the Runs page. UI only: the queue is core.runs.queue (its supervisor,
core.runs.supervisor, starts the entries), sweeps core.runs.sweep."""

from __future__ import annotations

import math

import altair as alt
import pandas as pd
import streamlit as st

from core.fmt import duration, mem
from core.monitor.summary import compare_frame
from core.recipe.config import ConfigError
from core.runs import queue as Q
from core.runs import sweep as S
from core.runs.supervisor import ensure_running, supervisor_alive
from core.workspace import WorkspaceError
from ui import charts

# The keys a sweep usually varies, offered first (any run-config key path can be typed)
SWEEP_KEYS = (
    "training.learning_rate",
    "lora.r",
    "lora.lora_alpha",
    "training.num_train_epochs",
    "training.per_device_train_batch_size",
    "training.beta",
    "lora.lora_dropout",
)


def _values(text: str) -> list:
    """ "1e-4, 3e-4" -> [0.0001, 0.0003]; words stay words."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            number = float(part)
            out.append(
                int(number) if number.is_integer() and "." not in part and "e" not in part.lower() else number
            )
        except ValueError:
            out.append(part)
    return out


def _queue(workspace: str, raw: dict, stem: str) -> None:
    """Queue `raw` (with or without a sweep section) and say what was queued and what did not fit."""
    try:
        points = S.enqueue(workspace, raw, stem)
        ensure_running(workspace)
    except (ConfigError, S.SweepError, Q.QueueError, WorkspaceError) as exc:
        st.error(f"Not queued: {exc}")
        return
    queued = [p for p in points if p["entry"] is not None]
    for p in points:
        where = f" ({S.label(p['point'])})" if p["point"] else ""
        if p["entry"] is None:
            st.warning(
                f"{p['name']}{where}: not queued, it does not fit ({mem(p['plan'].get('device_total_bytes'))})."
            )
    if queued:
        names = ", ".join(p["name"] for p in queued)
        st.success(f"Queued {names}: they start one after another (the Runs page shows the queue).")
        st.session_state.pop("tr_name", None)  # the next run gets a fresh name


def queue_buttons(workspace: str, cfg: dict | None, name: str, blocked: str | None) -> None:
    """Add to queue, and Sweep these: the form's config as one queue entry, or as a family of them."""
    if st.button("Add to queue", key="tr_queue", disabled=bool(blocked), icon=":material/queue:"):
        if blocked or cfg is None:
            st.error(f"Not queued: {blocked}")
        else:
            _queue(workspace, cfg, name)
    with st.expander("Sweep these"):
        st.caption(
            "Each combination of the values below becomes one run of this config, planned first: points that do "
            "not fit are listed and not queued."
        )
        rows = []
        for i in range(3):
            c1, c2 = st.columns([1, 2])
            key = c1.selectbox(f"Key {i + 1}", ("", *SWEEP_KEYS), key=f"tr_sweep_key{i}")
            text = c2.text_input(
                f"Values {i + 1} (comma-separated)", key=f"tr_sweep_values{i}", disabled=not key
            )
            if key and _values(text):
                rows.append((key, _values(text)))
        n = math.prod(len(v) for _, v in rows) if rows else 0
        if st.button(
            f"Queue {n} runs" if n else "Queue the sweep", key="tr_sweep", disabled=bool(blocked) or not n
        ):
            _queue(workspace, {**cfg, "sweep": {"parameters": dict(rows)}}, name)


def queue_section(workspace: str) -> None:
    """The queue: what waits, what runs, what ended (with a failure's diagnosis); cancel or move a waiting entry."""
    try:
        state = Q.read_queue(workspace)
    except Q.QueueError as exc:
        st.error(str(exc))
        return
    if not state.entries:
        return
    st.subheader("Queue")
    if state.paused:
        st.warning(f"The queue is paused: {state.paused}")
    idle = (state.waiting() or state.active()) and not supervisor_alive(workspace)
    if idle and st.button("Resume the queue", key="runs_queue_resume", icon=":material/play_circle:"):
        Q.resume(workspace)
        ensure_running(workspace)
        st.rerun()
    rows = [
        {
            "id": e.id,
            "run": e.name,
            "state": e.state,
            "plan": e.verdict or "–",
            "planned": mem(e.planned_bytes) if e.planned_bytes else "–",
            "sweep": S.label(e.sweep["values"]) if e.sweep else "",
            "took": duration((e.ended or 0) - e.started) if e.started and e.ended else "",
            "note": " | ".join(x for x in (_last_line(e.reason), e.diagnosis) if x),
        }
        for e in state.entries
    ]
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    waiting = state.waiting()
    if waiting:
        c1, c2, c3 = st.columns([2, 1, 1], vertical_alignment="bottom")
        chosen = c1.selectbox(
            "Waiting entry",
            [e.id for e in waiting],
            format_func=lambda i: f"{i} ({state.find(i).name})",
            key="runs_queue_entry",
        )
        if c2.button("Start it next", key="runs_queue_first", disabled=chosen == waiting[0].id):
            Q.move(workspace, chosen, 1)
            st.rerun()
        if c3.button("Cancel it", key="runs_queue_cancel", icon=":material/cancel:"):
            Q.remove(workspace, chosen)
            st.rerun()


def _last_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[-1] if (text or "").strip() else ""


def sweep_view(workspace: str, summaries) -> None:
    """A sweep's points ranked by their best eval loss (or final loss), the swept keys as columns."""
    try:
        entries = [e for e in Q.read_queue(workspace).entries if e.sweep]
    except Q.QueueError:
        return
    sweeps = list(dict.fromkeys(e.sweep["id"] for e in entries))
    if not sweeps:
        return
    st.subheader("Sweeps")
    chosen = st.selectbox("Sweep", sweeps, key="runs_sweep") if len(sweeps) > 1 else sweeps[0]
    by_run = {s.name: s for s in summaries}
    rows = []
    for e in (e for e in entries if e.sweep["id"] == chosen):
        s = by_run.get(e.name)
        rows.append(
            {
                "run": e.name,
                "state": s.state if s else e.state,
                **{path.rpartition(".")[2]: value for path, value in e.sweep["values"].items()},
                "best eval loss": s.best_eval_loss if s else None,
                "final loss": s.final_loss if s else None,
            }
        )
    df = pd.DataFrame(rows)
    metric = "best eval loss" if df["best eval loss"].notna().any() else "final loss"
    df = df.sort_values(metric, na_position="last")
    st.caption(f"Ranked by {metric} (lower is better); runs that have not logged it yet come last.")
    st.dataframe(df, hide_index=True, width="stretch")
    dirs = [by_run[r].run_dir for r in df["run"] if r in by_run]
    curves = compare_frame(
        dirs, "eval_loss" if metric == "best eval loss" else "loss", smoothed=metric != "best eval loss"
    )
    if not curves.empty:
        chart = (
            alt.Chart(curves)
            .mark_line(strokeWidth=1.5, point=True)
            .encode(
                alt.X("step:Q", axis=charts.axis(whole=True)),
                alt.Y(
                    "value:Q",
                    title="eval loss" if metric == "best eval loss" else "loss (smoothed)",
                    scale=alt.Scale(zero=False),
                    axis=charts.axis(),
                ),
                alt.Color("run:N", scale=alt.Scale(scheme="tableau10"), legend=alt.Legend(orient="top")),
                tooltip=["run", "step", "value"],
            )
            .properties(height=320)
        )
        st.altair_chart(chart, width="stretch")
