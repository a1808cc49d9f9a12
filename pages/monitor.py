"""Monitor page: one run, live. The run directory is the truth: a RunWatcher (core.monitor.watch) per run reads only what
its files gained since the last tick, so a reload or a server restart reattaches to a live run with no lost point.
The live part is a fragment re-run by the browser every ~2 s while the run is live; static otherwise."""

import time
from pathlib import Path

import pandas as pd
import streamlit as st

from core import gpu, procs
from core.checkpoints import latest_checkpoint
from core.estimate.plan import GiB
from core.estimate.ram import RUNTIME_BYTES, process_bytes
from core.fmt import duration, first_sentence, mem
from core.monitor.series import DEFAULT_SMOOTHING_STEPS
from core.monitor.summary import summarize_run
from core.monitor.watch import RunWatcher, run_method
from core.recipe import methods, trackers
from core.rundir import LIVE_STATES, read_status
from core.runs.launcher import RunError, launch, list_runs, stop_run
from core.workspace import default_workspace
from ui.charts import draw_lines
from ui.eval_panels import completions_panel, samples_panel
from ui.hub_panels import run_download
from ui.routing import follow_choice, leave_legacy_mode

leave_legacy_mode()

REFRESH_S = 2.0
ENDED = ("finished", "failed", "stopped")
LEVEL = {"error": st.error, "warning": st.warning, "info": st.info}


@st.cache_data(ttl=60, show_spinner=False)
def _no_gpu_reason() -> str | None:
    devices, reason = gpu.detect_gpus()
    return None if devices else (reason or "no NVIDIA GPU found")


def _watcher(run_dir: str) -> RunWatcher:
    watchers = st.session_state.setdefault("watchers", {})
    if run_dir not in watchers:
        watchers[run_dir] = RunWatcher(run_dir)
    return watchers[run_dir]


def _chart(
    df: pd.DataFrame, x: str, title: str, y_title: str, empty: str, rule: dict | None = None, **kw
) -> None:
    """A line chart, or a caption when there is nothing to draw; `rule`: {label: y} dashed horizontal lines."""
    if df is None or df.empty:
        st.caption(f"{title}: {empty}")
        return
    rules = [{"line": label, "value": y} for label, y in (rule or {}).items()]
    draw_lines(df, x, title, y_title, rules=rules, rule_legend_bottom=True, **kw)


CHARTS_PER_ROW = 3


def method_charts(snap) -> None:
    """The run's method's own figures under the loss (core.recipe.methods): a DPO run's rewards, preference
    accuracy against a coin flip and log-probs; a GRPO run's reward, each reward function's, completion lengths
    and learning signal (KL, entropy and clipped ratios once logged: KL only with beta > 0), three to a row."""
    try:
        spec = methods.get(snap.method)
    except ValueError:
        return
    frames = {c.key: snap.charts.get(f"{spec.name}_{c.key}") for c in spec.charts}
    shown = [c for c in spec.charts if frames[c.key] is not None]  # an optional chart: once logged
    for start in range(0, len(shown), CHARTS_PER_ROW):
        row = shown[start : start + CHARTS_PER_ROW]
        for column, chart in zip(
            st.columns(CHARTS_PER_ROW if len(shown) > CHARTS_PER_ROW else len(row)), row, strict=False
        ):
            method_chart(snap, chart, frames[chart.key], column)


def method_chart(snap, chart, frame, column) -> None:
    """One chart of the method's figures in `column`, with the last figures under it."""
    with column:
        extra = {}
        if chart.chance is not None:
            extra = {
                "rule": {f"chance ({chart.chance:g})": chart.chance},
                "y_domain": (0.0, 1.0),
            }
        _chart(
            frame,
            "step",
            chart.title,
            chart.y,
            "not logged yet",
            faint_raw=True,
            **extra,
        )
        last = snap.latest
        figures = [f"{label} {last[key]:{fmt}}" for key, label, fmt in chart.caption if key in last]
        if figures:
            st.caption("last " + " · ".join(figures))


