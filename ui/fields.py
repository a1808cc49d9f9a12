"""The one field table of the run config (issue #20): each setting the Train and Estimate pages show, with its key
path, label, widget kind and choices; a method's own settings come from core.recipe.methods. Drawing a field,
filling it from a config and reading the config back are one function each, used by both pages (each with its
widget-key prefix), so a config survives the round trip and both pages edit the very same run config."""

from __future__ import annotations

import copy
import functools

import streamlit as st

from core.estimate.config_map import set_tuning, tuning_of
from core.estimate.plan import PACKING_STRATEGIES
from core.recipe import methods, trackers
from core.recipe.config import default_config, section_schema
from core.recipe.config_keys import ATTN, DTYPES, OPTIMIZERS, SCHEDULERS, STRATEGIES
from core.recipe.methods.base import Field

FORMATS = tuple(dict.fromkeys(("auto", *(f for m in methods.REGISTRY.values() for f in m.formats))))
BF16_CHOICES = ("auto", True, False)

FIELDS = {
    f.name: f
    for f in (
        Field("model_path", "model.path", "Model folder", "path", help="A local transformers model (config.json + weights), or a Hub id ORG/NAME[@REVISION]: fetched "
              "when the run starts (the Models page shows the cache)."),
        Field("dtype", "model.dtype", "Weights dtype", "choice", choices=DTYPES,
              help="auto: bfloat16 on a CUDA GPU that has it, float32 otherwise"),
        Field("attn", "model.attn_implementation", "Attention", "choice", choices=ATTN),
        Field("trust", "model.trust_remote_code", "Run Python code shipped in the model folder (trust_remote_code)",
              "bool", help="Only for architectures transformers does not have yet. The folder's .py files run with "
              "your rights: tick it only for a model you trust. A loaded YAML never ticks it for you."),
        # what the pages draw for the two keys below: the choice by the name users know it by
        Field("tuning", "lora.enabled", "Fine-tuning", "tuning", choices=("lora", "qlora", "full"),
              help="LoRA: small adapters on a 16-bit base. QLoRA: the same on a 4-bit (NF4) base, about a third of "
              "its memory; needs a CUDA GPU (bitsandbytes). Full: every weight trained."),
        Field("lora", "lora.enabled", "LoRA", "bool", help="Off: full fine-tuning."),
        Field("4bit", "quantization.load_in_4bit", "4-bit", "bool", help="QLoRA: NF4 base weights via bitsandbytes."),
        Field("quant_type", "quantization.bnb_4bit_quant_type", "4-bit type", "choice", choices=("nf4", "fp4")),
        Field("double_quant", "quantization.bnb_4bit_use_double_quant", "Double quantization", "bool",
              help="bnb_4bit_use_double_quant: the blocks' scales quantized too (~0.4 bit per weight less)"),
        Field("r", "lora.r", "LoRA r", "int", step=1),
        Field("alpha", "lora.lora_alpha", "LoRA alpha", "float", step=1.0),
        Field("dropout", "lora.lora_dropout", "LoRA dropout", "float", step=0.05, fmt="%.2f"),
        Field("targets", "lora.target_modules", "Target modules", "targets",
              help="all-linear, or a list such as q_proj, v_proj"),
        Field("data_path", "data.path", "Dataset file", "path",
              help=".jsonl/.json/.csv/.parquet, a save_to_disk folder, or a Hub dataset id ORG/NAME[@REVISION] "
              "(previewed from a streamed sample; data.subset and data.split in the YAML)"),
        Field("format", "data.format", "Format", "choice", choices=FORMATS,
              help="auto: detected from the columns (chat if 'messages', alpaca if instruction+output; "
              "conversational if the answers are message lists, standard if they are texts)"),
        Field("eval_split", "data.eval_split", "Eval split", "float", step=0.01, fmt="%.2f",
              help="Fraction held out (0: none)"),
        Field("max_length", "training.max_length", "Max length (tokens)", "int", step=64),
        Field("batch", "training.per_device_train_batch_size", "Batch size (per device)", "int", step=1),
        Field("accum", "training.gradient_accumulation_steps", "Gradient accumulation", "int", step=1),
        Field("max_steps", "training.max_steps", "Max steps (-1: epochs)", "int", step=10),
        Field("epochs", "training.num_train_epochs", "Epochs", "float", step=1.0),
        Field("lr", "training.learning_rate", "Learning rate", "float", step=1e-5, fmt="%.2e"),
        Field("sched", "training.lr_scheduler_type", "Scheduler", "choice", choices=SCHEDULERS),
        Field("warmup", "training.warmup_steps", "Warmup (fraction < 1, or steps)", "float", step=0.01),
        Field("optim", "training.optim", "Optimizer", "choice", choices=OPTIMIZERS),
        Field("bf16", "training.bf16", "bf16 autocast", "choice", choices=BF16_CHOICES,
              help="training.bf16 — auto: on where the CUDA GPU has native bf16; never on a CPU"),
        Field("fp16", "training.fp16", "fp16 autocast", "bool", help="training.fp16: for GPUs without bf16"),
        Field("ckpt", "training.gradient_checkpointing", "Gradient checkpointing", "bool"),
        Field("logging", "training.logging_steps", "Log every (steps)", "int", step=1),
        Field("report_to", "training.report_to", "Report to", "choice", "tensorboard", trackers.CHOICES,
              help="training.report_to: TensorBoard's event files (RUN/tensorboard) or Trackio's database "
              "(RUN/trackio; needs pip install trackio), inside the run folder; the Monitor names the command "
              "that shows them"),
        Field("save", "training.save_steps", "Checkpoint every (steps)", "int", step=10),
        Field("eval_batch", "training.per_device_eval_batch_size", "Eval batch size (per device)", "int", step=1,
              help="training.per_device_eval_batch_size: rows per evaluation step. Unless you set it, the form "
              "proposes the largest the card holds (TrainingArguments' 8 can run out of memory at the first "
              "evaluation)"),
        Field("eval_samples", "training.eval_samples", "Sample answers at each eval", "int", 0, step=1,
              help="training.eval_samples: greedy answers to this many held-out prompts at each evaluation, shown on "
              "the Monitor (needs an eval split; 0: off)"),
        # the memory levers (docs/planner.md, "Fitting more"); padding-free and packing are SFTTrainer's only
        Field("padding_free", "training.padding_free", "Padding-free batches", "bool", flat_only=True,
              help="training.padding_free: the batch's rows as one sequence, no padding (SFT; use flash attention "
              "on a GPU)"),
        Field("packing", "training.packing", "Packing", "bool", flat_only=True,
              help="training.packing (BFD): rows filled to max length"),
        Field("packing_strategy", "training.packing_strategy", "Packing strategy", "choice", "bfd",
              PACKING_STRATEGIES, flat_only=True, help="training.packing_strategy (with packing on)"),
        Field("gpus", "distributed.gpus", "GPUs", "gpus",
              help="distributed.gpus: how many GPUs of the box train this run (2), or which, as nvidia-smi numbers "
              "them ([1, 3]; [1]: GPU 1 alone). One process per GPU; the verdict is per GPU"),
        Field("strategy", "distributed.strategy", "Multi-GPU strategy", "choice", choices=STRATEGIES,
              help="ddp: every GPU holds the whole model; fsdp / deepspeed_zero3: weights, gradients and optimizer "
              "states split over the GPUs (activations are not); auto: DDP when one card fits, else FSDP"),
        Field("cpu_offload", "distributed.cpu_offload", "CPU offload (FSDP / ZeRO-3)", "bool",
              help="distributed.cpu_offload: parameters, gradients and optimizer states in CPU RAM"),
        Field("offload", "training.activation_offloading", "Activation offloading (CUDA)", "bool",
              help="training.activation_offloading: saved activations to pinned CPU RAM"),
        Field("liger", "training.use_liger_kernel", "Liger kernels (CUDA)", "bool",
              help="training.use_liger_kernel: needs pip install liger-kernel"),
    )
}  # fmt: skip

