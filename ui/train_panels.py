"""The Train page's panels under the form: the plan's verdict, the data preview, preflight, the smoke test, the YAML
and Launch."""

import altair as alt
import pandas as pd
import streamlit as st

from core import jobs
from core.estimate import from_config
from core.estimate.from_config import estimate_for_config
from core.estimate.plan import GiB, PlanError
from core.estimate.ram import RUNTIME_BYTES, ram_plan
from core.estimate.specs import SpecError
from core.fmt import mem
from core.recipe import methods, mix_preview
from core.recipe.config import MAX_CONFIG_BYTES, ConfigError, config_to_yaml, parse_yaml, validate_config
from core.recipe.data import DataError
from core.runs.admin import (
    beside_live_runs,
    latest_smoke,
    smoke_ran,
    smoke_result,
    start_smoke_test,
)
from core.runs.launcher import RunError, create_run, launch
from core.train.preflight import load_tokenizer_and_config, run_preflight
from core.workspace import WorkspaceError
from ui import reward_editor
from ui.jobs import follow

VERDICT = {"fits": st.success, "tight": st.warning, "does not fit": st.error}


@st.cache_resource(show_spinner=False, max_entries=4)
def _tokenizer_and_config(model_path: str, trust_remote_code: bool):
    return load_tokenizer_and_config({"path": model_path, "trust_remote_code": trust_remote_code})


@st.cache_data(ttl=30, show_spinner="Reading the dataset…")
def _preview(cfg_yaml: str) -> dict:
    import yaml

    cfg = yaml.safe_load(cfg_yaml)
    tok, conf = _tokenizer_and_config(cfg["model"]["path"], cfg["model"]["trust_remote_code"])
    return mix_preview.run_preview(cfg, tok, conf, n=5, length_rows=5000)  # a mix of data.sources: its draw


@st.cache_data(ttl=30, show_spinner="Running preflight…")
def _preflight(cfg_yaml: str) -> list[dict]:
    import yaml

    cfg = yaml.safe_load(cfg_yaml)
    tok, conf = _tokenizer_and_config(cfg["model"]["path"], cfg["model"]["trust_remote_code"])
    return [f.__dict__ for f in run_preflight(cfg, tok, conf)]


def _card():
    """Where a run launched from this page trains: this machine's GPU, or its CPU and RAM."""
    return from_config.local_card()  # looked up at call time: one place to swap the card (tests mock it)


def verdict_panel(cfg: dict) -> None:
    """The planner's verdict for this config where Launch trains it: the plan.json the trainer will write."""
    card = _card().of(cfg)
    try:
        est = estimate_for_config(cfg, card.gpu_gb, card.device)
    except (PlanError, SpecError, ValueError) as exc:
        st.warning(f"No memory estimate for this config: {exc}")
        return
    if card.device == "cpu":  # the process's RAM against the RAM free, not tensor bytes against it
        ram = ram_plan(est.tensor_peak_bytes)
        VERDICT.get(ram.verdict, st.info)(
            f"**{ram.verdict.capitalize()}** in this machine's RAM (no CUDA GPU: it trains on the CPU): the "
            f"training process will hold about {mem(ram.process)} (tensors {mem(ram.tensors)} at the peak, in the "
            f"{est.peak_phase} phase, + about {mem(RUNTIME_BYTES)} for Python, torch and the training libraries) "
            f"of {mem(ram.free)} free ({ram.fraction:.0%}; {mem(ram.total)} in all)."
        )
    else:
        VERDICT.get(est.verdict, st.info)(
            f"**{est.verdict.capitalize()}** on {card.label}: {mem(est.device_total_bytes)} of "
            f"{est.gpu_bytes / GiB:.0f} GiB ({est.fraction:.0%}); tensor peak {mem(est.tensor_peak_bytes)} "
            f"in the {est.peak_phase} phase."
        )
    if card.device == "cuda":
        for busy in from_config.busy_gpus(cfg, est.device_total_bytes):
            st.warning(busy)
    estimate_card = (st.session_state.get("plan") or {}).get("gpu_gb")
    if estimate_card and abs(float(estimate_card) - card.gpu_gb) > 0.5:
        st.caption(
            f"Planned for this machine, where Launch trains it; the Estimate page plans the {estimate_card:g} GiB "
            "card you chose there."
        )
    for w in est.warnings:
        st.caption(f"planner: {w}")
    _eval_caption(cfg, est)
    _data_batch_caption(cfg, est, card.device)


@st.cache_data(ttl=60, show_spinner=False)
def _eval_batch_that_fits(cfg_yaml: str, gpu_gb: float, device: str) -> int | None:
    import yaml

    from core.estimate.fit import eval_batch_for_config

    try:
        return eval_batch_for_config(yaml.safe_load(cfg_yaml), gpu_gb, device)
    except (PlanError, SpecError, ValueError, KeyError):
        return None


