"""The Train page's run-config form: the field table (widget key -> run-config key, label, choices) and the form
built from it; the run's method adds its own fields (core.train.methods). Filling the form from a config and
reading the config back are each one function, so a config survives the round trip."""

import copy
import time
from pathlib import Path

import streamlit as st

from core.demo.build import demo_config, demo_dir, demo_ready
from core.demo.prefs import PREFERENCE_DEMOS
from core.estimate.from_config import plan_to_config
from core.runs.admin import (
    check_fields,
    check_model_folder,
    check_new_run_name,
)
from core.train import methods
from core.train.config import config_to_yaml, default_config, migrate
from core.train.config_keys import ATTN, DTYPES, METHODS, OPTIMIZERS, SCHEDULERS, SECTIONS
from core.workspace import suggest_run_name

# form widget key -> (section, key) of the run config
FIELDS = {
    "tr_model_path": ("model", "path"),
    "tr_dtype": ("model", "dtype"),
    "tr_attn": ("model", "attn_implementation"),
    "tr_trust": ("model", "trust_remote_code"),
    "tr_4bit": ("quantization", "load_in_4bit"),
    "tr_lora": ("lora", "enabled"),
    "tr_r": ("lora", "r"),
    "tr_alpha": ("lora", "lora_alpha"),
    "tr_dropout": ("lora", "lora_dropout"),
    "tr_targets": ("lora", "target_modules"),
    "tr_data_path": ("data", "path"),
    "tr_format": ("data", "format"),
    "tr_max_length": ("training", "max_length"),
    "tr_eval_split": ("data", "eval_split"),
    "tr_batch": ("training", "per_device_train_batch_size"),
    "tr_accum": ("training", "gradient_accumulation_steps"),
    "tr_max_steps": ("training", "max_steps"),
    "tr_epochs": ("training", "num_train_epochs"),
    "tr_lr": ("training", "learning_rate"),
    "tr_sched": ("training", "lr_scheduler_type"),
    "tr_warmup": ("training", "warmup_steps"),
    "tr_optim": ("training", "optim"),
    "tr_ckpt": ("training", "gradient_checkpointing"),
    "tr_logging": ("training", "logging_steps"),
    "tr_save": ("training", "save_steps"),
}


# each method's own settings (core.train.methods: DPO's beta, KTO's weights, a reference model, ...), shown and
# written only for that method (the other methods' TRL configs do not know the keys)
METHOD_FIELDS = {f.state: f for m in methods.REGISTRY.values() for f in m.fields}


# memory levers of the engine (README "Fitting more"); padding-free and packing are SFTTrainer's only
LEVER_FIELDS = {
    "tr_padding_free": ("training", "padding_free"),
    "tr_packing": ("training", "packing"),
    "tr_offload": ("training", "activation_offloading"),
    "tr_liger": ("training", "use_liger_kernel"),
}


FLAT_BATCH_LEVERS = {"tr_padding_free", "tr_packing"}  # SFTTrainer's only: a method's traits.flat_batches


METHOD_LABELS = {m.name: m.choice for m in methods.REGISTRY.values()}


CHOICES = {
    "tr_dtype": DTYPES,
    "tr_attn": ATTN,
    "tr_format": tuple(dict.fromkeys(("auto", *(f for m in methods.REGISTRY.values() for f in m.formats)))),
    "tr_sched": SCHEDULERS,
    "tr_optim": OPTIMIZERS,
}


FLOAT_KEYS = {"tr_alpha", "tr_dropout", "tr_eval_split", "tr_epochs", "tr_lr", "tr_warmup"}


@st.cache_data(ttl=10, show_spinner=False)
def _field_errors(raw_yaml: str) -> dict[str, str]:
    import yaml

    return check_fields(yaml.safe_load(raw_yaml))


def _base_config(workspace: str) -> tuple[dict, str]:
    """The config the form starts from, and where it came from. A plan reaches the form only when the user asked
    for it ("Use this plan" on the Estimate page): merely viewing the Estimate page changes nothing here."""
    plan = st.session_state.get("train_plan")
    if st.session_state.get("train_config"):
        return migrate(st.session_state["train_config"]), "your last edits"
    base = demo_config(workspace) if demo_ready(workspace) else _demo_paths(workspace)
    if plan:
        return _from_plan(plan, base)
    return base, "the demo model and dataset"