HANDOVER = "train_from_estimate"  # the run config the Estimate page's "Use this plan" hands to the Train page

# Off is the libraries' default for these: a form leaves them out of the YAML rather than writing false.
OFF_BY_DEFAULT = {"padding_free", "packing", "offload", "liger"}
ZERO_IS_OFF = {"eval_samples"}  # 0 (off) is left out of the YAML too
UNSET_IS_LEFT_OUT = {"eval_batch"}  # empty (a run that does not evaluate): the library's default, unwritten

WHOLE_WHEN_WHOLE = {"alpha", "warmup"}

# The fields that change a run's memory: what the Estimate page edits and hands over to the Train page.
PLAN_FIELDS = (
    "model_path", "dtype", "attn", "lora", "4bit", "quant_type", "double_quant", "r", "alpha", "dropout", "targets",
    "max_length", "batch", "optim", "bf16", "fp16", "ckpt", "padding_free", "packing", "offload", "liger", "gpus",
    "strategy", "cpu_offload",
)  # fmt: skip

METHOD_FIELDS = {f.name: f for m in methods.REGISTRY.values() for f in m.fields}

TUNING_LABELS = {"lora": "LoRA", "qlora": "QLoRA (4-bit base)", "full": "Full fine-tune"}


def drawn(names) -> tuple:
    """`names` as a page draws them: the LoRA and 4-bit switches as one Fine-tuning choice (LoRA, QLoRA, full)."""
    out = []
    for name in names:
        name = "tuning" if name in ("lora", "4bit") else name
        if name not in out:
            out.append(name)
    return tuple(out)