def memory_chart(snap) -> None:
    df = snap.charts.get("gpu_memory")
    rules = []
    # the plan's device total is what nvidia-smi shows for the process: the NVML line's like
    names = {"gpu_capacity_gib": "card capacity", "plan_peak_gib": "plan's predicted peak (device total)"}
    for key, label in names.items():
        if key in snap.lines:
            rules.append({"value": snap.lines[key], "line": label})
    title = "GPU memory (GiB)"
    if df is None or df.empty:
        reason = _no_gpu_reason()
        cpu = snap.charts.get("cpu_memory")
        if cpu is None or cpu.empty:
            st.info(
                f"GPU memory: no GPU samples: {reason}"
                if reason
                else "GPU memory: no samples yet in gpu.jsonl."
            )
            return
        # No GPU: the process's RSS (everything it holds) against what the plan expects the process to hold (its
        # tensors + the runtime: core.estimate.ram), like with like; tensor bytes alone read as a 10x miss
        df, title = cpu, "CPU memory of the training process (GiB)"
        tensors = snap.lines.get("plan_tensor_peak_gib")
        rules = []
        if tensors:
            rules = [{"value": process_bytes(tensors * GiB) / GiB, "line": "plan: tensors + runtime"}]
        said = (
            f" The dashed line is what the plan expects it to hold: its tensor peak ({mem(tensors * GiB)}) + "
            f"about {mem(RUNTIME_BYTES)} for Python, torch and the training libraries."
            if tensors
            else ""
        )
        st.caption(
            f"No GPU samples ({reason or 'none in gpu.jsonl'}): charting the process's CPU memory instead. RSS is "
            f"everything the training process holds: the runtime, the model, the data, the step's tensors.{said}"
        )
    draw_lines(df, "minutes", title, "GiB", rules=rules, rule_colors=("#d62728", "#7f7f7f"))


def header(snap) -> None:
    c = st.columns(5)
    c[0].metric("State", snap.state)
    label = f"Step (of {snap.max_steps:,})" if snap.max_steps else "Step"
    c[1].metric(label, f"{snap.step:,}" if snap.step is not None else "–")
    c[2].metric("ETA", (duration(snap.eta_s) or "–") if snap.eta_s is not None else "–")
    c[3].metric("Tokens/s", f"{snap.tokens_per_s:,.0f}" if snap.tokens_per_s else "–")
    c[4].metric("Elapsed", (duration(snap.elapsed_s) or "–"))
    phase, since = (snap.status or {}).get("phase"), (snap.status or {}).get("phase_started")
    if phase and snap.state in ("starting", "running"):  # what a starting run is busy with, and for how long
        took = f" for {duration(time.time() - since) or '0 s'}" if isinstance(since, (int, float)) else ""
        st.caption(f"Now: {phase}{took}.")
    if snap.progress is not None:
        st.progress(snap.progress)


def health(snap) -> None:
    for w in snap.warnings:  # a stall among them (core.monitor.advice.stall_warning)
        LEVEL.get(w.level, st.warning)(f"**{w.title}**: {w.detail}\n\nFix: {w.fix}")
    if snap.other_processes:
        others = ", ".join(
            f"pid {p.get('pid')} ({(p.get('memory') or 0) / 2**30:.1f} GiB)" for p in snap.other_processes
        )
        st.warning(f"Other processes on this GPU: {others}")
    if snap.malformed_lines:
        st.caption(f"{snap.malformed_lines} malformed line(s) in the run's JSONL files were skipped.")


def failure(snap) -> None:
    if snap.state != "failed":
        return
    st.error(f"**The run failed.** {first_sentence((snap.status or {}).get('reason'))}")
    if snap.diagnosis is not None:
        with st.container(border=True):
            st.markdown("#### Diagnosis")
            st.markdown(snap.diagnosis.markdown())