def eval_batch_that_fits(cfg: dict) -> int | None:
    """The largest per_device_eval_batch_size a run of `cfg` (validated) evaluates with on this machine's card
    (None: it does not evaluate, or cannot be planned)."""
    card = _card().of(cfg)
    return _eval_batch_that_fits(config_to_yaml(cfg), card.gpu_gb, card.device)


def _eval_caption(cfg: dict, est) -> None:
    """The evaluation phase next to the verdict: what an eval batch holds, and the largest that fits."""
    ev = est.evaluation
    if not ev:
        return
    fits = eval_batch_that_fits(cfg)
    asked = ev["rows"]
    where = f"its {ev['moment']}" if ev["moment"] != "forward" else "its no-grad forward"
    text = (
        f"Evaluation (eval batch {asked}): {mem(ev['bytes'])} of tensors at {where}"
        + (", the run's peak" if est.peak_phase == "eval" else "")
        + (f"; the largest eval batch that fits is {fits}." if fits else ".")
    )
    if fits is not None and asked > fits:
        st.warning(
            f"Eval batch size {asked} runs out of memory at the first evaluation: {fits} is the largest that "
            f"fits ({text})"
        )
    else:
        st.caption(text)


def _data_batch_caption(cfg: dict, est, device: str) -> None:
    """The peak for the largest batch the data's real rows can form, next to the max_length bound above."""
    from core.estimate.bill import estimate_for_lengths
    from core.estimate.plan import Plan

    if not methods.get(cfg).traits.flat_batches:  # padded rows: the bound above is what the step holds
        return
    try:
        lengths = _preview(config_to_yaml(cfg))["lengths"]
        plan = Plan.from_dict(est.plan)
        tokens, real = estimate_for_lengths(plan, lengths)
        if not lengths or tokens >= plan.batch_size * plan.seq_len:
            return
    except (DataError, OSError, ValueError, PlanError, SpecError):
        return  # the preview below says what is wrong with the data
    if device == "cpu":
        ram = ram_plan(real.tensor_peak_bytes)
        peak = f"the process about {mem(ram.process)} ({ram.fraction:.0%} of the RAM free)"
    else:
        peak = f"{mem(real.device_total_bytes)} ({real.fraction:.0%} of the card)"
    st.caption(
        f"With your data ({len(lengths):,} rows measured) the largest batch holds {tokens:,} tokens, not "
        f"{plan.batch_size * plan.seq_len:,}: {peak}. The verdict above is for the bound (every row max length)."
    )


@st.cache_data(ttl=30, show_spinner="Reading the data…")
def _method_preview(method: str, data_yaml: str, rewards_yaml: str) -> tuple[int, list[dict]] | None:
    import yaml

    return methods.get(method).preview(yaml.safe_load(data_yaml), n=5, specs=yaml.safe_load(rewards_yaml))


def method_preview_panel(cfg: dict) -> bool:
    """A run's data as its method reads it (DPO: prompt / chosen / rejected side by side; KTO: each rated answer;
    GRPO: each prompt with the answer column its rewards read); False when the method has no view of its own
    (SFT's token preview follows)."""
    method = methods.get(cfg)
    if cfg["data"].get("sources"):
        if method.name == "sft":
            return False  # the mix's rows and lengths follow
        st.caption(
            f"{method.label}: {method.summary}. Each source's {method.row_noun} are listed with it above."
        )
        return True
    try:
        rewards = cfg.get("rewards") if method.reward_functions else None
        shown = _method_preview(method.name, config_to_yaml(cfg["data"]), config_to_yaml(rewards))
    except (DataError, OSError, ValueError) as exc:
        st.error(f"Cannot preview the {method.data_noun}: {exc}")
        return True
    if shown is None:
        return False
    total, rows = shown
    reference = ", relative to the reference model" if method.traits.reference else ""
    st.caption(f"{total:,} {method.row_noun}. {method.label}: {method.summary}{reference}.")
    frame = pd.DataFrame(rows)
    if "problem" in frame and not frame["problem"].fillna("").astype(bool).any():
        frame = frame.drop(columns="problem")
    st.dataframe(frame, hide_index=True, width="stretch")
    return True