def _from_plan(plan: dict, base: dict) -> tuple[dict, str]:
    """The plan's settings over `base`. A hub id as the plan's model is not a folder here (nothing is downloaded):
    the form keeps base's local model and says so."""
    # Without the paths plan_to_config returns the config unvalidated: a planner setting the trainer does not
    # offer is then flagged at its field instead of failing the whole page.
    unchecked = copy.deepcopy(base)
    unchecked["model"]["path"] = unchecked["data"]["path"] = None
    cfg = plan_to_config({k: v for k, v in plan.items() if k != "model"}, unchecked)
    cfg["data"]["path"] = base["data"].get("path")
    cfg["model"]["path"] = plan.get("model") or base["model"].get("path")
    source = f"the Estimate page's plan ({plan.get('model')})"
    if check_model_folder(plan.get("model")) and base["model"].get("path"):
        cfg["model"]["path"] = base["model"]["path"]
        # The plan's batch size and length were sized for its model and card, not for the model kept here
        # (the demo model has 64 positions): keep base's until the user points at the planned model.
        cfg["training"]["max_length"] = base["training"]["max_length"]
        cfg["training"]["per_device_train_batch_size"] = base["training"]["per_device_train_batch_size"]
        source += (
            f"; its model is not a local folder, so the model, batch size and max length stay those of "
            f"{base['model']['path']}: point the model folder at your local copy to train it"
        )
    taken = _changes(base, cfg)
    source += ("; it set " + ", ".join(taken)) if taken else "; it matches the form's settings"
    return cfg, source


def _changes(before: dict, after: dict) -> list[str]:
    """'training.optim adamw_torch → paged_adamw_8bit' for each key a plan changed (the form says what it took)."""
    out = []
    for section, values in after.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            old = (before.get(section) or {}).get(key)
            if key != "path" and value != old:
                out.append(f"{section}.{key} {old!r} → {value!r}")
    return out


def _demo_paths(workspace: str) -> dict:
    """The demo config before its assets exist (same paths; the form shows that the folder is missing)."""
    cfg = default_config()
    folder = demo_dir(workspace).resolve()
    cfg["model"]["path"], cfg["data"]["path"] = str(folder / "base"), str(folder / "train.jsonl")
    return cfg


def _fill_form(cfg: dict) -> None:
    """Put a config's values into the form's widgets (before they are drawn)."""
    notes = []
    for key, (section, name) in FIELDS.items():
        default = default_config()[section][name]
        value = cfg.get(section, {}).get(name, default)
        if key == "tr_targets" and isinstance(value, list):
            value = ", ".join(value)
        if key == "tr_model_path" or key == "tr_data_path":
            value = "" if value is None else str(value)
        if key in FLOAT_KEYS and value is not None:
            value = float(value)  # number_input takes its type from the value: keep floats floats
        if (
            key in CHOICES and value not in CHOICES[key]
        ):  # e.g. a planner optimizer the trainer does not offer
            notes.append(f"{section}.{name} {value!r} is not available here; the form uses {default!r}.")
            value = default
        st.session_state[key] = value
    method = cfg.get("method", "sft")
    st.session_state["tr_method"] = method if method in METHODS else "sft"
    own = {f.state: f for f in methods.get(st.session_state["tr_method"]).fields}
    for key, f in {**METHOD_FIELDS, **own}.items():
        value = cfg.get(f.section, {}).get(f.key) if key in own else None
        if f.as_list and isinstance(value, list):
            value = value[0] if value else None
        if f.kind == "path":
            value = "" if value is None else str(value)
        if f.kind == "float" and value is not None:
            value = float(value)
        st.session_state[key] = f.default if value is None else value
    for key, (section, name) in LEVER_FIELDS.items():
        st.session_state[key] = bool(cfg.get(section, {}).get(name))
    if st.session_state.get("tr_format") not in ("auto", *methods.get(st.session_state["tr_method"]).formats):
        st.session_state["tr_format"] = "auto"
    st.session_state["tr_notes"] = notes
    st.session_state["tr_base"] = copy.deepcopy(cfg)