def charts(snap) -> None:
    c1, c2 = st.columns(2)
    with c1:
        loss = snap.charts.get("loss")
        _chart(loss, "step", "Loss", "loss", "no loss logged yet")
        if loss is not None and not loss.empty:
            last = snap.latest.get("loss")
            st.caption(
                f"{int((loss['series'] == 'train').sum())} train-loss points charted"
                + (f" · last {last:.4f}" if isinstance(last, float) else "")
            )
    with c2:
        memory_chart(snap)
    method_charts(snap)
    c1, c2 = st.columns(2)
    with c1:
        _chart(snap.charts.get("learning_rate"), "step", "Learning rate", "lr", "not logged yet")
    with c2:
        _chart(snap.charts.get("grad_norm"), "step", "Grad norm", "norm", "not logged yet")
    util, temp = snap.charts.get("gpu_util"), snap.charts.get("gpu_temperature")
    if (util is not None and not util.empty) or (temp is not None and not temp.empty):
        c1, c2 = st.columns(2)
        with c1:
            _chart(util, "minutes", "GPU utilisation (%)", "%", "no samples")
        with c2:
            _chart(temp, "minutes", "GPU temperature (°C)", "°C", "no samples")


def logs(snap) -> None:
    with st.expander("stderr (last lines)", expanded=snap.state == "failed"):
        st.code(snap.stderr_tail or "(empty)", language=None)
    with st.expander("stdout (last lines)"):
        st.code(snap.stdout_tail or "(empty)", language=None)


def show(run_dir: str, live: bool, drawn: str) -> None:
    """The run's panels; drawn inside a fragment that the browser re-runs while the run is live. `drawn`: the
    run's state as the page around the fragment drew it."""

    @st.fragment(run_every=REFRESH_S if live else None)
    def panel():
        watcher = _watcher(run_dir)
        watcher.set_smoothing(st.session_state.get("mon_smoothing", DEFAULT_SMOOTHING_STEPS))
        snap = watcher.refresh()
        if live and snap.state in ENDED and (drawn not in ENDED or not procs.alive(run_dir)):
            # the run just ended: redraw the whole page, its selector's label included (a selectbox keeps the label
            # it drew under the same key, so a new key once per end), static once the process is gone
            st.session_state["mon_ended"] = st.session_state.get("mon_ended", 0) + 1
            st.rerun()
        header(snap)
        run_download(run_dir, snap.state)  # a run fetching its Hub model or data before it trains
        failure(snap)
        health(snap)
        samples_panel(run_dir)  # the answers to held-out prompts, above the curves they explain
        charts(snap)
        completions_panel(snap.completions)  # a GRPO run's own completions and what each reward gave them
        logs(snap)
        for tracker, command in trackers.viewers(run_dir):  # the run's own tracker folder, where it wrote one
            st.caption(f"{tracker}: `{command}`")
        st.caption(
            f"{run_dir} · updated {time.strftime('%H:%M:%S')}"
            + (f" · every {REFRESH_S:.0f} s" if live else "")
        )

    panel()


def finished_summary(run_dir: str) -> None:
    """A finished run at a glance: where it ended and why, its final and best figures, the adapter, and what to do
    next (Evaluate, Merge)."""
    s = summarize_run(run_dir)
    status = read_status(run_dir) or {}
    adapter = Path(run_dir) / "adapter"
    kept = adapter if adapter.is_dir() else Path(run_dir) / "model"
    parts = [f"Finished at step {s.step:,}" + (f" in {duration(s.duration_s)}" if s.duration_s else "") + "."]
    if s.final_loss is not None:
        parts.append(f"Final loss {s.final_loss:.4f}.")
    if s.best_eval_loss is not None:
        parts.append(f"Best eval loss {s.best_eval_loss:.4f}.")
    parts.extend(
        f"{f['label'].capitalize()} {f['value']:{f['format']}}." for f in s.headline if f["value"] is not None
    )
    with st.container(border=True):
        st.markdown("**" + " ".join(parts) + "**")
        if status.get("early_stop"):
            st.caption(first_sentence(status.get("reason")).capitalize())
        if kept.is_dir():
            st.caption(f"{'Adapter' if kept == adapter else 'Model'}: `{kept}`")
        c1, c2, _ = st.columns([1, 1, 3])
        if c1.button("Evaluate", key="mon_eval", icon=":material/fact_check:"):
            st.session_state["eval_run"] = run_dir
            st.switch_page("pages/evaluate.py")
        if c2.button("Merge", key="mon_merge", icon=":material/merge:", disabled=kept != adapter):
            st.session_state["merge_run"] = Path(run_dir).name
            st.switch_page("pages/merge.py")


