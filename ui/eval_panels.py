"""The Evaluate page's result view and the Monitor's samples and completions panels (UI only: the figures come from
core.eval, core.rundir and core.monitor.completions)."""

import pandas as pd
import streamlit as st

from core.eval.results import Result, figures, rows_csv, table
from core.rundir import latest_samples

SORTS = {
    "change (largest gain first)": ("change", True),
    "change (largest loss first)": ("change", False),
    "row": ("row", False),
}


def show_result(result: Result, key: str = "ev") -> None:
    """Summary lines, the figures base vs tuned, and the per-row table (sortable, CSV download)."""
    st.code("\n".join(result.lines) or "(no figures)", language=None)
    s = result.settings
    st.caption(
        f"{s.get('what')} on {s.get('data')} · {result.summary.get('rows')} rows · base {s.get('base')} · "
        f"{s.get('device')} · {s.get('max_new_tokens') or 'auto'} new tokens · stored in {result.folder}"
    )
    figs = figures(result)
    if figs:
        st.dataframe(pd.DataFrame(figs), hide_index=True, width="content")
    rows = result.rows or []
    if not rows:
        return
    c1, c2 = st.columns([2, 1], vertical_alignment="bottom")
    sort = c1.selectbox("Sort rows by", list(SORTS), key=f"{key}_sort")
    by, descending = SORTS[sort]
    c2.download_button(
        "Download CSV",
        rows_csv(rows),
        file_name=f"{result.folder.parent.parent.name}-{result.name}.csv",
        mime="text/csv",
        key=f"{key}_csv",
        icon=":material/download:",
    )
    st.dataframe(pd.DataFrame(table(rows, by, descending)), hide_index=True, width="stretch", height=420)
    st.caption(
        "change: the tuned model's score minus the base's on that row (chrF for answers, the reward margin for pairs)."
    )


def progress(view) -> None:
    p = view.progress or {}
    total, done = p.get("total") or 0, p.get("done") or 0
    phase = p.get("phase") or "starting"
    st.progress(min(1.0, done / total) if total else 0.0, text=f"{phase}: {done}/{total}" if total else phase)
    st.caption(f"Running as a background job ({view.path.name}); reloading this page reattaches to it.")


def samples_panel(run_dir: str) -> None:
    """The newest greedy answers to the run's fixed held-out prompts (training.eval_samples), each with the step
    it came from and the answer one evaluation before."""
    samples = latest_samples(run_dir)
    if not samples:
        return
    st.markdown("##### Answers on held-out prompts")
    rows = [
        {
            "prompt": s["prompt"],
            "reference": s["reference"],
            f"answer (step {s['step']})": s["answer"],
            "previous": s["previous"] if s["previous"] is not None else "–",
            "previous step": s["previous_step"] if s["previous_step"] is not None else "–",
            "changed": "–" if s["previous"] is None else ("yes" if s["previous"] != s["answer"] else "no"),
        }
        for s in samples
    ]
    st.table(pd.DataFrame(rows).set_index("prompt"))  # a few rows of text: a static table, read as it is


def completions_panel(completions) -> None:
    """A GRPO run's newest sample completions (core.monitor.completions) with each reward function's score and
    the completion's advantage; nothing for a run that logs none."""
    if completions is None:
        return
    st.markdown("##### Sample completions and their rewards")
    for why in completions.skipped:
        st.caption(f"Not shown: {why}")
    if not completions.rows:
        st.caption("No completions logged yet: the trainer writes them at each logging step.")
        return
    steps = list(dict.fromkeys(r["step"] for r in completions.rows))
    st.caption(
        f"The completions of the last {len(steps)} logging step(s) ({completions.files} logged so far), newest "
        f"first: each reward function's score ({', '.join(completions.rewards) or 'none logged'}) and the "
        "advantage (the completion's reward against its group's mean: what pushes it up or down)."
    )
    st.dataframe(pd.DataFrame(completions.rows), hide_index=True, width="stretch", height=320)
