"""The one table of the Plan <-> run config mapping: which plan field is which config key, how a value crosses
either way, and when the inverse writes it. core.estimate.from_config's `plan_for_config` reads a config through
it and `plan_to_config` writes a plan back through it.

A `Row` is a plan field that is a config key. What is not one is named in `DERIVED` with the function that makes
it; a special row (its `write` a function) writes a derived field back: the dtypes (core.precision's resolver
and names), the tuning full/lora/qlora, the method's own step (its plan_shape and training_of_plan), the GPU
count. `RUN` holds the fields a config does not say at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from core.estimate.plan import TUNINGS, Plan
from core.precision import LONG
from core.recipe import distributed, methods, vision
from core.recipe.config import checkpointing
from core.recipe.config_keys import DTYPES

# The planner models sdpa, eager and flash (varlen kernels: no mask); flex attention keeps no score matrix
# either, like sdpa.
PLAN_ATTN = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flex_attention": "sdpa"}
# ... and back: the planner's flash (or a page's "fa2") is FlashAttention 2
CONFIG_ATTN = {"flash": "flash_attention_2", "fa2": "flash_attention_2"}


class Reading(NamedTuple):
    """What a row's config -> plan conversion may look at besides the key's value."""

    cfg: dict
    method: Any  # core.recipe.methods' Method of the config
    smoke: bool


def _same(value, _=None):
    return value


def _names(value) -> list[str]:
    """A comma-separated string (the plan's way) as a list (the config's); a list stays one."""
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    return list(value)


def _targets(value):
    return value if value == "all-linear" else _names(value)


@dataclass(frozen=True)
class Row:
    """A plan field and the run config key that says it, in the order plan_to_config writes them.

    write: when plan_to_config writes the plan's value -- "given" (not None), "truthy", "lever" (true, or false
    where the base already has the key), "kept" (truthy, or where the base has a value: None then clears it),
    "images" (a VLM's: put_images writes the group; None removes the key); or a function (the plan's getter, the
    config) that writes a derived field itself (a special row: `key` names the main key it writes).
    """

    field: str
    key: str  # "section.key", or a top-level key
    # None: plan_for_config derives the plan's value (eval_fields, image_fields, the method's plan_shape, ...)
    to_plan: Callable[[Any, Reading], Any] | None = _same
    to_config: Callable[[Any], Any] = _same
    write: str | Callable[[Callable, dict], None] = "given"
    aliases: tuple[str, ...] = ()  # other names plan_to_config reads; "lora.x": x of a nested "lora" dict
    when: Callable[[dict, Callable], bool] | None = None  # (the config being written, the plan's getter)
    missing: Any = None  # the value of a plan that lacks the field (and its aliases)
    # "images": the config value a text-only plan gives (the group is written when one value differs)
    plain: Any = None
    also: str = ""  # a second plan field the key says too: the plan's value is then the pair

    @property
    def section(self) -> str:
        return self.key.partition(".")[0]

    @property
    def name(self) -> str:
        return self.key.partition(".")[2]

    def value_in(self, cfg: dict):
        """The key's value in a run config (None where it has none)."""
        return cfg[self.section].get(self.name) if self.name else cfg.get(self.key)


def _preference(r: Reading) -> bool:
    return r.method.traits.reference


def _multi(r: Reading) -> bool:
    return distributed.world_size(r.cfg) > 1


def put_method(get: Callable, cfg: dict) -> None:
    """The plan's method as the config's (a data format the method cannot read becomes auto)."""
    method = get("method")
    if method is not None:
        cfg["method"] = method
        if cfg["data"].get("format") not in (None, "auto", *methods.get(method).formats):
            cfg["data"]["format"] = "auto"


def put_tuning(get: Callable, cfg: dict) -> None:
    tuning = str(get("tuning") or "").lower()
    if tuning in TUNINGS:
        set_tuning(cfg, tuning)