# ---- page -------------------------------------------------------------------------------------------------------

st.title("Monitor")
workspace = st.session_state.get("workspace") or str(default_workspace())
runs = list_runs(workspace)
if not runs:
    st.info(f"No runs yet in {Path(workspace) / 'runs'}. Set one up and launch it on the Train page.")
    st.stop()

paths = [str(r.path) for r in runs]
ended = st.session_state.get("mon_ended", 0)
selector = "mon_run" if not ended else f"mon_run_{ended}"
by_name = {r.name: str(r.path) for r in runs}
if "monitor_run" not in st.session_state and st.query_params.get("run") in by_name:
    # a reload is a new session: it comes back on the run its URL names (another page's choice comes first)
    st.session_state["monitor_run"] = by_name[st.query_params["run"]]
follow_choice(paths, "monitor_run", selector, "mon_for")  # a run chosen on another page
by_path = {str(r.path): r for r in runs}
run_methods = {p: run_method(p) for p in paths}
c1, c2 = st.columns([4, 1], vertical_alignment="bottom")
run_dir = c1.selectbox(
    "Run",
    paths,
    key=selector,
    # Outside the live fragment this label is not redrawn each tick: a live run says "live", not a stale state.
    format_func=lambda p: (
        f"{by_path[p].name}{' · ' + run_methods[p].upper() if run_methods[p] else ''} · "
        f"{'live' if by_path[p].state in LIVE_STATES else by_path[p].state}"
    ),
)
st.session_state["monitor_run"] = run_dir
st.session_state["mon_for"] = run_dir
info = by_path[run_dir]
st.query_params["run"] = info.name  # the URL keeps the run shown: a reload or a shared link opens it
# an ended run whose process is still exiting stays live until it is gone: Stop, the label, the panels follow it
live = info.state in LIVE_STATES or (info.alive and info.state in ENDED)
checkpoint = None if live else latest_checkpoint(run_dir)
if info.state in ("stopped", "failed") and checkpoint is not None:
    if c2.button(
        "Resume", key="mon_resume", icon=":material/play_circle:", help=f"Continue from {checkpoint.name}"
    ):
        try:
            launch(run_dir, resume=True)
            # a fresh watcher: the stopped run's last snapshot (its state, its reason) must not show under the
            # new one while the trainer starts
            st.session_state.get("watchers", {}).pop(run_dir, None)
            st.session_state["mon_flash"] = f"Run {info.name} resumes from {checkpoint.name}."
            st.rerun()
        except RunError as exc:
            st.error(str(exc))
elif c2.button(
    "Stop",
    key="mon_stop",
    disabled=not (live or info.alive),
    icon=":material/stop_circle:",
    help="Graceful: checkpoint, then exit",
):
    try:
        with st.spinner("Stopping: the trainer saves a checkpoint at the end of the current step…"):
            state = stop_run(run_dir)
    except RunError as exc:  # it trains on another machine (shared storage): stopped there
        st.error(str(exc))
    else:
        # the whole page again, at once: the selector's label, Resume in place of Stop, the static panels
        st.session_state["mon_flash"] = f"Run {info.name} is {state}."
        st.rerun()
flash = st.session_state.pop("mon_flash", None)
if flash:
    st.success(flash)
if info.state == "finished":
    finished_summary(run_dir)
elif info.state in ENDED and st.button("Evaluate this run", key="mon_eval", icon=":material/fact_check:"):
    st.session_state["eval_run"] = run_dir
    st.switch_page("pages/evaluate.py")
if info.state in ("stopped", "failed") and info.reason:
    st.caption(f"Why it {info.state}: {first_sentence(info.reason)}")
st.columns([1, 3])[0].number_input(
    "Loss smoothing window (steps)",
    min_value=1,
    value=int(DEFAULT_SMOOTHING_STEPS),  # a count of steps: "20", not "20.00"
    step=5,
    key="mon_smoothing",
    help="The smoothed curve is a debiased moving average over this many training steps.",
)
show(run_dir, live, info.state)
