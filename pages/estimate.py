"""Estimate page: will this fine-tune fit on the card, and what to change if not. Logic lives in core.estimate."""

from __future__ import annotations

import importlib

import streamlit as st

from core.estimate.bill import OUTSIDE_TORCH, estimate, estimate_for_lengths
from core.estimate.fit import fit_search, memory_curve
from core.estimate.levers import lever_savings, modelled_note, what_would_fit, with_every_lever
from core.estimate.plan import (
    ATTN,
    FIT_LIMIT,
    OPTIMIZERS,
    PACKING_STRATEGIES,
    TARGET_LOW,
    GiB,
    Plan,
    PlanError,
)
from core.estimate.specs import SpecError, load_spec, preset_ids
from core.fmt import gib
from core.monitor import gpu
from core.train import methods
from ui.routing import leave_legacy_mode


class _OnFirstUse:
    """A module imported on its first attribute: altair and pandas (0.5 s on a fresh server) load once the
    verdict is sent, for the charts and tables below it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


alt = _OnFirstUse("altair")
pd = _OnFirstUse("pandas")

leave_legacy_mode()

LOCAL = "Local model folder…"
CARD_SIZES = [24, 32, 48, 80, 141]
VERDICT_TEXT = {
    "fits": "Fits: at most 90% of the card, leaving room for estimate error and allocator spikes.",
    "tight": "Tight: between 90% and 100% of the card; fragmentation or a long batch can push it over.",
    "does not fit": "Does not fit: expect CUDA out of memory at the first step.",
}


@st.cache_data(ttl=60, show_spinner=False)
def _cards() -> list[tuple[str, float]]:
    devices, _reason = gpu.detect_gpus()
    return [
        (f"GPU {d.index}: {d.name} ({d.memory_total / GiB:.0f} GiB)", d.memory_total / GiB)
        for d in devices
        if d.memory_total
    ]


def _model_and_method(d: Plan) -> dict:
    """The model, how it is trained (full / LoRA / QLoRA; SFT / DPO / KTO) and the card."""
    presets = preset_ids()
    options = presets + [LOCAL]
    choice = st.selectbox(
        "Model",
        options,
        index=options.index(d.model) if d.model in presets else len(presets),
        key="model",
    )
    model = choice
    if choice == LOCAL:
        model = st.text_input(
            "Model folder (holds config.json)",
            value="" if d.model in presets else d.model,
            key="model_path",
        )
    method = st.radio(
        "Method",
        ["lora", "qlora", "full"],
        index=["lora", "qlora", "full"].index(d.method),
        horizontal=True,
        key="method",
    )
    objective = st.radio(
        "Training method",
        methods.NAMES,
        index=methods.NAMES.index(d.objective),
        format_func=lambda name: methods.get(name).label,
        horizontal=True,
        key="objective",
        help="SFT; DPO (chosen + rejected rows and a reference model); KTO (rated answers and a reference)",
    )
    reference = "auto"
    precompute_ref = False
    if methods.get(objective).traits.reference:
        precompute_ref = st.checkbox(
            "Precompute the reference's log-probs",
            value=d.precompute_ref,
            key="precompute_ref",
            help="training.precompute_ref_log_probs: no reference forward inside a training step",
        )
        reference = st.radio(
            "Reference model",
            ["auto", "copy"],
            key="reference",
            horizontal=True,
            help="auto: the base with the adapter disabled (LoRA); copy: a separate model",
        )
    cards = _cards()
    labels = [c[0] for c in cards] + [f"{g} GiB" for g in CARD_SIZES]
    sizes = [c[1] for c in cards] + [float(g) for g in CARD_SIZES]
    card = st.selectbox("GPU", labels, index=0, key="gpu", help="Defaults to the detected card.")
    gpu_gb = sizes[labels.index(card)]
    return dict(
        model=model,
        method=method,
        objective=objective,
        reference=reference,
        precompute_ref=precompute_ref,
        gpu_gb=gpu_gb,
    )


def _step_settings(d: Plan) -> dict:
    """Batch, length, checkpointing, attention, optimizer and precision."""
    batch_size = st.number_input("Batch size (per device)", value=d.batch_size, step=1, key="batch_size")
    seq_len = st.number_input("Sequence length (tokens)", value=d.seq_len, step=128, key="seq_len")
    gradient_checkpointing = st.checkbox(
        "Gradient checkpointing", value=d.gradient_checkpointing, key="gradient_checkpointing"
    )
    attn = st.selectbox(
        "Attention",
        ATTN,
        index=ATTN.index(d.attn),
        key="attn",
        help="flash: flash_attention_2/3 (GPU); needed for padding-free batches without a mask",
    )
    optims = list(OPTIMIZERS)
    optim = st.selectbox(
        "Optimizer (TrainingArguments optim)",
        optims,
        index=optims.index(d.optim) if d.optim in optims else 0,
        key="optim",
    )
    load_dtype = st.selectbox(
        "Load dtype",
        ["bf16", "fp16", "fp32"],
        index=["bf16", "fp16", "fp32"].index(d.load_dtype),
        key="load_dtype",
    )
    compute_dtype = st.selectbox(
        "Compute dtype",
        ["bf16", "fp16", "fp32"],
        index=["bf16", "fp16", "fp32"].index(d.compute_dtype),
        key="compute_dtype",
    )
    return dict(
        batch_size=batch_size,
        seq_len=seq_len,
        gradient_checkpointing=gradient_checkpointing,
        attn=attn,
        optim=optim,
        load_dtype=load_dtype,
        compute_dtype=compute_dtype,
    )


def _adapter_settings(d: Plan, method: str) -> dict:
    """LoRA, 4-bit quantization, the KV cache of evaluation and the allocator."""
    lora_r = st.number_input("LoRA rank r", value=d.lora_r, step=1, key="lora_r", disabled=method == "full")
    lora_alpha = st.number_input(
        "LoRA alpha", value=d.lora_alpha, step=1, key="lora_alpha", disabled=method == "full"
    )
    lora_dropout = st.number_input(
        "LoRA dropout",
        value=float(d.lora_dropout),
        step=0.05,
        key="lora_dropout",
        disabled=method == "full",
    )
    target_modules = st.text_input(
        "Target modules",
        value=d.target_modules,
        key="target_modules",
        help="all-linear, or names such as q_proj,v_proj",
        disabled=method == "full",
    )
    quant_type = st.selectbox(
        "4-bit type",
        ["nf4", "fp4"],
        index=["nf4", "fp4"].index(d.quant_type),
        key="quant_type",
        disabled=method != "qlora",
    )
    double_quant = st.checkbox(
        "Double quantization", value=d.double_quant, key="double_quant", disabled=method != "qlora"
    )
    prepare_kbit = st.checkbox(
        "QLoRA fp32 upcast (plain Trainer, for comparison)",
        value=d.prepare_kbit,
        key="prepare_kbit",
        disabled=method != "qlora",
        help="peft.prepare_model_for_kbit_training casts embeddings, lm_head and norms to fp32. The engine "
        "(TRL's SFTTrainer) never does: it keeps them 16-bit and casts the adapters to bf16.",
    )
    eval_kv_tokens = st.number_input(
        "Eval/generation KV cache tokens", value=d.eval_kv_tokens, step=256, key="eval_kv_tokens"
    )
    expandable_segments = st.checkbox(
        "expandable_segments allocator", value=d.expandable_segments, key="expandable_segments"
    )
    return dict(
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        quant_type=quant_type,
        double_quant=double_quant,
        prepare_kbit=prepare_kbit,
        eval_kv_tokens=eval_kv_tokens,
        expandable_segments=expandable_segments,
    )


def _lever_toggles(d: Plan) -> dict:
    """The memory levers (README 'Fitting more')."""
    l1, l2, l3 = st.columns(3)
    with l1:
        fused_lm_head = st.checkbox(
            "Fused LM head (tiled loss)",
            value=d.fused_lm_head,
            key="fused_lm_head",
            help="Always on in the engine (TRL's SFTTrainer); off = plain Trainer's full logits, for comparison.",
        )
        padding_free = st.checkbox(
            "Padding-free batches",
            value=d.padding_free,
            key="padding_free",
            help="training.padding_free: the batch's rows as one sequence; needs flash attention on the GPU.",
        )
    with l2:
        packing = st.checkbox("Packing", value=d.packing, key="packing", help="training.packing")
        packing_strategy = st.selectbox(
            "Packing strategy",
            PACKING_STRATEGIES,
            index=PACKING_STRATEGIES.index(d.packing_strategy),
            key="packing_strategy",
            disabled=not packing,
        )
    with l3:
        activation_offloading = st.checkbox(
            "Activation offloading (CUDA)",
            value=d.activation_offloading,
            key="activation_offloading",
            help="training.activation_offloading: saved activations to pinned CPU RAM. Modelled, not yet measured.",
        )
        liger = st.checkbox(
            "Liger kernels (CUDA)",
            value=d.liger,
            key="liger",
            help="training.use_liger_kernel (pip install liger-kernel). Modelled, not yet measured.",
        )
    return dict(
        fused_lm_head=fused_lm_head,
        padding_free=padding_free,
        packing=packing,
        packing_strategy=packing_strategy,
        activation_offloading=activation_offloading,
        liger=liger,
    )


def plan_form() -> Plan:
    saved = st.session_state.get("plan") or {}
    d = Plan(**{k: v for k, v in saved.items() if k in Plan.__dataclass_fields__}) if saved else Plan()
    c1, c2, c3 = st.columns(3)
    with c1:
        values = _model_and_method(d)
    with c2:
        values |= _step_settings(d)
    with c3:
        values |= _adapter_settings(d, values["method"])
    st.markdown("**Memory levers** — what each saves and costs is listed under the bill.")
    values |= _lever_toggles(d)
    ints = ("lora_r", "lora_alpha", "batch_size", "seq_len", "eval_kv_tokens")
    floats = ("lora_dropout", "gpu_gb")
    return Plan(**{k: int(v) if k in ints else float(v) if k in floats else v for k, v in values.items()})


# Segment colours: no greens and no reds, so the green target band and the red card line drawn over the bars
# cannot be mistaken for (or hidden by) a segment. One colour per component the bill can hold.
SEGMENT_COLOURS = [
    "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#9467bd", "#c5b0d5", "#8c564b", "#c49c94",
    "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#17becf", "#9edae5", "#ffd16a",
]  # fmt: skip
BAND_COLOUR = "#2ca02c"  # the 85-90% target band (green)
CARD_COLOUR = "#d62728"  # the card's capacity (red)


def bill_chart(est) -> alt.LayerChart:
    rows = [
        {"component": k, "GiB": v / GiB, "order": i} for i, (k, v) in enumerate(est.components.items()) if v
    ]
    cap = est.gpu_bytes / GiB
    bars = (
        alt.Chart(pd.DataFrame(rows))
        .mark_bar()
        .encode(
            x=alt.X(
                "sum(GiB):Q",
                title="GiB",
                scale=alt.Scale(domain=[0, max(cap, est.device_total_bytes / GiB) * 1.05]),
            ),
            y=alt.Y("plan:N", title=None),
            # Legend below the bar in columns: beside a 120 px bar it is cut after five entries.
            color=alt.Color(
                "component:N",
                sort=[r["component"] for r in rows],
                scale=alt.Scale(range=SEGMENT_COLOURS),
                legend=alt.Legend(orient="bottom", columns=4, title=None, labelLimit=220),
            ),
            order=alt.Order("order:Q"),
            tooltip=["component", alt.Tooltip("GiB:Q", format=".2f")],
        )
        .transform_calculate(plan="'this plan'")
    )
    # Drawn after the bars, see-through with a dashed outline: under them it was hidden by the segments.
    band = (
        alt.Chart(pd.DataFrame([{"lo": cap * TARGET_LOW, "hi": cap * FIT_LIMIT}]))
        .mark_rect(fill=BAND_COLOUR, fillOpacity=0.35, stroke=BAND_COLOUR, strokeWidth=2, strokeDash=[4, 3])
        .encode(x="lo:Q", x2="hi:Q")
    )
    line = (
        alt.Chart(pd.DataFrame([{"cap": cap}])).mark_rule(color=CARD_COLOUR, strokeWidth=2).encode(x="cap:Q")
    )
    return alt.layer(bars, band, line).properties(height=230)


def curve_chart(rows: list[dict], name: str, cap_gib: float) -> alt.LayerChart:
    df = pd.DataFrame([{name: r[name], "GiB": r["device_total_bytes"] / GiB} for r in rows])
    curve = (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(x=alt.X(f"{name}:Q"), y=alt.Y("GiB:Q", title="device total GiB"))
    )
    line = alt.Chart(pd.DataFrame([{"cap": cap_gib}])).mark_rule(color="red").encode(y="cap:Q")
    return alt.layer(curve, line).properties(height=260)


def show(plan: Plan) -> None:
    """The bill of `plan`: the verdict and totals, the terms, the fit search, and what would make it fit."""
    # the first estimate of a model (per library version) builds it on the meta device: seconds, once
    with st.spinner("Counting the model's parameters on torch's meta device (once per model and version)…"):
        spec = load_spec(plan.model)
    est = estimate(plan, spec)
    for w in est.warnings:
        st.warning(w)
    text = f"**{est.verdict.upper()}** — {gib(est.device_total_bytes)} of {gib(est.gpu_bytes)} ({est.fraction:.0%}). "
    {"fits": st.success, "tight": st.warning, "does not fit": st.error}[est.verdict](
        text + VERDICT_TEXT[est.verdict]
    )
    m = st.columns(5)
    m[0].metric("Tensor peak", gib(est.tensor_peak_bytes), help="torch.cuda.max_memory_allocated")
    m[1].metric("Reserved peak", gib(est.reserved_peak_bytes), help="torch.cuda.max_memory_reserved")
    m[2].metric("Device total", gib(est.device_total_bytes), help="what nvidia-smi shows; decides OOM")
    m[3].metric("Peak phase", est.peak_phase)
    m[4].metric("KV cache / token", f"{est.kv_cache_bytes_per_token / 1024:.0f} KiB")
    st.caption(f"{spec.model_id}: {est.total_params:,} parameters, {est.trainable_params:,} trainable.")
    if est.cpu_pinned_bytes:
        st.info(
            f"Activation offloading holds **{gib(est.cpu_pinned_bytes)} of pinned CPU RAM** (not on the card): "
            "the machine needs that much RAM spare, besides the data loader's."
        )
    note = modelled_note(plan)
    if note:
        st.caption(f"⚠ {note}")
    lengths = st.session_state.get("data_lengths")
    if lengths:
        tokens, real = estimate_for_lengths(plan, lengths, spec)
        st.info(
            f"With your data ({len(lengths):,} rows measured on the Train page) the largest batch the sampler "
            f"can form holds **{tokens:,} tokens** (bound: {plan.batch_size * plan.seq_len:,}): device total "
            f"**{gib(real.device_total_bytes)}** ({real.fraction:.0%} of the card) next to the bound's "
            f"{gib(est.device_total_bytes)}."
        )
    st.altair_chart(bill_chart(est), width="stretch")
    st.caption(
        "Green band: the 85–90% target; red line: the card. Terms outside torch: "
        + ", ".join(OUTSIDE_TORCH)
        + "."
    )
    with st.expander("Every term in bytes"):
        st.dataframe(
            pd.DataFrame(
                [{"component": k, "bytes": v, "GiB": round(v / GiB, 3)} for k, v in est.components.items()]
            ),
            hide_index=True,
        )
        st.caption("Tensor bytes at the peak of each phase of the step (the largest is the tensor peak):")
        st.dataframe(
            pd.DataFrame([{"phase": k, "bytes": v, "GiB": round(v / GiB, 3)} for k, v in est.phases.items()]),
            hide_index=True,
        )
    if est.reference:
        st.info(f"Reference model: {est.reference}.")
    fit_panel(plan, spec, est)
    advice_panel(plan, spec)


def fit_panel(plan: Plan, spec, est) -> None:
    """The largest batch and length that fit (with this plan and with every lever on), and memory curves."""
    fit = fit_search(plan, spec)

    def _largest(value, what: str) -> str:
        return f"**{value}**" if value else f"**none** (even {what} is over 90% of the card)"

    st.markdown(
        f"**Largest batch size** at {plan.seq_len} tokens: {_largest(fit['max_batch_size'], 'batch size 1')} · "
        f"**largest sequence length** at batch {plan.batch_size}: "
        f"{_largest(fit['max_seq_len'], 'the shortest sequence tried')} (≤90% of the card)."
    )
    every = with_every_lever(plan)
    if every != plan:
        best = fit_search(every, spec)
        st.markdown(
            f"**With every memory lever on** (the table below): largest batch size "
            f"{_largest(best['max_batch_size'], 'batch size 1')} · largest sequence length "
            f"{_largest(best['max_seq_len'], 'the shortest sequence tried')}."
        )
    cap = est.gpu_bytes / GiB
    c1, c2 = st.columns(2)
    # up to twice the longest length that fits (not the model's 131,072 positions, which flatten the card line)
    reach = 2 * max(plan.seq_len, fit["max_seq_len"] or 0)
    top = max(min(spec.max_position_embeddings or reach, reach), plan.seq_len)
    seqs = sorted(
        {max(64, int(top * f)) for f in (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1)} | {plan.seq_len}
    )
    batches = sorted({1, 2, 4, 8, 16, 32, plan.batch_size})
    c1.altair_chart(curve_chart(memory_curve(plan, "seq_len", seqs, spec), "seq_len", cap), width="stretch")
    c2.altair_chart(
        curve_chart(memory_curve(plan, "batch_size", batches, spec), "batch_size", cap),
        width="stretch",
    )


def advice_panel(plan: Plan, spec) -> None:
    """What would make it fit: each change with its saving and cost, and every lever's saving here."""
    st.subheader("What would make it fit")
    advice = what_would_fit(plan, spec)
    if not advice:
        st.write("Nothing on the list lowers this plan further.")
    for i, a in enumerate(advice, 1):
        combined = "**Combined:** " if a["combined"] else ""
        pinned = f"; pinned CPU RAM {gib(a['cpu_pinned_bytes'])}" if a["cpu_pinned_bytes"] else ""
        st.markdown(
            f"{i}. {combined}{a['change']}: saves **{a['saves_bytes'] / GiB:.2f} GiB** → {a['verdict']}  \n"
            f"   cost: {a['costs']}{pinned}"
        )
    with st.expander("Every memory lever: what it saves here, what it costs"):
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "lever": r["label"],
                        "on": r["on"],
                        "saves GiB": round(r["saves_bytes"] / GiB, 2),
                        "costs": r["costs"],
                        "runs on": r["runs_on"],
                        "planner term": r["term"],
                        "run config": r["config_key"] or "always on in the engine",
                        "modelled from": r["source"],
                    }
                    for r in lever_savings(plan, spec)
                ]
            ),
            hide_index=True,
        )


st.title("Estimate")
st.caption("The whole GPU memory bill of one training step, term by term, before you launch anything.")
plan = plan_form()
try:
    show(plan)
    st.session_state["plan"] = plan.to_dict()  # this page's own state: it comes back as it was left
    if st.button(
        "Use this plan on the Train page",
        key="est_use_plan",
        icon=":material/arrow_forward:",
        help="Copies the method, LoRA settings, precision, optimizer, batch size and length into the Train form "
        "(the Train page lists what it took). Viewing a plan changes nothing there.",
    ):
        st.session_state["train_plan"] = plan.to_dict()
        st.switch_page("pages/train.py")
except (PlanError, SpecError) as exc:
    st.error(str(exc))