def label_of(path: str, method=None) -> str | None:
    """The label a page shows for a config key path (a message names the field as the user sees it)."""
    for f in (*FIELDS.values(), *(method.fields if method else METHOD_FIELDS.values())):
        if f.path == path:
            return f.label
    return None


def labelled(message: str, method=None) -> str:
    """A config check's sentence as a form shows it: 'training.per_device_train_batch_size must be …' → 'Batch
    size (per device) (training.per_device_train_batch_size) must be …': the user finds the field by its label."""
    path = message.split(" ", 1)[0].rstrip(":,")
    label = label_of(path, method)
    return f"{label} ({path}){message[len(path) :]}" if label else message


def _get(cfg: dict, f: Field):
    if f.path == "method":
        return cfg.get("method")
    return (cfg.get(f.section) or {}).get(f.key)


def widget_value(f: Field, value):
    """A config value as the widget holds it: targets as text, paths as text, floats as floats, GPUs as the YAML
    says them (2, or [1, 3])."""
    if f.kind == "gpus":
        value = f"[{', '.join(str(i) for i in value)}]" if isinstance(value, list) else str(value)
    if f.as_list and isinstance(value, list):
        value = value[0] if value else None
    if f.kind == "targets" and isinstance(value, list):
        value = ", ".join(value)
    if f.kind == "path":
        value = "" if value is None else str(value)
    if f.kind == "float" and value is not None:
        value = float(value)  # number_input takes its type from the value: keep floats floats
    if f.kind == "bool":
        value = bool(value)
    return value


def config_value(f: Field, value):
    """A widget's value as the run config holds it (the inverse of widget_value)."""
    if f.kind == "targets":
        value = (value or "").strip()
        if value != "all-linear":
            value = [m.strip() for m in value.split(",") if m.strip()] or value
    if f.kind == "path":
        value = (value or "").strip() or None
    if f.kind == "gpus":
        value = gpus_value(value)
    if f.name in WHOLE_WHEN_WHOLE and isinstance(value, float) and value >= 1 and value.is_integer():
        value = int(value)  # whole numbers read as such in the YAML (warmup >= 1 counts steps)
    if f.as_list:
        value = [value] if value else None
    return value


def gpus_value(text):
    """The GPUs field's text as distributed.gpus: "2" a count, "[1, 3]" or "1, 3" ids; anything else is kept as
    typed, for the config check to name."""
    text = str(text if text is not None else "").strip()
    listed = text.startswith("[") and text.endswith("]")
    parts = [p.strip() for p in (text[1:-1] if listed else text).split(",")]
    if not all(p.isdigit() for p in parts):
        return text
    numbers = [int(p) for p in parts]
    return numbers if listed or len(numbers) > 1 else numbers[0]


def gpu_count(text) -> int | None:
    """How many processes the GPUs field's text asks for (None where it is not a count or ids yet)."""
    value = gpus_value(text)
    return len(value) if isinstance(value, list) else value if isinstance(value, int) else None


def fill(prefix: str, cfg: dict, names, method) -> list[str]:
    """Put `cfg`'s values for the fields `names` and `method`'s own into the widgets (before they are drawn).
    Returns a note for each value a choice field does not offer (the field then takes the default)."""
    defaults, notes = default_config(), []
    for name in names:
        f = FIELDS[name]
        if f.kind == "tuning":
            st.session_state[prefix + name] = tuning_of(cfg)
            continue
        value = _get(cfg, f)
        default = _get(defaults, f)
        default = f.default if default is None else default
        value = default if value is None and f.kind != "path" else value
        if f.kind == "choice" and value not in f.choices:
            notes.append(f"{f.path} {value!r} is not available here; the form uses {default!r}.")
            value = default
        st.session_state[prefix + name] = widget_value(f, value)
    for f in METHOD_FIELDS.values():  # another method's fields start from their defaults
        st.session_state[prefix + f.name] = widget_value(f, f.default)
    for f in method.fields:
        value = _get(cfg, f)
        st.session_state[prefix + f.name] = widget_value(f, f.default if value is None else value)
    return notes


