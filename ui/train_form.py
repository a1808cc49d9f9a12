"""The Train page's run-config form, drawn from the one field table (ui/fields.py) with the run's method's own
fields (core.recipe.methods); a config the Estimate page hands over fills it key for key."""

import copy
import time
from pathlib import Path

import streamlit as st

from core import jobs, precision
from core.demo.build import RUN_CONFIG, demo_config, demo_dir, demo_ready
from core.demo.methods import DEMOS
from core.estimate import from_config
from core.fmt import command
from core.recipe import methods
from core.recipe.config import (
    ConfigError,
    config_to_yaml,
    default_config,
    field_errors,
    migrate,
    validate_config,
)
from core.recipe.config_keys import METHODS, SECTIONS
from core.recipe.vision import IMAGE_KEYS
from core.runs.admin import (
    check_fields,
    check_model_folder,
    check_new_run_name,
)
from core.workspace import WorkspaceError, suggest_run_name
from ui import fields, mix_editor, reward_editor, train_panels
from ui.jobs import follow

P = "tr_"  # the Train page's widget keys: tr_ + the field's name (ui/fields.py)

# The run-config fields this form shows (ui/fields.py: the one field table); the method's own come with it.
TRAIN_FIELDS = (
    "model_path", "dtype", "attn", "trust", "tuning", "r", "alpha", "dropout", "targets", "data_path",
    "format", "max_length", "eval_split", "batch", "accum", "max_steps", "epochs", "lr", "sched", "warmup", "optim",
    "ckpt", "logging", "report_to", "save", "eval_batch", "eval_samples", "padding_free", "packing", "offload", "liger", "gpus",
    "strategy", "cpu_offload",
)  # fmt: skip
# Set while the form chooses the eval batch (the largest that fits); off once the user sets one, or a config does
EVAL_AUTO = "tr_eval_batch_auto"
LAST_EDITS = "your last edits"


METHOD_LABELS = {m.name: m.choice for m in methods.REGISTRY.values()}


@st.cache_data(ttl=10, show_spinner=False)
def _field_errors(raw_yaml: str) -> dict[str, str]:
    import yaml

    return check_fields(yaml.safe_load(raw_yaml))


def _base_config(workspace: str) -> tuple[dict, str]:
    """The config the form starts from, and where it came from (the Estimate page's goes over it in _prefill)."""
    if st.session_state.get("train_config"):
        return migrate(st.session_state["train_config"]), LAST_EDITS
    base = demo_config(workspace) if demo_ready(workspace) else _demo_paths(workspace)
    run_yaml = demo_dir(workspace).resolve() / RUN_CONFIG
    if run_yaml.is_file():  # the demo build wrote it: the same run from a shell
        return (
            base,
            f"the demo model and dataset (from a shell: {command('train')} {run_yaml} --run-dir RUN)",
        )
    return base, "the demo model and dataset"


def _planned(handed: dict) -> list[tuple[str, str]]:
    """(section, key) of every setting the Estimate page plans: ui.fields.PLAN_FIELDS, the method's own fields and
    a VLM's image settings (core.recipe.vision.IMAGE_KEYS: not drawn here, carried in the config as planned)."""
    planned = [(f.section, f.key) for f in [fields.FIELDS[n] for n in fields.PLAN_FIELDS]]
    planned += [(f.section, f.key) for f in methods.get(handed).fields]
    return planned + [tuple(path.split(".")) for path in IMAGE_KEYS]


