"""Estimate page: will this fine-tune fit on the card, and what to change if not. Logic lives in core.estimate."""

from __future__ import annotations

import copy
import importlib
from dataclasses import replace

import streamlit as st

from core import gpu
from core.estimate import cards
from core.estimate.bill import OUTSIDE_TORCH, estimate, estimate_for_lengths
from core.estimate.fit import fit_search, memory_curve
from core.estimate.from_config import plan_for_draft
from core.estimate.levers import (
    BOUND_LEVERS,
    LEVERS,
    lever_savings,
    modelled_note,
    what_would_fit,
    with_every_lever,
)
from core.estimate.moe_terms import moe_lines
from core.estimate.plan import RECURRENT_KERNELS, GiB, Plan, PlanError
from core.estimate.source import source_line
from core.estimate.specs import SpecError, load_spec, preset_ids
from core.estimate.vlm import vlm_of
from core.estimate.vlm_terms import vlm_lines
from core.fmt import gib, nbytes
from core.recipe import methods
from core.recipe.config import ConfigError, config_to_yaml, default_config
from core.recipe.vision import IMAGE_KEYS
from ui import fields
from ui.estimate_charts import bill_chart, curve_chart
from ui.routing import leave_legacy_mode


class _OnFirstUse:
    """A module imported on its first attribute: pandas (0.5 s with altair on a fresh server, which
    ui.estimate_charts imports when it draws) loads once the verdict is sent, for the tables below it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


pd = _OnFirstUse("pandas")

leave_legacy_mode()

LOCAL = "Local model folder…"
CUSTOM = "Custom size…"
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


RECURRENT_PATHS = {
    "auto": "what is installed here",
    "kernels": "their CUDA kernels (fla, mamba-ssm)",
    "torch": "transformers' torch code",
}
P = "es_"  # this page's widget keys: es_ + the field's name (ui/fields.py)
DEFAULT_MODEL = "meta-llama/Llama-2-7b-hf"
# How the planner is asked beyond the run config: the card, and settings a run config does not carry (the KV cache
# of evaluation, the allocator, the plain-Trainer paths for comparison).
OPTIONS = {
    "gpu": None,
    "gpu_custom_gib": 24.0,
    "eval_kv_tokens": 0,
    "expandable_segments": False,
    "fused_lm_head": True,
    "prepare_kbit": False,
    # which path a hybrid's recurrent layers run on the training machine (core.estimate.layer_kinds.kernel_path)
    "recurrent_kernels": "auto",
    # a vision-language model's images (shown only for one; core.estimate.vlm)
    "image_width": Plan.image_width,
    "image_height": Plan.image_height,
    "max_pixels": Plan.max_pixels,
    "images_per_row": Plan.images_per_row,
    "vision_frozen": Plan.vision_frozen,
    "pan_and_scan": Plan.pan_and_scan,
}


def _saved() -> tuple[dict, dict]:
    """The run config this page edits and its planner options, as the page was left (this page's own state)."""
    cfg = st.session_state.get("estimate_config")
    if not cfg:
        cfg = default_config()
        cfg["model"]["path"] = DEFAULT_MODEL
    saved = st.session_state.get("estimate_options") or {}
    return copy.deepcopy(cfg), {**OPTIONS, **{k: v for k, v in saved.items() if v is not None}}


def _fill_once(cfg: dict, options: dict) -> None:
    """Fill the widgets from the saved config when they are not on screen yet (a first visit, or back from
    another page: Streamlit forgets a page's widgets when it is left)."""
    if P + "max_length" in st.session_state:
        return
    method = methods.get(cfg)
    st.session_state[P + "method"] = method.name
    fields.fill(P, cfg, ESTIMATE_FIELDS, method)
    model = cfg["model"].get("path") or DEFAULT_MODEL
    st.session_state[P + "model"] = model if model in preset_ids() else LOCAL
    st.session_state[P + "model_path"] = "" if model in preset_ids() else model
    for name, value in options.items():
        if name != "gpu" or value in _card_labels():
            st.session_state[P + name] = value
    if options["gpu"] not in _card_labels():  # the card found here, else the one most users own
        st.session_state[P + "gpu"] = next(iter(dict(_cards())), cards.default_label())


ESTIMATE_FIELDS = fields.drawn(n for n in fields.PLAN_FIELDS if n != "model_path") + ("packing_strategy",)


def _card_labels() -> dict[str, float | None]:
    """The detected cards first, then the cards people own by name (core.estimate.cards), then a size of your own
    (None: the custom field says it): label -> GiB."""
    return {**dict(_cards()), **cards.by_label(), CUSTOM: None}


def _card_gib(options: dict) -> float:
    gib = _card_labels().get(options["gpu"])
    return float(options["gpu_custom_gib"] or 0) if gib is None else gib


def _model_and_method() -> None:
    """The model, how it is trained (SFT / DPO / KTO and the method's own settings) and the card."""
    presets = preset_ids()
    st.selectbox("Model", presets + [LOCAL], key=P + "model")
    if st.session_state[P + "model"] == LOCAL:
        st.text_input(
            "Model folder (holds config.json)",
            key=P + "model_path",
            help="Or a Hub id ORG/NAME[@REVISION]: planned from its config.json and safetensors headers, no weights.",
        )
    st.radio(
        "Training method",
        methods.NAMES,
        format_func=lambda name: methods.get(name).label,
        horizontal=True,
        key=P + "method",
        help="SFT; DPO (chosen + rejected rows and a reference model); KTO (rated answers and a reference)",
    )
    for f in methods.get(st.session_state[P + "method"]).fields:
        fields.draw(P, f)
    st.selectbox(
        "GPU",
        list(_card_labels()),
        key=P + "gpu",
        help="The card found here first, then cards by name with the memory nvidia-smi reports for them, or a "
        "size of your own.",
    )
    if st.session_state[P + "gpu"] == CUSTOM:
        st.session_state.setdefault(P + "gpu_custom_gib", OPTIONS["gpu_custom_gib"])  # Streamlit forgot it
        st.number_input("Card memory (GiB)", min_value=1.0, step=1.0, format="%.2f", key=P + "gpu_custom_gib")
    fields.row(P, ("gpus", "strategy"))
    fields.draw(P, fields.FIELDS["cpu_offload"])


def _step_settings() -> None:
    """Batch, length, checkpointing, attention, optimizer and precision."""
    for name in ("batch", "max_length", "ckpt", "attn", "optim", "dtype", "bf16", "fp16"):
        fields.draw(P, fields.FIELDS[name])


def _adapter_settings() -> None:
    """LoRA, QLoRA or full fine-tuning, the KV cache of evaluation and the allocator."""
    fields.draw(P, fields.FIELDS["tuning"])
    full = st.session_state.get(P + "tuning") == "full"
    for name in ("r", "alpha", "dropout", "targets"):
        fields.draw(P, fields.FIELDS[name], disabled=full)
    qlora = st.session_state.get(P + "tuning") == "qlora"
    for name in ("quant_type", "double_quant"):
        fields.draw(P, fields.FIELDS[name], disabled=not qlora)
    st.number_input("Eval/generation KV cache tokens", step=256, key=P + "eval_kv_tokens", min_value=0)
    st.checkbox("expandable_segments allocator", key=P + "expandable_segments")


def _vlm_facts():
    """The chosen model's VLM facts, or None (a language model, or a model that cannot be read yet: the bill
    below says why)."""
    model = st.session_state[P + "model"]
    path = (st.session_state.get(P + "model_path") or "").strip() if model == LOCAL else model
    try:
        return vlm_of(load_spec(path)) if path else None
    except (SpecError, PlanError):
        return None


def _image_settings():
    """A vision-language model's images: their size, Qwen-VL's max_pixels, how many per row, the vision tower.
    Returns the model's VLM facts (None for a language model)."""
    facts = _vlm_facts()
    if facts is None:
        return None
    st.markdown("**Images** — a vision-language model: its image tokens share max_length with the text.")
    c = st.columns(5)
    c[0].number_input("Image width (px)", min_value=1, step=64, key=P + "image_width")
    c[1].number_input("Image height (px)", min_value=1, step=64, key=P + "image_height")
    c[2].number_input(
        "max_pixels (0: processor default)",
        min_value=0,
        step=28 * 28 * 64,
        key=P + "max_pixels",
        disabled=facts.rule != "qwen",
        help="Qwen-VL resizes each image into this many pixels: fewer image tokens, less detail.",
    )
    st.session_state[P + "images_per_row"] = max(1, int(st.session_state.get(P + "images_per_row") or 1))
    c[3].number_input("Images per row", min_value=1, step=1, key=P + "images_per_row")
    c[4].checkbox(
        "Vision tower frozen",
        key=P + "vision_frozen",
        help="LoRA on the language model only (ms-swift's freeze_vit / freeze_aligner); off: trained too.",
    )
    if facts.rule == "fixed":  # Gemma 3
        c[4].checkbox(
            "Pan and scan", key=P + "pan_and_scan", help="Crops of a wide or tall image, 256 tokens each."
        )
    return facts


def _image_keys(cfg: dict, options: dict, facts) -> None:
    """The image settings as the run config's own keys (data.image_size, data.max_pixels, data.images_per_row,
    data.pan_and_scan, model.freeze_vision) for a VLM, so that the plan reads them through the one mapping and
    "Use this plan" hands them to the Train form; none for a language model."""
    for path in IMAGE_KEYS:
        section, _, key = path.partition(".")
        cfg[section].pop(key, None)
    if facts is None:
        return
    w, h = int(options["image_width"] or Plan.image_width), int(options["image_height"] or Plan.image_height)
    cfg["data"]["image_size"] = f"{w}x{h}"
    cfg["data"]["images_per_row"] = max(1, int(options["images_per_row"] or 1))
    if facts.rule == "qwen" and options["max_pixels"]:
        cfg["data"]["max_pixels"] = int(options["max_pixels"])
    if facts.rule == "fixed" and options["pan_and_scan"]:
        cfg["data"]["pan_and_scan"] = True
    if options["vision_frozen"] is False:
        cfg["model"]["freeze_vision"] = False


def _lever_toggles(method) -> None:
    """The memory levers (docs/planner.md, 'Fitting more'), and the plain-Trainer paths to compare the engine with."""
    fields.row(P, ("padding_free", "packing", "packing_strategy"), method=method)
    fields.row(P, ("offload", "liger", None), method=method)
    c1, c2, c3 = st.columns(3)
    c3.selectbox(
        "Recurrent layers run on",
        RECURRENT_KERNELS,
        key=P + "recurrent_kernels",
        format_func=RECURRENT_PATHS.get,
        help="Hybrids only (Qwen3.5, Granite 4.0-H, Nemotron-H, LFM2...): their Gated DeltaNet / Mamba / "
        "short-conv layers hold other memory on transformers' torch code than on the CUDA kernels of "
        "flash-linear-attention, mamba-ssm and causal-conv1d. Auto: the kernels if they are installed here.",
    )
    c1.checkbox(
        "Fused LM head (tiled loss)",
        key=P + "fused_lm_head",
        help="Always on in the engine (TRL's trainers); off = plain Trainer's full logits, for comparison.",
    )
    c2.checkbox(
        "QLoRA fp32 upcast (plain Trainer, for comparison)",
        key=P + "prepare_kbit",
        help="peft.prepare_model_for_kbit_training casts embeddings, lm_head and norms to fp32. The engine "
        "(TRL's trainers) never does: it keeps them 16-bit and casts the adapters to bf16.",
    )


def config_form() -> tuple[dict, dict]:
    """The run config the form says (the one vocabulary: the Train page's fields) and the planner options."""
    cfg, options = _saved()
    _fill_once(cfg, options)
    c1, c2, c3 = st.columns(3)
    with c1:
        _model_and_method()
    with c2:
        _step_settings()
    with c3:
        _adapter_settings()
    facts = _image_settings()
    method = methods.get(st.session_state[P + "method"])
    st.markdown("**Memory levers** — what each saves and costs is listed under the bill.")
    _lever_toggles(method)
    cfg = fields.read(P, cfg, ESTIMATE_FIELDS, method)
    model = st.session_state[P + "model"]
    cfg["model"]["path"] = (st.session_state.get(P + "model_path") or "").strip() if model == LOCAL else model
    options = {name: st.session_state.get(P + name) for name in OPTIONS}
    _image_keys(cfg, options, facts)
    st.session_state["estimate_config"], st.session_state["estimate_options"] = cfg, options
    return cfg, options


def plan_of(cfg: dict, options: dict) -> Plan:
    """The Plan of the form's run config on the chosen card, through the one mapping (core.estimate.from_config),
    with the planner's own options."""
    if not cfg["model"]["path"]:
        raise PlanError(
            "Model folder is empty: enter a local folder that holds config.json, or pick a preset."
        )
    plan = plan_for_draft(
        cfg, _card_gib(options), "cuda", expandable_segments=bool(options["expandable_segments"])
    )
    return replace(
        plan,
        eval_kv_tokens=int(options["eval_kv_tokens"] or 0),
        fused_lm_head=bool(options["fused_lm_head"]),
        prepare_kbit=bool(options["prepare_kbit"]) and plan.tuning == "qlora",
        recurrent_kernels=options["recurrent_kernels"] or "auto",
    )


def show(plan: Plan) -> None:
    """The bill of `plan`: the verdict and totals, the terms, the fit search, and what would make it fit."""
    # the first estimate of a model (per library version) builds it on the meta device: seconds, once
    with st.spinner("Counting the model's parameters on torch's meta device (once per model and version)…"):
        spec = load_spec(plan.model)
    est = estimate(plan, spec)
    st.caption(source_line(plan.model))  # the preset, the local folder, or the Hub id @ commit
    for w in est.warnings:
        st.warning(w)
    per_gpu = f" per GPU ({plan.gpus} GPUs, {plan.strategy})" if plan.gpus > 1 else ""
    text = (
        f"**{est.verdict.upper()}** — {gib(est.device_total_bytes)} of {gib(est.gpu_bytes)}{per_gpu} "
        f"({est.fraction:.0%}). "
    )
    {"fits": st.success, "tight": st.warning, "does not fit": st.error}[est.verdict](
        text + VERDICT_TEXT[est.verdict]
    )
    m = st.columns(5)
    m[0].metric("Tensor peak", gib(est.tensor_peak_bytes), help="torch.cuda.max_memory_allocated")
    m[1].metric("Reserved peak", gib(est.reserved_peak_bytes), help="torch.cuda.max_memory_reserved")
    m[2].metric("Device total", gib(est.device_total_bytes), help="what nvidia-smi shows; decides OOM")
    m[3].metric("Peak phase", est.peak_phase)
    m[4].metric("KV cache / token", nbytes(est.kv_cache_bytes_per_token))
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
    if est.moe:  # a mixture of experts: its experts' dtype and why, and their terms of the bill
        st.info("  \n".join(moe_lines(est)))
    if est.vlm:  # a vision-language model: image tokens per image and where they come from, the vision terms
        st.info("  \n".join(vlm_lines(est)))
    fit_panel(plan, spec, est)
    advice_panel(plan, spec, est)


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
        left = [lever.label for lever in LEVERS if lever.field not in BOUND_LEVERS and lever.applies(plan)]
        st.markdown(
            "**With every memory lever on** that keeps what is trained"
            + (
                f" (all in the table below but {', '.join(left)}: they change the batch or the recipe)"
                if left
                else ""
            )
            + ": largest batch size "
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


def advice_panel(plan: Plan, spec, est) -> None:
    """What would make it fit: each change with its saving and cost, and every lever's saving here. A plan that
    fits needs no change: only the levers' table, for what each would save anyway."""
    st.subheader("What would make it fit")
    advice = [] if est.verdict == "fits" else what_would_fit(plan, spec)
    if est.verdict == "fits":
        st.write(
            f"Nothing: it fits ({est.fraction:.0%} of the card, within the 90% limit). What each memory lever would "
            "save anyway is in the table below."
        )
    elif not advice:
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
cfg, options = config_form()
try:
    plan = plan_of(cfg, options)
    show(plan)
    with st.expander("This plan as a run config (YAML)"):
        st.code(config_to_yaml(cfg), language="yaml")
    if st.button(
        "Use this plan on the Train page",
        key="est_use_plan",
        icon=":material/arrow_forward:",
        help="Hands this run config's method, LoRA settings, precision, optimizer, batch size, length and levers to "
        "the Train form (the Train page lists what it took). Viewing a plan changes nothing there.",
    ):
        st.session_state[fields.HANDOVER] = cfg
        st.switch_page("pages/train.py")
except (ConfigError, PlanError, SpecError) as exc:
    st.error(fields.labelled(str(exc), methods.get(cfg)))  # the field by its label, as on the form