def read(prefix: str, base: dict, names, method) -> dict:
    """The run config the widgets say: `base` with the fields `names` and the method's own written in (not
    validated: the checks report each field's problem)."""
    raw = copy.deepcopy(base)
    for name in names:
        f = FIELDS[name]
        if f.kind == "tuning":
            set_tuning(raw, st.session_state.get(prefix + name) or "lora")
            continue
        section = raw.setdefault(f.section, {})
        value = config_value(f, st.session_state.get(prefix + name))
        if not applies(f, method):
            section.pop(f.key, None)  # the method's TRL config does not know the key
            continue
        if name in UNSET_IS_LEFT_OUT and value is None:
            section.pop(f.key, None)
            continue
        if name in OFF_BY_DEFAULT or name in ZERO_IS_OFF:
            if value and name in ZERO_IS_OFF:
                section[f.key] = value
            elif value:
                section[f.key] = True
            else:
                section.pop(f.key, None)
            continue
        section[f.key] = value
    raw["method"] = method.name
    for f in METHOD_FIELDS.values():
        (raw.get(f.section) or {}).pop(f.key, None)
    for f in method.fields:
        value = config_value(f, st.session_state.get(prefix + f.name))
        if value is not None:
            raw.setdefault(f.section, {})[f.key] = value
    return raw


@functools.cache
def _training_keys(method: str) -> frozenset:
    return frozenset(section_schema("training", method))


def applies(f: Field, method) -> bool:
    """Whether the method's run config has the field: padding-free and packing are SFTTrainer's; a training key its
    TRL config does not know (GRPO has no max_length: its prompt and completion lengths are its own fields) is
    left out, its widget greyed."""
    if method is None:
        return True
    if f.flat_only and not method.traits.flat_batches:
        return False
    return f.section != "training" or f.key in _training_keys(method.name)


def choices_of(f: Field, method) -> tuple:
    """A choice field's options; data.format offers the formats of the run's method."""
    return ("auto", *method.formats) if f.path == "data.format" and method is not None else f.choices


def draw(prefix: str, f: Field, slot=st, method=None, disabled: bool = False, on_change=None) -> None:
    """One field's widget in `slot` (a column), keyed prefix + name."""
    key = prefix + f.name
    off = disabled or not applies(f, method)
    kw = dict(key=key, help=f.help or None, disabled=off, on_change=on_change)
    if f.kind == "tuning":
        slot.radio(f.label, f.choices, format_func=TUNING_LABELS.get, horizontal=True, **kw)
    elif f.kind == "bool":
        slot.checkbox(f.label, **kw)
    elif f.kind == "choice":
        slot.selectbox(f.label, choices_of(f, method), format_func=_choice_label, **kw)
    elif f.kind in ("int", "float"):
        # a whole-number field steps by 1 (without a step Streamlit reads the widget as a float: 8 came back 8.0)
        step = f.step if f.step is not None or f.kind != "int" else 1
        slot.number_input(f.label, step=step, format=f.fmt, **kw)
    else:
        slot.text_input(f.label, **kw)


def _choice_label(value) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def row(prefix: str, names, widths=None, method=None, disabled=(), on_change=None) -> None:
    """The fields `names` side by side (None: an empty column); `on_change`: {name: callback}."""
    fields = [FIELDS[n] if isinstance(n, str) else n for n in names]
    for column, f in zip(st.columns(widths or [1] * len(fields)), fields, strict=True):
        if f is not None:
            draw(prefix, f, column, method, f.name in disabled, (on_change or {}).get(f.name))


def method_row(prefix: str, method, per_row: int = 5) -> None:
    """The method's own settings (core.recipe.methods), one widget each, `per_row` to a row."""
    for start in range(0, len(method.fields), per_row):
        part = method.fields[start : start + per_row]
        part = part + (None,) * (per_row - len(part)) if len(method.fields) > per_row else part
        row(prefix, part, [3 if f is not None and f.kind == "path" else 1 for f in part], method)