def _from_estimate(handed: dict, base: dict, over: str) -> tuple[dict, str, str, tuple]:
    """`base` with every setting the Estimate page plans taken from the config it handed over, key for key: one
    run config, no translation. A hub id as the model is not a folder here (nothing is downloaded): the form keeps
    base's local model and says so. Returns (config, where it came from, what it changed in `over` (base, named as
    the user knows it), the planned keys kept from base)."""
    cfg = copy.deepcopy(base)
    for section, key in _planned(handed):
        value = (handed.get(section) or {}).get(key)
        if value is None and key not in (handed.get(section) or {}):
            cfg.setdefault(section, {}).pop(key, None)
        else:
            cfg.setdefault(section, {})[key] = value
    cfg["method"] = handed.get("method", "sft")
    model = handed["model"].get("path")
    source = f"the Estimate page's plan ({model})"
    kept: tuple = ()
    if check_model_folder(model) and base["model"].get("path"):
        kept = ("max_length", "per_device_train_batch_size")
        cfg["model"]["path"] = base["model"]["path"]
        # The plan's batch size and length were sized for its model and card, not for the model kept here
        # (the demo model has 64 positions): keep base's until the user points at the planned model.
        cfg["training"]["max_length"] = base["training"]["max_length"]
        cfg["training"]["per_device_train_batch_size"] = base["training"]["per_device_train_batch_size"]
        source += (
            f"; its model is not a local folder, so the model, batch size and max length stay those of "
            f"{base['model']['path']}: point the model folder at your local copy to train it"
        )
    _keep_off_cpu(cfg, base)
    taken = _changes(
        field_errors(base, here=False)[0], field_errors(cfg, here=False)[0]
    )  # defaults filled in
    changed = f"it changed {over}: {', '.join(taken)}" if taken else f"it changed nothing in {over}"
    return cfg, source, changed, kept


def _held_against(handed: dict, kept: tuple) -> str:
    """What the filled form holds against the plan it was handed, read back from its widgets: the truth whatever the
    form started from (an option the form does not offer, GPU settings left off a CPU). `kept`: keys already said
    to stay base's (a hub model's sizes); the model's path is never compared."""
    plan, held = field_errors(handed, here=False)[0], field_errors(_raw_config(), here=False)[0]
    missed = [
        f"{section}.{key} {(held.get(section) or {}).get(key)!r} (planned {(plan.get(section) or {}).get(key)!r})"
        for section, key in _planned(handed)
        if key not in ("path", *kept)
        and (plan.get(section) or {}).get(key) != (held.get(section) or {}).get(key)
    ]
    if held["method"] != plan["method"]:
        missed.insert(0, f"method {held['method']!r} (planned {plan['method']!r})")
    every = "every other setting" if kept else "every setting"
    return f"the form holds {every} it planned" + (f" except {', '.join(missed)}" if missed else "")


def _base_name(source: str, workspace: str) -> str:
    """The config the form started from, as the user knows it (what a plan's changes are said against)."""
    if source == LAST_EDITS:
        return source
    return "the demo run's settings" if demo_ready(workspace) else "the form's defaults"


def _keep_off_cpu(cfg: dict, base: dict) -> None:
    """On a machine without a CUDA GPU, the plan's bitsandbytes settings (4-bit loading, a paged or 8-bit
    optimizer: core.precision.ON_CPU) do not come across: `cfg` keeps base's, and the form says so with a button
    to take them anyway (they made the demo 5x slower and bitsandbytes warned of silently wrong results)."""
    kept = {}
    if from_config.local_card().device == "cpu":
        for path in precision.gpu_settings(cfg):
            section, _, key = path.partition(".")
            kept[path] = cfg[section][key]
            if key in (base.get(section) or {}):
                cfg[section][key] = base[section][key]
            else:
                cfg[section].pop(key, None)
    st.session_state["tr_cpu_kept"] = kept


def _cpu_kept_note() -> None:
    """What _keep_off_cpu left out, why, and a button to take it anyway."""
    kept = st.session_state.get("tr_cpu_kept")
    if not kept:
        return
    said = "; ".join(f"{path} {value!r}: {precision.ON_CPU[path]}" for path, value in kept.items())
    st.warning(
        f"This machine has no CUDA GPU, so the plan's GPU settings were left out and the form keeps its own "
        f"precision. {said}."
    )
    if st.button("Use the plan's GPU settings anyway", key="tr_cpu_insist", icon=":material/memory:"):
        cfg = copy.deepcopy(st.session_state.get("train_config") or st.session_state.get("tr_base"))
        for path, value in kept.items():
            section, _, key = path.partition(".")
            cfg.setdefault(section, {})[key] = value
        st.session_state["tr_pending"] = cfg
        st.session_state["tr_pending_source"] = "your form with the plan's GPU settings, as you asked"
        st.session_state.pop("tr_cpu_kept")
        st.rerun()