def preview_panel(cfg: dict) -> None:
    if method_preview_panel(cfg):
        return
    try:
        pv = _preview(config_to_yaml(cfg))
    except (DataError, OSError, ValueError) as exc:
        st.error(f"Cannot preview the dataset: {exc}")
        return
    if pv.get("sources"):  # a mix: what its draw takes of each source, and the mix's first rows
        drawn = ", ".join(f"{s['source']} {s['drawn']:,} of {s['rows']:,}" for s in pv["sources"])
        what = f"{pv['total_rows']:,} rows drawn from {len(pv['sources'])} sources ({drawn})"
        measured = f"{len(pv['lengths'])} drawn rows measured"
    else:
        what, measured = (
            f"{pv['total_rows']} rows, format **{pv['format']}**",
            f"the first {len(pv['lengths'])} rows",
        )
    st.caption(
        f"{what}. The prompt is masked out of the loss; the completion is what the model learns. "
        f"{pv['truncated']} of {measured} exceed max length {pv['max_length']}."
    )
    st.dataframe(pd.DataFrame(pv["rows"]), hide_index=True, width="stretch")
    if pv.get("images"):  # image conversations: each row's images, as the model will see them
        _thumbnails(pv["rows"])
    # the Estimate page plans the largest batch these rows can form (padding-free / real lengths)
    st.session_state["data_lengths"] = list(pv["lengths"])
    lengths = pd.DataFrame({"tokens": pv["lengths"]})
    bars = (
        alt.Chart(lengths)
        .mark_bar()
        .encode(
            alt.X("tokens:Q", bin=alt.Bin(maxbins=40, minstep=1), title="tokens per row"),
            alt.Y("count()", title="rows"),
        )
    )
    limit = (
        alt.Chart(pd.DataFrame({"tokens": [pv["max_length"]]})).mark_rule(color="red").encode(x="tokens:Q")
    )
    st.altair_chart((bars + limit).properties(height=300), width="stretch")


def _thumbnails(rows: list[dict]) -> None:
    st.caption("Images of the first rows (the token counts above include each image's tokens):")
    for row, col in zip(rows, st.columns(max(1, len(rows))), strict=False):
        for path in row["images"]:
            col.image(path, width=96, caption=f"row {row['row']}: {row['image_tokens']} image tokens")


IN_PAGE_ROWS = 5000  # up to this many rows preflight runs here (seconds); more run as a background job


@st.cache_data(ttl=30, show_spinner=False)
def _row_count(data_yaml: str) -> int | None:
    import yaml

    from core.recipe.data import DataError

    try:
        return mix_preview.row_count(yaml.safe_load(data_yaml))  # every source of a mix together
    except (DataError, OSError, ValueError):
        return None  # the in-page preflight says what is wrong with the data


def preflight_panel(workspace: str, cfg: dict) -> bool:
    """Show the preflight findings; True when one of them blocks the run (or while they are not known yet).

    A large dataset is checked by a background job (core.jobs), so the page never blocks on it and a reload or
    a second tab reattaches to the same check."""
    import hashlib

    import yaml

    rows = _row_count(yaml.safe_dump(cfg["data"]))
    if rows is not None and rows > IN_PAGE_ROWS:
        key = hashlib.sha1(config_to_yaml(cfg).encode()).hexdigest()
        job = jobs.latest(workspace, "preflight", key=key)
        if job is None:
            try:
                jobs.start(workspace, "preflight", {"config": cfg}, key=key)
            except (jobs.JobError, WorkspaceError) as exc:
                st.error(f"Preflight could not start: {exc}")
                return True
            job = jobs.latest(workspace, "preflight", key=key)
        if not job.done:
            follow(
                lambda: jobs.read(job.path),
                lambda view: st.info(
                    f"Preflight: checking all {rows:,} rows as a background job "
                    f"({view.progress.get('phase', 'starting')})."
                ),
            )
            return True
        if job.state == "failed":
            st.error(f"Preflight could not run: {job.error}")
            return True
        findings = (job.result or {}).get("findings", [])
    else:
        try:
            findings = _preflight(config_to_yaml(cfg))
        except (OSError, ValueError) as exc:
            st.error(f"Preflight could not run: {exc}")
            return True
    if not findings:
        st.success("Preflight: no problems found in the data for this model.")
    for f in findings:  # a message that already says how to fix it comes without a fix of its own
        fix = f"\n\nFix: {f['fix']}" if f["fix"] else ""
        (st.error if f["level"] == "error" else st.warning)(f"**{f['check']}**: {f['message']}{fix}")
    return any(f["level"] == "error" for f in findings)