def method_fields(method) -> None:
    """The method's own settings (core.train.methods: FormField), one widget each, in a row."""
    widths = [3 if f.kind == "path" else 1 for f in method.fields]
    for column, f in zip(st.columns(widths), method.fields, strict=True):
        if f.kind == "float":
            column.number_input(f.label, key=f.state, step=0.05, format="%.2f", help=f.help)
        elif f.kind == "choice":
            column.selectbox(f.label, f.choices, key=f.state, help=f.help)
        elif f.kind == "bool":
            column.checkbox(f.label, key=f.state, help=f.help)
        else:
            column.text_input(f.label, key=f.state, help=f.help)


def _raw_config() -> dict:
    """The config as the form says it (not validated: the checks report each field's problem)."""
    raw = copy.deepcopy(st.session_state.get("tr_base") or default_config())
    for section in SECTIONS:
        raw.setdefault(section, {})
    for key, (section, name) in FIELDS.items():
        value = st.session_state.get(key)
        if key == "tr_targets":
            value = (value or "").strip()
            if value != "all-linear":
                value = [m.strip() for m in value.split(",") if m.strip()] or value
        if (
            key in ("tr_alpha", "tr_warmup")
            and isinstance(value, float)
            and value >= 1
            and value.is_integer()
        ):
            value = int(value)  # whole numbers read as such in the YAML (warmup >= 1 counts steps)
        if key in ("tr_model_path", "tr_data_path"):
            value = (value or "").strip() or None
        raw[section][name] = value
    method = st.session_state.get("tr_method") or "sft"
    raw["method"] = method
    flat = methods.get(method).traits.flat_batches
    for key, (section, name) in LEVER_FIELDS.items():
        unsupported = not flat and key in FLAT_BATCH_LEVERS
        if st.session_state.get(key) and not unsupported:
            raw[section][name] = True
        elif name in raw[section] or unsupported:
            raw[section].pop(name, None)  # off is the libraries' default: keep the YAML short
    own = methods.get(method).fields
    for f in METHOD_FIELDS.values():
        raw[f.section].pop(f.key, None)
    for f in own:
        value = st.session_state.get(f.state)
        if f.as_list:
            value = [value] if value else None
        if f.kind == "path":
            value = (value or "").strip() or None
        if value is not None:
            raw[f.section][f.key] = value
    return raw


# The form's labels for the config keys it shows: a message names the field as the user sees it, and the key
# (for the YAML) in brackets.
LABELS = {
    "model.path": "Model folder",
    "model.dtype": "Weights dtype",
    "model.attn_implementation": "Attention",
    "lora.r": "LoRA r",
    "lora.lora_alpha": "LoRA alpha",
    "lora.lora_dropout": "LoRA dropout",
    "lora.target_modules": "Target modules",
    "data.path": "Dataset file",
    "data.format": "Format",
    "data.eval_split": "Eval split",
    "training.max_length": "Max length (tokens)",
    "training.per_device_train_batch_size": "Batch size (per device)",
    "training.gradient_accumulation_steps": "Gradient accumulation",
    "training.max_steps": "Max steps",
    "training.num_train_epochs": "Epochs",
    "training.learning_rate": "Learning rate",
    "training.lr_scheduler_type": "Scheduler",
    "training.warmup_steps": "Warmup",
    "training.optim": "Optimizer",
    "training.logging_steps": "Log every (steps)",
    "training.save_steps": "Checkpoint every (steps)",
    "training.beta": "DPO beta",
    "training.loss_type": "DPO loss",
    "training.padding_free": "Padding-free batches",
    "training.packing": "Packing",
    "training.activation_offloading": "Activation offloading (CUDA)",
    "training.use_liger_kernel": "Liger kernels (CUDA)",
    "model.reference_path": "Reference model folder",
}


def _labelled(path: str, message: str) -> str:
    """'training.learning_rate must be …' → 'Learning rate (training.learning_rate) must be …'."""
    label = LABELS.get(path)
    if label and message.startswith(path):
        return f"{label} ({path}){message[len(path) :]}"
    return message


