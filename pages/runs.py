"""Runs page: every run of the workspace at a glance, loss curves side by side (and a DPO run's preference
accuracy and reward margin, a GRPO run's reward), the runs' evaluations side by side, open one in the Monitor or evaluate it, delete
finished ones. UI only: summaries come from core.monitor.watch, evaluations from core.eval.results, deleting
from core.runs.admin."""

from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from core.eval.results import compare_rows, headline
from core.fmt import duration
from core.monitor.series import DEFAULT_SMOOTHING_STEPS
from core.monitor.summary import COMPARABLE, comparable_metrics, compare_frame, summarize_runs
from core.recipe import methods, mix
from core.runs.admin import delete_run
from core.runs.launcher import RunError
from core.train.sources import labels as hub_labels
from core.workspace import default_workspace, runs_dir
from ui import charts
from ui.queue_panels import queue_section, sweep_view
from ui.routing import leave_legacy_mode

leave_legacy_mode()


def _num(value, fmt: str, missing: str = "–") -> str:
    """A figure as text: 'None' is no answer in a table (a failed run has no final loss, a CPU run no GPU peak)."""
    return missing if value is None else format(value, fmt)


def _figure(s, label: str) -> str:
    """One of the run's headline figures (core.recipe.methods: a DPO run's reward accuracy, a GRPO run's reward)
    with where it comes from; blank for a run without it (an SFT run: nothing to show, not missing)."""
    found = next((f for f in s.headline if f["label"] == label), None)
    if s.reward_source is None or found is None:
        return ""
    return "–" if found["value"] is None else f"{found['value']:{found['format']}} ({s.reward_source})"


def _settings(s) -> dict:
    """What a run trained with, short: the learning rate as written in a config ("0.0002"), r ("–": full), 4-bit."""
    return {
        "lr": "–" if s.learning_rate is None else f"{s.learning_rate:g}",
        "r": "–" if s.lora_r is None else str(s.lora_r),
        "4-bit": "–" if s.load_in_4bit is None else "yes" if s.load_in_4bit else "no",
    }


# Widths in px: the whole table fits the main column of a 1400 px window (the eval column was cut off there); a
# longer text ends in "…" and shows whole on hover.
WIDTHS = {"run": 190, "state": 70, "method": 55, "steps": 70, "time": 50, "final loss": 70, "best eval": 70,
          "eval (base → tuned)": 200, "lr": 55, "r": 35, "4-bit": 45}  # fmt: skip


def table(summaries) -> None:
    """One row per run, as narrow as the figures allow. A column no run has anything in (the Hub ids, a method's
    own figures, GPU peaks on a CPU, notes) is left out."""
    labels = list(dict.fromkeys(f["label"] for s in summaries for f in s.headline))
    rows = [
        {
            "run": s.name,
            "state": s.state,
            "method": s.method or "–",
            "steps": f"{s.step if s.step is not None else 0}" + (f"/{s.max_steps}" if s.max_steps else ""),
            "time": duration(s.duration_s) or "–",
            "final loss": _num(s.final_loss, ".4f", "– (no loss logged)" if s.state == "failed" else "–"),
            "best eval": _num(s.best_eval_loss, ".4f"),
            # the newest evaluation's first figure ("exact match 0% -> 95%"); all of them under Compare evaluations
            "eval (base → tuned)": (headline(s.run_dir) or "–").split(" · ")[0],
            **_settings(s),
            # the method's own figures (eval when it evaluated, else train)
            **{label: _figure(s, label) for label in labels},
            "peak GPU GiB": _num(s.peak_memory_gib, ".2f"),
            # the Hub ids it trained on, each @ its short commit (sources.json): model, reference, data
            "from the Hub": " · ".join(hub_labels(s.run_dir).values()),
            "note": s.error or (f"{s.malformed} unreadable log line(s) skipped" if s.malformed else ""),
        }
        for s in summaries
    ]
    frame = pd.DataFrame(rows)
    always = ("run", "state", "steps", "final loss", "eval (base → tuned)")  # where to look, even when blank
    empty = [c for c in frame if c not in always and frame[c].isin(["", "–"]).all()]
    config = {name: st.column_config.Column(width=px) for name, px in WIDTHS.items()}
    config["run"] = st.column_config.Column(width=WIDTHS["run"], pinned=True)
    st.dataframe(frame.drop(columns=empty), hide_index=True, width="stretch", column_config=config)
    if "peak GPU GiB" in empty:
        st.caption("No GPU samples in these runs (trained on a CPU): the Monitor charts their RAM instead.")