def smoke_panel(workspace: str, cfg: dict, name: str) -> None:
    st.caption(
        "One real training step at batch size 1 on this machine (and one evaluation, with held-out rows): "
        "measured peak memory and time per step."
    )
    running = latest_smoke(workspace, name)
    live = running is not None and smoke_result(running) is None
    if st.button("Smoke test", key="tr_smoke", icon=":material/science:", disabled=live):
        try:
            start_smoke_test(workspace, name, cfg)  # its own process (and plan.json): the page does not wait
        except (RunError, WorkspaceError, ConfigError) as exc:
            st.error(str(exc))
            return
        st.rerun()
    if running is None:
        return
    if live:
        follow(
            lambda: smoke_result(running),
            lambda _: st.info(
                f"Smoke test running in {running.name}: loading the model and running one step…"
            ),
            done=lambda result: result is not None,
        )
        return
    # a result belongs to the settings it ran: after an edit or Reset it is not these settings' result
    if not smoke_ran(running, cfg):
        st.caption(f"The last smoke test ({running.name}) ran other settings: run one for these.")
        return
    res = {"dir": str(running), "result": smoke_result(running)}
    smoke = res["result"]
    if smoke.get("state") == "failed":
        st.error(f"Smoke test failed: {smoke.get('reason') or 'no reason recorded'} (folder {res['dir']}).")
        return
    c = st.columns(4)
    peak, est = smoke.get("peak_bytes"), smoke.get("estimate_bytes")
    # The same unit for both: "0.002 GiB" next to "2.9 MiB" cannot be compared at a glance.
    c[0].metric(
        "Measured peak",
        mem(peak) if peak else "n/a",
        help=f"Live tensors in a steady step (optimizer state included), by {smoke.get('measured_by')}.",
    )
    delta = f"{peak / est - 1:+.0%} vs estimate" if peak and est else None
    c[1].metric("Estimated peak", mem(est) if est else "n/a", delta=delta, delta_color="off")
    sps = smoke.get("seconds_per_step")
    c[2].metric("Seconds per step", f"{sps:.2f}" if sps else "n/a")
    c[3].metric("Device", smoke.get("device") or "n/a")
    evaluated = smoke.get("eval_peak_bytes")
    if evaluated:  # one evaluation of held-out rows after the step: its peak beside the step's
        c = st.columns(4)
        c[0].metric(
            "Measured eval peak", mem(evaluated), help="Live tensors at the evaluation's largest moment."
        )
        planned = smoke.get("estimate_eval_bytes")
        delta = f"{evaluated / planned - 1:+.0%} vs estimate" if planned else None
        c[1].metric("Estimated eval peak", mem(planned) if planned else "n/a", delta=delta, delta_color="off")
    st.caption(
        f"Batch size {smoke.get('batch_size') or 1}, padded to max length {smoke.get('max_length')}"
        + (f"; one evaluation at eval batch size {smoke.get('eval_batch_size')}" if evaluated else "")
        + f"; results in {res['dir']}."
    )


def yaml_panel(raw: dict, errors: dict) -> None:
    c1, c2 = st.columns(2)
    with c1:
        st.download_button(
            "Download config YAML",
            config_to_yaml(raw),
            file_name=f"{st.session_state.get('tr_name') or 'run'}.yaml",
            mime="application/x-yaml",
            icon=":material/download:",
        )
    with c2:
        up = st.file_uploader("Load a config YAML", type=["yaml", "yml"], key="tr_upload")
        if up is not None and st.session_state.get("tr_upload_seen") != up.file_id:
            # read once: a file that is refused says so once, not again after every later, unrelated edit
            st.session_state["tr_upload_seen"] = up.file_id
            try:
                if up.size > MAX_CONFIG_BYTES:
                    raise ConfigError(f"it is {up.size:,} bytes; a run config is a few hundred")
                cfg = validate_config(parse_yaml(up.getvalue().decode("utf-8"), up.name))
            except (ConfigError, UnicodeDecodeError) as exc:
                st.error(f"{up.name} was not loaded: {exc}")
                return
            if cfg["model"]["trust_remote_code"]:
                # code from a model folder runs only when the user ticks the box, never because a file said so
                cfg["model"]["trust_remote_code"] = False
                st.session_state["tr_trust_asked"] = up.name
            if reward_editor.clear_trust(cfg):  # the same for a reward's own Python file
                st.session_state["tr_reward_trust_asked"] = up.name
            st.session_state["tr_pending"] = cfg  # filled in before the widgets are drawn on the rerun
            st.rerun()


def launch_button(workspace: str, cfg: dict | None, name: str, blocked: str | None) -> None:
    if blocked:
        st.caption(blocked)
    beside = None if blocked else beside_live_runs(workspace)
    if beside:  # a second run on the same machine: said, and launched only when the user insists
        st.warning(beside)
        if not st.checkbox("Launch beside it anyway", key="tr_beside"):
            blocked = "Tick 'Launch beside it anyway' to launch now, or add it to the queue."
    if st.button(
        "Launch", type="primary", key="tr_launch", disabled=bool(blocked), icon=":material/rocket_launch:"
    ):
        if blocked or cfg is None:  # also refuse when the click raced an edit
            st.error(f"Not launched: {blocked}")
            return
        try:
            run_dir = create_run(workspace, name, cfg)
            launch(run_dir)
        except (RunError, WorkspaceError, ConfigError) as exc:
            st.error(f"Not launched: {exc}")
            return
        st.session_state["monitor_run"] = str(run_dir)
        st.session_state.pop("tr_name", None)  # the next run gets a fresh name
        st.switch_page("pages/monitor.py")