def _errors_below(slot, errors: dict, *paths: str) -> None:
    msgs = [_labelled(p, errors[p]) for p in paths if p in errors]
    if msgs:
        slot.error("\n\n".join(msgs))


def config_form(workspace: str) -> tuple[dict, dict, str]:
    """Draw the form; returns (raw config, field errors, run name)."""
    _prefill(workspace)
    slots = {}
    name, method = _name_and_method(workspace)
    slots["name"] = st.empty()
    _model_fields()
    slots["model"] = st.empty()
    _lora_fields()
    slots["lora"] = st.empty()
    _data_fields(method)
    slots["data"] = st.empty()
    _training_fields(method)
    slots["training"] = st.empty()
    return _checked(workspace, name, slots)


def _prefill(workspace: str) -> None:
    """Fill the form once: from a pending config (an upload, a demo button), the Estimate page's plan when it
    changed, or the base config; then the notes that go with it."""
    base, source = _base_config(workspace)
    plan = st.session_state.get("train_plan")
    plan_key = repr(sorted(plan.items())) if plan else None
    pending = st.session_state.pop("tr_pending", None)
    if pending is not None:
        _fill_form(pending)
        source = st.session_state.pop("tr_pending_source", "the uploaded YAML")
    elif "tr_model_path" not in st.session_state or st.session_state.get("tr_plan_seen") != plan_key:
        if st.session_state.get("tr_plan_seen") != plan_key and plan:
            base, source = _from_plan(plan, base)
        _fill_form(base)
        st.session_state["tr_plan_seen"] = plan_key
    st.caption(f"Prefilled from {source}. Every value is also in the YAML (download below).")
    asked = st.session_state.get("tr_trust_asked")
    if asked and not st.session_state.get("tr_trust"):
        st.warning(
            f"{asked} asks for trust_remote_code: it was left off. Tick 'Run Python code shipped in the model "
            "folder' under Model only if you trust that folder's code."
        )
    for note in st.session_state.get("tr_notes") or []:
        st.warning(note)
    if "tr_name" not in st.session_state:
        model_name = Path(st.session_state["tr_model_path"] or "run").name
        st.session_state["tr_name"] = suggest_run_name(f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _name_and_method(workspace: str):
    """The run name and the method (with its demo button); returns (name, the Method)."""
    name = st.text_input(
        "Run name", key="tr_name", help="A folder under <workspace>/runs: letters, digits, . _ -"
    )
    st.radio(
        "Method",
        METHODS,
        key="tr_method",
        format_func=METHOD_LABELS.get,
        horizontal=True,
        help="; ".join(f"{m.label}: {m.summary} ({m.trainer_name})" for m in methods.REGISTRY.values()),
        # the other method reads other data: detect the format again
        on_change=lambda: st.session_state.update(tr_format="auto"),
    )
    method = methods.get(st.session_state.get("tr_method"))
    demo = PREFERENCE_DEMOS.get(method.name)
    if (
        demo is not None
        and demo_ready(workspace)
        and st.button(
            f"Use the demo's {method.data_noun}",
            key=f"tr_demo_{method.name}",
            icon=":material/thumbs_up_down:",
            help=f"{method.label} on the demo model: prefer 'HELLO!' over 'HELLO' (a style its data never showed)",
        )
    ):
        folder = demo_dir(workspace).resolve()
        st.session_state["tr_pending"] = demo(folder, folder / "base")
        st.session_state["tr_pending_source"] = f"the demo's {method.label} settings"
        st.rerun()

    return name, method


def _model_fields() -> None:
    st.markdown("##### Model")
    c1, c2, c3 = st.columns([3, 1, 1])
    c1.text_input(
        "Model folder", key="tr_model_path", help="A local transformers model (config.json + weights)."
    )
    c2.selectbox("Weights dtype", DTYPES, key="tr_dtype")
    c3.selectbox("Attention", ATTN, key="tr_attn")
    st.checkbox(
        "Run Python code shipped in the model folder (trust_remote_code)",
        key="tr_trust",
        help="Only for architectures transformers does not have yet. The folder's .py files run with your rights: "
        "tick it only for a model you trust. A loaded YAML never ticks it for you.",
    )


def _lora_fields() -> None:
    st.markdown("##### LoRA")
    c = st.columns([1, 1, 1, 1, 1, 2])
    c[0].checkbox("LoRA", key="tr_lora", help="Off: full fine-tuning.")
    c[1].checkbox("4-bit", key="tr_4bit", help="QLoRA: NF4 base weights via bitsandbytes.")
    c[2].number_input("r", key="tr_r", step=1)
    c[3].number_input("alpha", key="tr_alpha", step=1.0)
    c[4].number_input("dropout", key="tr_dropout", step=0.05, format="%.2f")
    c[5].text_input("Target modules", key="tr_targets", help="all-linear, or a list such as q_proj, v_proj")


def _data_fields(method) -> None:
    st.markdown("##### Data")
    c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
    c1.text_input(
        "Dataset file",
        key="tr_data_path",
        help=".jsonl/.json/.csv/.parquet or a save_to_disk folder",
        # another file has other columns: detect its format again rather than keep the demo's "chat"
        on_change=lambda: st.session_state.update(tr_format="auto"),
    )
    c2.selectbox(
        "Format",
        ("auto", *method.formats),
        key="tr_format",
        help="auto: detected from the columns (chat if 'messages', alpaca if instruction+output; conversational if "
        "the answers are message lists, standard if they are texts)",
    )
    c3.number_input("Max length (tokens)", key="tr_max_length", step=64)
    c4.number_input(
        "Eval split", key="tr_eval_split", step=0.01, format="%.2f", help="Fraction held out (0: none)"
    )


def _training_fields(method) -> None:
    st.markdown("##### Training")
    c = st.columns(4)
    c[0].number_input("Batch size (per device)", key="tr_batch", step=1)
    c[1].number_input("Gradient accumulation", key="tr_accum", step=1)
    c[2].number_input("Max steps (-1: epochs)", key="tr_max_steps", step=10)
    c[3].number_input("Epochs", key="tr_epochs", step=1.0)
    c = st.columns(4)
    c[0].number_input("Learning rate", key="tr_lr", step=1e-5, format="%.2e")
    c[1].selectbox("Scheduler", SCHEDULERS, key="tr_sched")
    c[2].number_input("Warmup (fraction < 1, or steps)", key="tr_warmup", step=0.01)
    c[3].selectbox("Optimizer", OPTIMIZERS, key="tr_optim")
    c = st.columns(4)
    c[0].checkbox(
        "Padding-free batches",
        key="tr_padding_free",
        disabled=not method.traits.flat_batches,
        help="training.padding_free: the batch's rows as one sequence, no padding (SFT; use flash attention on a GPU)",
    )
    c[1].checkbox(
        "Packing",
        key="tr_packing",
        disabled=not method.traits.flat_batches,
        help="training.packing (BFD): rows filled to max length",
    )
    c[2].checkbox(
        "Activation offloading (CUDA)",
        key="tr_offload",
        help="training.activation_offloading: saved activations to pinned CPU RAM",
    )
    c[3].checkbox(
        "Liger kernels (CUDA)",
        key="tr_liger",
        help="training.use_liger_kernel: needs pip install liger-kernel",
    )
    c = st.columns(4)
    c[0].checkbox("Gradient checkpointing", key="tr_ckpt")
    c[1].number_input("Log every (steps)", key="tr_logging", step=1)
    c[2].number_input("Checkpoint every (steps)", key="tr_save", step=10)
    if method.fields:
        method_fields(method)


def _checked(workspace: str, name: str, slots: dict) -> tuple[dict, dict, str]:
    """The config the form says, its problems shown below the fields they concern."""
    raw = _raw_config()
    st.session_state["train_config"] = raw  # survives a visit to another page (widget state does not)
    errors = _field_errors(config_to_yaml(raw))
    name_problem = check_new_run_name(workspace, name)
    if name_problem:
        errors = {**errors, "run_name": name_problem}
    _errors_below(slots["name"], errors, "run_name")
    for section in ("model", "quantization", "lora", "data", "training"):
        slot = slots.get(section) or slots["lora"]
        _errors_below(slot, errors, *[k for k in errors if k.startswith(section + ".")])
    _errors_below(slots["training"], errors, *[k for k in errors if "." not in k and k != "run_name"])
    return raw, errors, name