def put_own(get: Callable, cfg: dict) -> None:
    """A generating method's own step (GRPO's rollouts, a prompt and its completion), said by its own keys
    (training_of_plan: GRPOConfig has no max_length). None: the key goes (its default gives the plan's value)."""
    method = methods.get(cfg.get("method"))
    if not method.traits.generates:
        return
    for key, value in method.training_of_plan(get, cfg["training"]).items():
        if value is None:
            cfg["training"].pop(key, None)
        else:
            cfg["training"][key] = value


def put_dtypes(get: Callable, cfg: dict) -> None:
    """The compute dtype (the load dtype's where the plan gives none) as the Trainer's mixed-precision flag and
    the 4-bit compute dtype."""
    compute = get("compute_dtype") or read(LOAD_DTYPE, get)
    if not compute:
        return
    compute = LONG.get(str(compute), str(compute))
    t = cfg["training"]
    if get("autocast") is False or compute == "float32":
        t["bf16"], t["fp16"] = False, False
    elif compute == "bfloat16":
        t["bf16"], t["fp16"] = "auto", False
    elif compute == "float16":
        t["bf16"], t["fp16"] = False, True
    if compute in DTYPES:
        cfg["quantization"]["bnb_4bit_compute_dtype"] = compute


def put_gpus(get: Callable, cfg: dict) -> None:
    """The plan's process count as this machine's (num_machines stays as the base has it); a list of ids of
    that length stays."""
    gpus = get("gpus")
    if gpus is None:
        return
    d = cfg["distributed"]
    per_machine = max(1, int(gpus) // (d.get("num_machines") or 1))
    now = d.get("gpus", 1)
    if (len(now) if isinstance(now, list) else now) != per_machine:
        d["gpus"] = per_machine


# load_dtype <-> model.dtype in core.precision's names (LONG); the plan's comes from core.precision.resolve
LOAD_DTYPE = Row("load_dtype", "model.dtype", None, lambda v: LONG.get(str(v), str(v)), "truthy", ("dtype",))

ROWS: tuple[Row, ...] = (
    Row("method", "method", lambda v, r: r.method.name, write=put_method),
    # DPO/KTO: the reference's log-probs once before training (written only for a preference method)
    Row(
        "precompute_ref", "training.precompute_ref_log_probs",
        lambda v, r: _preference(r) and bool(v), lambda v: True, "truthy",
        when=lambda cfg, get: bool(get("method")) and methods.get(get("method")).traits.reference,
    ),
    # full | lora | qlora: lora.enabled and quantization.load_in_4bit
    Row("tuning", "lora.enabled", lambda v, r: tuning_of(r.cfg), write=put_tuning),
    Row("lora_r", "lora.r", to_config=int, aliases=("lora.r",)),
    Row("lora_alpha", "lora.lora_alpha", aliases=("lora.alpha", "lora.lora_alpha")),
    # DPO/KTOConfig.disable_dropout (default on) sets every nn.Dropout to p=0, LoRA's too: an identity then
    Row(
        "lora_dropout", "lora.lora_dropout",
        lambda v, r: 0.0 if _preference(r) and r.cfg["training"].get("disable_dropout", True) else v,
        aliases=("lora.dropout", "lora.lora_dropout"),
    ),
    Row(
        "target_modules", "lora.target_modules", lambda v, r: v if isinstance(v, str) else ",".join(v),
        _targets, "truthy", ("lora.target_modules",),
    ),
    Row(
        "target_parameters", "lora.target_parameters", lambda v, r: ",".join(v or ()),
        lambda v: _names(v or []) or None, "kept", ("lora.target_parameters",),
    ),
    # plan_for_config's batch_size argument and a smoke test's batch stand in for it
    Row("batch_size", "training.per_device_train_batch_size", to_config=int, aliases=("micro_batch_size",)),
    # the longest row; a generating method says it by its own keys (the next row)
    Row(
        "seq_len", "training.max_length", lambda v, r: r.method.sequence_length(r.cfg), int,
        aliases=("max_length",), when=lambda cfg, get: not methods.get(cfg.get("method")).traits.generates,
    ),
    # the method's own step, read by its plan_shape (plan_for_config) and written by its training_of_plan
    Row("completion_len", "training.max_completion_length", None, write=put_own),
    # a plan that evaluates (eval_fields reads them): its eval batch and the samples callback's prompts (0: the
    # config keeps its own)
    Row("eval_batch_size", "training.per_device_eval_batch_size", None, int, "truthy"),
    Row("eval_samples", "training.eval_samples", None, int, "truthy"),
    Row("gradient_checkpointing", "training.gradient_checkpointing", lambda v, r: checkpointing(r.cfg), bool),
    Row("optim", "training.optim"),
    # the memory levers a run config carries (core.estimate.levers); the others are always on in the engine.
    # DPOTrainer 1.16 turns padding_free off (it warns and pads); a smoke step runs one full row without either.
    Row(
        "padding_free", "training.padding_free",
        lambda v, r: bool(v) and not r.smoke and r.method.traits.flat_batches, bool, "lever",
    ),
    Row("packing", "training.packing", lambda v, r: bool(v) and not r.smoke, bool, "lever"),
    Row("activation_offloading", "training.activation_offloading", lambda v, r: bool(v), bool, "lever"),
    Row("liger", "training.use_liger_kernel", lambda v, r: bool(v), bool, "lever"),
    Row(
        "packing_strategy", "training.packing_strategy", lambda v, r: v or "bfd",
        when=lambda cfg, get: bool(get("packing")),
    ),
    Row(
        "attn", "model.attn_implementation", lambda v, r: PLAN_ATTN.get(v, v),
        lambda v: CONFIG_ATTN.get(v, v), "truthy", ("attn_implementation",),
    ),
    Row("model", "model.path", to_config=str),
    LOAD_DTYPE,
    Row("compute_dtype", "training.bf16", None, write=put_dtypes),  # and training.fp16, bnb_4bit_compute_dtype
    Row(
        "quant_type", "quantization.bnb_4bit_quant_type", to_config=lambda v: str(v).lower(), write="truthy",
        aliases=("bnb_4bit_quant_type",),
    ),
    Row("double_quant", "quantization.bnb_4bit_use_double_quant", to_config=bool),
    # the distributed section: every process of every machine shares the model (gpu_gb is each card's)
    Row("gpus", "distributed.gpus", lambda v, r: distributed.world_size(r.cfg), write=put_gpus),
    Row("strategy", "distributed.strategy", to_config=str),
    Row("cpu_offload", "distributed.cpu_offload", lambda v, r: bool(v) and _multi(r), bool),
    # a VLM's images (image_fields reads them: a VLM's local data says what the config leaves unset)
    Row(
        "image_width", "data.image_size", None, lambda wh: f"{wh[0]}x{wh[1]}", "images",
        plain=f"{Plan.image_width}x{Plan.image_height}", also="image_height",
    ),
    Row("max_pixels", "data.max_pixels", None, lambda v: v or None, "images"),
    Row("images_per_row", "data.images_per_row", None, lambda v: v or None, "images", plain=1),
    Row("pan_and_scan", "data.pan_and_scan", None, lambda v: v or None, "images"),
    Row("vision_frozen", "model.freeze_vision", None, lambda v: None if v else False, "images", missing=True),
)  # fmt: skip

# Plan fields without a row of their own, and what gives each
DERIVED = {
    "reference": "copy where a preference method names model.reference_path (a second model), else auto",
    "autocast": "core.precision.resolve (the compute_dtype row writes it back)",
    **dict.fromkeys(
        (
            "num_generations", "generation_batch", "kl_beta", "old_logps", "vllm", "vllm_fraction", "vllm_sleep",
            "eval_generations",
        ),
        "the method's plan_shape and training_of_plan (the completion_len row)",
    ),
}  # fmt: skip
# Plan fields a run config does not say: the card planned for, what the engine always does, plan-only settings
RUN = (
    "gpu_gb", "expandable_segments", "device", "prepare_kbit", "fused_lm_head", "quantize_experts",
    "eval_kv_tokens", "batch_tokens", "recurrent_kernels",
)  # fmt: skip
# what the engine (TRL's SFTTrainer) does: no prepare_model_for_kbit_training, the tiled (fused) LM head
ENGINE = {"prepare_kbit": False, "fused_lm_head": True}


# ---- a run config's values as a plan's ----------------------------------------------------------------------


def plan_values(cfg: dict, method, smoke: bool) -> dict:
    """Every row's plan field with a value read from `cfg` (a validated run config), as plan_for_config needs it."""
    reading = Reading(cfg, method, smoke)
    return {row.field: row.to_plan(row.value_in(cfg), reading) for row in ROWS if row.to_plan is not None}


def tuning_of(cfg: dict) -> str:
    """How a run config trains, as the planner and the user name it: "full", "lora" or "qlora"."""
    lora, quant = cfg.get("lora") or {}, cfg.get("quantization") or {}
    if not lora.get("enabled", True):
        return "full"
    return "qlora" if quant.get("load_in_4bit") else "lora"


def set_tuning(cfg: dict, tuning: str) -> None:
    """Write "full", "lora" or "qlora" as the two keys a run config holds (the inverse of tuning_of)."""
    cfg.setdefault("lora", {})["enabled"] = tuning != "full"
    cfg.setdefault("quantization", {})["load_in_4bit"] = tuning == "qlora"


# ---- a plan's values written into a run config --------------------------------------------------------------

_ABSENT = object()


class PlanReader:
    """`get(name, default=None)`: a Plan's (or a dict's, or any object's) value of `name`; "lora.x": the x of a
    nested "lora" dict (how older plan dicts said the adapter). `one(name)`: the value, or _ABSENT."""

    def __init__(self, plan: Any):
        self.plan = plan

    def one(self, name: str):
        if name.startswith("lora."):
            lora = self.one("lora")
            return lora.get(name[5:], _ABSENT) if isinstance(lora, dict) else _ABSENT
        if isinstance(self.plan, dict):
            return self.plan.get(name, _ABSENT)
        return getattr(self.plan, name, _ABSENT)

    def __call__(self, name: str, default=None):
        value = self.one(name)
        return default if value is _ABSENT else value


def read(row: Row, get: PlanReader) -> Any:
    """The plan's value for `row`: its field, else its first alias the plan has, else row.missing."""
    if row.also:
        return (get(row.field), get(row.also))
    for name in (row.field, *row.aliases):
        value = get.one(name)
        if value is not _ABSENT:
            return value
    return row.missing


def put_plan(get: PlanReader, cfg: dict) -> None:
    """Every row written into `cfg` (every section present) from the plan's getter, in the table's order, as each
    row's rule says; then the images."""
    for row in ROWS:
        if callable(row.write):
            row.write(get, cfg)
            continue
        if row.write == "images" or (row.when and not row.when(cfg, get)):
            continue
        value, section = read(row, get), cfg[row.section]
        if row.write == "given":
            write = value is not None
        elif row.write == "truthy":
            write = bool(value)
        elif row.write == "lever":
            write = value is not None and (bool(value) or row.name in section)
        else:  # "kept"
            write = bool(value) or bool(section.get(row.name))
        if write:
            section[row.name] = row.to_config(value)
    put_images(get, cfg)


def put_images(get: Callable, cfg: dict) -> None:
    """A VLM plan's images as the run config's keys (image_fields' inverse): for a VLM model folder, or where the
    plan's images differ from the planner's defaults; a language model's config gets none."""
    values = {row: row.to_config(read(row, get)) for row in ROWS if row.write == "images"}
    if get("image_width") is None or not (
        vision.folder_is_vlm(cfg["model"].get("path") or "")
        or any(v is not None and v != row.plain for row, v in values.items())
    ):
        return
    for row, value in values.items():
        if value is None:
            cfg[row.section].pop(row.name, None)
        else:
            cfg[row.section][row.name] = value