def compare(summaries) -> None:
    st.subheader("Compare runs")
    names = [s.name for s in summaries]
    by_name = {s.name: s.run_dir for s in summaries}
    chosen = st.multiselect("Runs", names, default=names[:2], key="runs_compare")
    if not chosen:
        st.caption("Choose runs to compare.")
        return
    dirs = [by_name[n] for n in chosen]
    # only what the chosen runs logged: the DPO figures when DPO runs are among them
    metrics = comparable_metrics(dirs) or ["loss"]
    titles = dict(COMPARABLE)
    metric = "loss"
    if len(metrics) > 1:
        metric = st.columns([1, 2])[0].selectbox("Metric", metrics, format_func=titles.get, key="runs_metric")
    c1, c2 = st.columns([1, 2])
    smoothed = c1.toggle("Smoothed", value=True, key="runs_smoothed")
    window = c2.number_input(
        "Smoothing window (steps)",
        min_value=1,
        value=int(DEFAULT_SMOOTHING_STEPS),  # a count of steps: "20", not "20.00"
        step=5,
        key="runs_smoothing",
        disabled=not smoothed,
        help="A debiased moving average over this many training steps (the raw curve: switch Smoothed off).",
    )
    df = compare_frame(dirs, metric, smoothed=smoothed, smoothing_steps=window)
    if df.empty:
        st.caption(f"None of these runs has logged a {'loss' if metric == 'loss' else metric} yet.")
        return
    missing = [n for n in chosen if n not in set(df["run"])]
    if missing and metric != "loss":
        owners = " or ".join(m.label for m in methods.REGISTRY.values() if metric in m.metrics)
        st.caption(f"Not drawn (no {metric} logged: not {owners} runs): {', '.join(missing)}")
    chart = (
        alt.Chart(df)
        .mark_line(strokeWidth=1.5, point=len(df) <= 2 * df["run"].nunique())  # one point is still seen
        .encode(
            alt.X("step:Q", axis=charts.axis(whole=True)),
            alt.Y(
                "value:Q",
                title=titles.get(metric, metric) + (" (smoothed)" if smoothed else ""),
                scale=alt.Scale(zero=False),
                axis=charts.axis(),
            ),
            # distinct hues: runs side by side must not come out in near-identical blues
            alt.Color(
                "run:N",
                scale=alt.Scale(scheme="tableau10"),
                legend=alt.Legend(orient="top", direction="horizontal"),
            ),
            tooltip=["run", "step", "value"],
        )
        .properties(height=420)
    )
    line = methods.chance_of(metric)  # e.g. a preference accuracy against a coin flip
    if line is not None:
        chance = pd.DataFrame({"value": [line]})
        chart = alt.layer(
            chart, alt.Chart(chance).mark_rule(strokeDash=[6, 4], color="#7f7f7f").encode(y="value:Q")
        )
    st.altair_chart(chart, width="stretch")


def compare_evals(summaries) -> None:
    """The runs' newest evaluations side by side (core.eval: base against tuned on held-out rows)."""
    rows = compare_rows([s.run_dir for s in summaries])
    if not rows:
        return
    st.subheader("Compare evaluations")
    df = pd.DataFrame(rows)
    metrics = list(dict.fromkeys(df["metric"]))
    metric = st.columns([1, 2])[0].selectbox("Figure", metrics, key="runs_eval_metric")
    st.dataframe(df[df["metric"] == metric], hide_index=True, width="stretch")


def open_and_delete(summaries) -> None:
    st.subheader("One run")
    by_name = {s.name: s for s in summaries}
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    name = c1.selectbox("Run", list(by_name), key="runs_one")
    run = by_name[name]
    if c2.button("Open in Monitor", key="runs_open", icon=":material/monitoring:"):
        st.session_state["monitor_run"] = run.run_dir
        st.switch_page("pages/monitor.py")
    if c2.button("Evaluate", key="runs_eval", icon=":material/fact_check:", disabled=run.state != "finished"):
        st.session_state["eval_run"] = run.run_dir
        st.switch_page("pages/evaluate.py")
    adapter = (Path(run.run_dir) / "adapter").is_dir()
    if c2.button("Merge", key="runs_merge", icon=":material/merge:", disabled=not adapter):
        st.session_state["merge_run"] = run.name
        st.switch_page("pages/merge.py")
    drawn = mix.drawn_lines(run.run_dir)
    if drawn:  # a run of several data sources: what it drew from each (RUN/mix.json)
        st.caption(f"Data mix of {name}, as drawn")
        st.code("\n".join(line.strip() for line in drawn), language=None)
    with st.expander(f"Delete {name}"):
        st.caption("Deletes the run folder with its checkpoints and adapter. Running runs cannot be deleted.")
        sure = st.checkbox(f"Yes, delete {name} and all its files", key=f"runs_sure_{name}")
        if st.button("Delete", key="runs_delete", disabled=not sure, icon=":material/delete:"):
            try:
                delete_run(run.run_dir, workspace)
            except RunError as exc:
                st.error(str(exc))
            else:
                st.session_state["runs_deleted"] = name
                st.rerun()


# ---- page -------------------------------------------------------------------------------------------------------

st.title("Runs")
workspace = st.session_state.get("workspace") or str(default_workspace())
deleted = st.session_state.pop("runs_deleted", None)
if deleted:
    st.success(f"Deleted run {deleted}.")
queue_section(workspace)
summaries = summarize_runs(runs_dir(workspace))
if not summaries:
    st.info(
        f"No runs yet in {Path(workspace) / 'runs'}. Launch one on the Train page; it will be listed here."
    )
    st.stop()
table(summaries)
sweep_view(workspace, summaries)
compare(summaries)
compare_evals(summaries)
open_and_delete(summaries)