def _reset_button(workspace: str) -> None:
    """Back to the demo run as it comes: a plan or an upload can change many keys at once."""
    if st.button(
        "Reset to the demo defaults",
        key="tr_reset",
        icon=":material/restart_alt:",
        help="The demo run's config (the demo model and dataset, LoRA, a minute or two on a CPU), in place of "
        "every value on this form.",
    ):
        st.session_state.pop("tr_cpu_kept", None)
        st.session_state["tr_pending"] = (
            demo_config(workspace) if demo_ready(workspace) else _demo_paths(workspace)
        )
        st.session_state["tr_pending_source"] = "the demo defaults (reset)"
        st.rerun()


def _changes(before: dict, after: dict) -> list[str]:
    """'training.optim adamw_torch → paged_adamw_8bit' for each key a plan changed (the form says what it took)."""
    out = (
        [f"method {before.get('method')!r} → {after['method']!r}"]
        if before.get("method") != after["method"]
        else []
    )
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


def _fill_form(cfg: dict, keep_auto: bool = False) -> None:
    """Put a config's values into the form's widgets (before they are drawn). A config without an eval batch
    lets the form choose it (unless `keep_auto`: the form's own last edits, which hold the one it chose)."""
    if not (keep_auto and EVAL_AUTO in st.session_state):
        st.session_state[EVAL_AUTO] = "per_device_eval_batch_size" not in (cfg.get("training") or {})
    method = cfg.get("method", "sft")
    st.session_state["tr_method"] = method if method in METHODS else "sft"
    method = methods.get(st.session_state["tr_method"])
    notes = fields.fill(P, cfg, TRAIN_FIELDS, method)
    reward_editor.fill(cfg)
    mix_editor.fill(cfg)
    if st.session_state.get("tr_format") not in ("auto", *method.formats):
        st.session_state["tr_format"] = "auto"
    st.session_state["tr_notes"] = notes
    st.session_state["tr_base"] = copy.deepcopy(cfg)


def _raw_config() -> dict:
    """The config as the form says it (not validated: the checks report each field's problem)."""
    base = copy.deepcopy(st.session_state.get("tr_base") or default_config())
    for section in SECTIONS:
        base.setdefault(section, {})
    method = methods.get(st.session_state.get("tr_method") or "sft")
    raw = fields.read(P, base, TRAIN_FIELDS, method)
    mix_editor.read(raw)  # several sources: data.sources in place of data.path
    if method.reward_functions:
        reward_editor.read(raw)
    else:  # another method's config has no reward functions (its TRL config no reward_weights)
        raw.pop("rewards", None)
        raw["training"].pop("reward_weights", None)
    return raw


def _labelled(path: str, message: str) -> str:
    """'training.learning_rate must be …' → 'Learning rate (training.learning_rate) must be …'."""
    label = fields.label_of(path, methods.get(st.session_state.get("tr_method") or "sft"))
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
    if method.reward_functions:
        reward_editor.ensure(st.session_state.get("tr_base") or {})
        reward_editor.draw()
        slots["rewards"] = st.empty()
    return _checked(workspace, name, slots)


def _prefill(workspace: str) -> None:
    """Fill the form once: from a pending config (an upload, a demo button), the config the Estimate page handed
    over when it changed (only "Use this plan" hands one over: merely viewing that page changes nothing here), or
    the base config; then the notes that go with it."""
    base, source = _base_config(workspace)
    handed = st.session_state.get(fields.HANDOVER)
    handed_key = config_to_yaml(handed) if handed else None
    pending = st.session_state.pop("tr_pending", None)
    if pending is not None:
        _fill_form(pending)
        st.session_state.pop("tr_cpu_kept", None)  # what a plan left out: not this config's business
        source = st.session_state.pop("tr_pending_source", "the uploaded YAML")
    elif "tr_model_path" not in st.session_state or st.session_state.get("tr_handover_seen") != handed_key:
        changed = None
        if st.session_state.get("tr_handover_seen") != handed_key and handed:
            base, source, changed, kept = _from_estimate(handed, base, _base_name(source, workspace))
        _fill_form(base, keep_auto=source == LAST_EDITS)
        if changed:  # against the plan, as the form now holds it, then what that changed
            source += f"; {_held_against(handed, kept)}; {changed}"
        st.session_state["tr_handover_seen"] = handed_key
    c1, c2 = st.columns([5, 2], vertical_alignment="center")
    c1.caption(f"Prefilled from {source}. Every value is also in the YAML (download below).")
    with c2:
        _reset_button(workspace)
    _cpu_kept_note()
    asked = st.session_state.get("tr_trust_asked")
    if asked and not st.session_state.get("tr_trust"):
        st.warning(
            f"{asked} asks for trust_remote_code: it was left off. Tick 'Run Python code shipped in the model "
            "folder' under Model only if you trust that folder's code."
        )
    asked = st.session_state.get("tr_reward_trust_asked")
    if asked and reward_editor.untrusted():
        st.warning(
            f"{asked} asks to run its own reward code: it was left off. Tick 'Run my reward code' under Rewards "
            "only if you trust that file."
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
    if demo_ready(workspace) and method.name in DEMOS:
        _demo_button(workspace, method)
    return name, method


def _demo_button(workspace: str, method) -> None:
    """ "Use the demo's <data>": the method's demo run (core.demo.methods) on its start model; a start model that
    must be built first (GRPO's warm start) is built by a background job, and the form is filled once it is."""
    demo, folder = DEMOS[method.name], demo_dir(workspace).resolve()
    job = jobs.latest(workspace, demo.build_job, key=str(folder)) if demo.build_job else None
    building = job is not None and not job.done
    waiting = st.session_state.get("tr_demo_waiting") == method.name
    clicked = st.button(
        f"Use the demo's {method.data_noun}",
        key=f"tr_demo_{method.name}",
        icon=":material/thumbs_up_down:",
        help=demo.help,
        disabled=building,
    )
    if building:
        follow(
            lambda: jobs.read(job.path),
            lambda view: st.info(f"{demo.building}: {view.progress.get('phase') or 'starting'}…"),
        )
        return
    if waiting and job is not None and job.state == "failed":
        st.session_state.pop("tr_demo_waiting", None)
        st.error(f"Building the demo's start model failed: {job.error}")
        return
    if not (clicked or (waiting and job is not None and job.state == "finished")):
        return
    st.session_state.pop("tr_demo_waiting", None)
    model = demo.start(folder)
    if model is None:
        try:
            jobs.start(workspace, demo.build_job, {"out": str(folder)}, key=str(folder))
        except (jobs.JobError, WorkspaceError, OSError) as exc:
            st.error(str(exc))
            return
        st.session_state["tr_demo_waiting"] = method.name
        st.rerun()
    st.session_state["tr_pending"] = demo.config(folder, model)
    st.session_state["tr_pending_source"] = f"the demo's {method.label} settings, on {model.name}"
    st.rerun()


def _model_fields() -> None:
    st.markdown("##### Model")
    fields.row(P, ("model_path", "dtype", "attn"), [3, 1, 1])
    fields.draw(P, fields.FIELDS["trust"])


def _lora_fields() -> None:
    st.markdown("##### LoRA / QLoRA")
    fields.row(P, ("tuning", "r", "alpha", "dropout", "targets"), [3, 1, 1, 1, 2])


def _data_fields(method) -> None:
    st.markdown("##### Data")
    # another file has other columns: detect its format again rather than keep the demo's "chat"
    if mix_editor.active():  # several sources, each with its path, format and weight
        fields.row(P, ("max_length", "eval_split", None, None), method=method)
        mix_editor.draw(method, lambda n: mix_editor.summary(_raw_config(), n))
        return
    redetect = {"data_path": lambda: st.session_state.update(tr_format="auto")}
    fields.row(
        P, ("data_path", "format", "max_length", "eval_split"), [3, 1, 1, 1], method, on_change=redetect
    )
    st.button("Mix in another source", key="tr_mix_start", icon=":material/add:", on_click=mix_editor.start,
              help="data.sources: several datasets mixed by weight, each in its own format")  # fmt: skip


def _training_fields(method) -> None:
    st.markdown("##### Training")
    fields.row(P, ("batch", "accum", "max_steps", "epochs"))
    fields.row(P, ("lr", "sched", "warmup", "optim"))
    fields.row(P, ("padding_free", "packing", "offload", "liger"), method=method)
    evaluates = (st.session_state.get(P + "eval_split") or 0) > 0
    if evaluates:
        _propose_eval_batch()
    fields.row(
        P,
        ("ckpt", "logging", "report_to", "save", "eval_batch", "eval_samples"),
        disabled=() if evaluates else ("eval_batch",),
        on_change={"eval_batch": lambda: st.session_state.update({EVAL_AUTO: False})},
    )
    fields.method_row(P, method)
    fields.row(P, ("gpus", "strategy", "cpu_offload"))
    gpus = fields.gpu_count(st.session_state.get(P + "gpus"))
    if gpus is not None and gpus > 1:
        batch, accum = st.session_state.get(P + "batch"), st.session_state.get(P + "accum")
        if isinstance(batch, int) and isinstance(accum, int):
            st.caption(
                f"{gpus} processes, one per GPU: each step trains {batch} × {accum} × {gpus} = "
                f"{batch * accum * gpus} rows (per-device batch × accumulation × GPUs). The memory plan is per GPU; "
                "the Monitor draws each GPU's memory."
            )


def demo_waiting(workspace: str, raw: dict) -> set[str]:
    """The fields that only wait for the demo to be built (its model folder and dataset, named as the form starts):
    not a mistake of the user's, so no red error before they have done anything (issue #40)."""
    if demo_ready(workspace):
        return set()
    demo = _demo_paths(workspace)
    return {
        f"{section}.path"
        for section in ("model", "data")
        if str((raw.get(section) or {}).get("path") or "") == demo[section]["path"]
    }


def _propose_eval_batch() -> None:
    """Unless the user set one, an eval batch that would not fit becomes the largest that fits the card for the
    config as the form says it now: never TrainingArguments' 8 where 8 runs out of memory at the first evaluation."""
    if not st.session_state.get(EVAL_AUTO, True):
        return
    try:
        cfg = validate_config(_raw_config())
    except ConfigError:
        return  # the form's checks say what is wrong; the field keeps its value
    fits = train_panels.eval_batch_that_fits(cfg)
    # only where the batch it would evaluate with (TrainingArguments' 8 when none is set) does not fit: a config
    # that fits is left as the user wrote it (viewing the page never changes a run)
    if fits and (st.session_state.get(P + "eval_batch") or 8) > fits:
        st.session_state[P + "eval_batch"] = fits


def _checked(workspace: str, name: str, slots: dict) -> tuple[dict, dict, str]:
    """The config the form says, its problems shown below the fields they concern."""
    raw = _raw_config()
    st.session_state["train_config"] = raw  # survives a visit to another page (widget state does not)
    errors = _field_errors(config_to_yaml(raw))
    name_problem = check_new_run_name(workspace, name)
    if name_problem:
        errors = {**errors, "run_name": name_problem}
    _errors_below(slots["name"], errors, "run_name")
    waiting = demo_waiting(workspace, raw)
    shown = {
        k: v for k, v in errors.items() if k not in waiting
    }  # the page invites to build the demo instead
    for section in ("model", "quantization", "lora", "data", "training", "distributed"):
        slot = slots.get(section) or slots["training" if section == "distributed" else "lora"]
        _errors_below(slot, shown, *[k for k in shown if k.startswith(section + ".")])
    if "rewards" in slots:  # rewards, rewards[0].trust_code, ...: under the editor
        _errors_below(slots["rewards"], shown, *[k for k in shown if k.startswith("rewards")])
    other = [
        k for k in shown if "." not in k and k != "run_name" and not ("rewards" in slots and k == "rewards")
    ]
    _errors_below(slots["training"], shown, *other)
    return raw, errors, name
