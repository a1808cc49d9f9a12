"""The one mapping from a run config to the planner's input (a core.estimate Plan).

Everything that plans or measures a run goes through `plan_for_config`: the Train page's estimate, the launcher's
plan.json, the smoke test, the tracker and the benchmarks. Its dtypes come from core.precision (the resolver the
trainer uses) for the device, and its memory switches follow what the engine (TRL's SFTTrainer) really does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from core import gpu
from core.estimate.bill import estimate
from core.estimate.plan import Plan, PlanError
from core.precision import SHORT, Device, resolve
from core.recipe import distributed, methods, vision
from core.recipe.config import checkpointing, default_config, validate_config
from core.recipe.config_keys import DTYPES, SECTIONS

# The planner models sdpa, eager and flash (varlen kernels: no mask); flex attention keeps no score matrix
# either, like sdpa.
PLAN_ATTN = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flex_attention": "sdpa"}


def method_of(cfg: dict) -> str:
    """How a run config trains, as the planner and the user name it: "full", "lora" or "qlora"."""
    lora, quant = cfg.get("lora") or {}, cfg.get("quantization") or {}
    if not lora.get("enabled", True):
        return "full"
    return "qlora" if quant.get("load_in_4bit") else "lora"


def set_method(cfg: dict, method: str) -> None:
    """Write "full", "lora" or "qlora" as the two keys a run config holds (the inverse of method_of)."""
    cfg.setdefault("lora", {})["enabled"] = method != "full"
    cfg.setdefault("quantization", {})["load_in_4bit"] = method == "qlora"


def plan_dtypes(cfg: dict, device: str) -> tuple[str, str, bool]:
    """(load, compute, autocast) in the planner's short names, as core.precision resolves them on `device` (a
    bf16-capable GPU for "cuda") -- the resolver the trainer uses."""
    prec = resolve(cfg, Device.of(device))
    return SHORT[prec.dtype], SHORT[prec.compute], prec.autocast


def plan_for_config(
    cfg: dict,
    gpu_gb: float = 24.0,
    device: str = "cuda",
    batch_size: int | None = None,
    expandable_segments: bool = False,
    model: str | None = None,
    smoke: bool = False,
) -> Plan:
    """The Plan that describes training `cfg` (a validated run config) on a `gpu_gb` card.

    `batch_size` overrides the config's (the smoke test runs at 1); `model` overrides model.path (a preset id
    or a folder with config.json, for planning a config against another model's shapes). `smoke`: the smoke
    test's step: one full row at batch size 1, without padding-free batching or packing (core.recipe.engine_args
    turns them off there: one full row is the same tensor either way)."""
    lo, t = cfg["lora"], cfg["training"]
    load, compute, autocast = plan_dtypes(cfg, device)
    targets = lo["target_modules"]
    method = methods.get(cfg)
    preference = method.traits.reference
    batch = method.smoke_batch(cfg) if smoke else (batch_size or t["per_device_train_batch_size"])
    world = 1 if smoke else distributed.world_size(cfg)
    fields = dict(
        model=model or cfg["model"]["path"],
        method=method_of(cfg),
        objective=method.name,
        # DPO/KTOTrainer: the base with the adapter disabled, or a second model (full fine-tune, reference_path)
        reference="copy" if preference and cfg["model"].get("reference_path") else "auto",
        precompute_ref=preference and bool(t.get("precompute_ref_log_probs")),
        load_dtype=load,
        compute_dtype=compute,
        autocast=autocast,
        quant_type=cfg["quantization"]["bnb_4bit_quant_type"],
        double_quant=cfg["quantization"]["bnb_4bit_use_double_quant"],
        lora_r=lo["r"],
        lora_alpha=lo["lora_alpha"],
        # DPO/KTOConfig.disable_dropout (default on) sets every nn.Dropout to p=0, LoRA's too: an identity then
        lora_dropout=0.0 if preference and t.get("disable_dropout", True) else lo["lora_dropout"],
        target_modules=targets if isinstance(targets, str) else ",".join(targets),
        target_parameters=",".join(lo.get("target_parameters") or ()),
        batch_size=batch,
        seq_len=method.sequence_length(cfg),
        gradient_checkpointing=checkpointing(cfg),
        attn=PLAN_ATTN.get(cfg["model"]["attn_implementation"], cfg["model"]["attn_implementation"]),
        optim=t["optim"],
        gpu_gb=float(gpu_gb),
        expandable_segments=expandable_segments,
        device=device,
        # what SFTTrainer does: no prepare_model_for_kbit_training, the tiled (fused) LM head
        prepare_kbit=False,
        fused_lm_head=True,
        # DPOTrainer 1.16 turns padding_free off (it warns and pads)
        padding_free=bool(t.get("padding_free")) and not smoke and method.traits.flat_batches,
        packing=bool(t.get("packing")) and not smoke,
        packing_strategy=t.get("packing_strategy") or "bfd",
        activation_offloading=bool(t.get("activation_offloading")),
        liger=bool(t.get("use_liger_kernel")),
        # the distributed section: every process of every machine shares the model (gpu_gb is each card's)
        gpus=distributed.world_size(cfg),
        strategy=cfg["distributed"]["strategy"],
        cpu_offload=bool(cfg["distributed"]["cpu_offload"]) and distributed.world_size(cfg) > 1,
        # the method's own step (GRPO: its rollouts), read from the config by the method
        **method.plan_shape(cfg, batch, world, smoke),
        **eval_fields(cfg, smoke),
        **image_fields(cfg),
    )
    return Plan(**fields)


def image_fields(cfg: dict) -> dict:
    """A VLM run's images as its config gives them (data.image_size "WxH", data.max_pixels, data.images_per_row,
    data.pan_and_scan, model.freeze_vision). Without image_size / images_per_row, a VLM's local data says them (its
    largest image, its most images in a row: core.recipe.vision.data_images); else the planner's defaults (a
    language model's plan ignores them)."""
    data, model = cfg.get("data") or {}, cfg.get("model") or {}
    out = {}
    size = vision.image_size(data.get("image_size"))
    if size:
        out.update(image_width=size[0], image_height=size[1])
    if (not size or not data.get("images_per_row")) and vision.folder_is_vlm(model.get("path") or ""):
        found = vision.data_images(data)
        if found and not size:
            out.update(image_width=found[0], image_height=found[1])
        if found and found[2]:
            out["images_per_row"] = found[2]
    for key in ("max_pixels", "images_per_row"):
        if isinstance(data.get(key), int) and not isinstance(data.get(key), bool):
            out[key] = data[key]
    if isinstance(model.get("freeze_vision"), bool):
        out["vision_frozen"] = model["freeze_vision"]
    if isinstance(data.get("pan_and_scan"), bool):
        out["pan_and_scan"] = data["pan_and_scan"]
    return out


def evaluates(cfg: dict) -> bool:
    """Does a run of `cfg` evaluate? Held-out rows (data.eval_split) and an eval strategy other than "no"."""
    return cfg["data"].get("eval_split", 0) > 0 and cfg["training"].get("eval_strategy", "steps") != "no"


def eval_fields(cfg: dict, smoke: bool = False) -> dict:
    """The plan's evaluation phase as a run of `cfg` has it: per_device_eval_batch_size (TrainingArguments'
    default 8 when unset; the method's smallest in a smoke test, which evaluates one batch), GRPO's
    num_generations_eval, the samples callback's prompts (none on sharded weights: core.train.callbacks)."""
    if not evaluates(cfg):
        return {}
    t, method = cfg["training"], methods.get(cfg)
    sharded = distributed.world_size(cfg) > 1 and cfg["distributed"]["strategy"] in distributed.SHARDED
    return {
        "eval_batch_size": method.smoke_eval_batch(cfg) if smoke else t.get("per_device_eval_batch_size", 8),
        "eval_generations": int(t.get("num_generations_eval") or 0) if method.traits.generates else 0,
        "eval_samples": 0 if sharded and not smoke else int(t.get("eval_samples") or 0),
    }


def plan_for_draft(cfg: dict, gpu_gb: float = 24.0, device: str = "cuda", **kw) -> Plan:
    """The Plan of a run config whose model weights and data need not exist yet (the Estimate page's, a measured
    step's), nor run on this machine: paths play no part in a step's memory, so a placeholder stands in where one
    is missing. Raises ConfigError with the validator's sentence for a bad setting."""
    cfg = copy.deepcopy(cfg)
    for section in ("model", "data"):
        cfg[section] = {**(cfg.get(section) or {})}
        cfg[section]["path"] = cfg[section].get("path") or "unused"
    return plan_for_config(validate_config(cfg, here=False), gpu_gb, device, **kw)


def estimate_for_config(cfg: dict, gpu_gb: float = 24.0, device: str = "cuda", batch_size=None, **kw):
    """core.estimate.estimate of plan_for_config(...); raises PlanError/SpecError with the planner's sentence."""

    return estimate(plan_for_config(cfg, gpu_gb, device, batch_size, **kw))


def plan_record(est) -> dict:
    """What goes into a run's plan.json: the estimate's totals and the plan it was made for."""
    d = est.to_dict()
    d.pop("phase_components", None)  # per-phase detail: large and read by nobody downstream
    return d


@dataclass(frozen=True)
class Card:
    """Where a run started on this machine trains: the device kind and the memory its plan is judged against (the
    GPU's memory; on a machine without a CUDA GPU, the RAM a CPU run draws from)."""

    device: str  # "cuda" | "cpu"
    gpu_gb: float
    label: str  # for a sentence: "the NVIDIA RTX 4090", "this machine's CPU (no CUDA GPU)"
    count: int = 1  # the CUDA GPUs torch can use here (0 on a machine without one)
    gpus: tuple = ()  # every GPU of the machine in nvidia-smi's order (NVML's GpuInfo), where NVML tells

    def of(self, cfg: dict) -> Card:
        """The card a run of `cfg` is planned against: the smallest of the GPUs it names (`gpus: [1, 3]`) or uses
        (the first N for a count; ids are nvidia-smi's, the order the trainer pins: distributed.pin_gpus)."""
        ids = distributed.gpu_ids(cfg)
        known = {g.index: g for g in self.gpus if g.memory_total}
        used = (
            [known[i] for i in ids if i in known]
            if ids
            else list(self.gpus[: distributed.gpus_per_machine(cfg)])
        )
        if self.device != "cuda" or not used or len(used) != len(ids or used):
            return self  # no NVML, or a GPU it does not list: gpu_problem says so
        small = min(used, key=lambda g: g.memory_total)
        return replace(self, gpu_gb=small.memory_total / 2**30, label=f"the {small.name}")


def local_card() -> Card:
    """This machine's card as the trainer will see it. NVML finds a GPU cheaply; torch then confirms that it can
    use it (a CPU build of torch on a GPU box trains on the CPU, and so must its plan)."""

    gpus, _ = gpu.detect_gpus()
    if gpus and gpus[0].memory_total:
        import torch

        if torch.cuda.is_available():
            return Card(
                "cuda",
                gpus[0].memory_total / 2**30,
                f"the {gpus[0].name}",
                torch.cuda.device_count(),
                tuple(gpus),
            )
    import psutil

    return Card("cpu", psutil.virtual_memory().total / 2**30, "this machine's CPU and RAM (no CUDA GPU)", 0)


def card_for(cfg: dict) -> Card:
    """This machine's card for a run of `cfg` (Card.of), or PlanError when the config asks for GPUs it lacks."""
    card = local_card()
    problem = gpu_problem(cfg, card)
    if problem:
        raise PlanError(problem)
    return card.of(cfg)


def busy_gpus(cfg: dict, need_bytes: int) -> list[str]:
    """A sentence for each GPU of this machine that a run of `cfg` will use whose memory other processes already
    hold so much of that the plan's per-GPU total (`need_bytes`) does not fit in what is left (a notebook kernel or
    another run: the most common out-of-memory at start)."""
    ids = distributed.gpu_ids(cfg) or list(range(distributed.gpus_per_machine(cfg)))
    out = []
    for s in gpu.in_use(ids):
        if s.memory_used is None or not s.memory_total or need_bytes <= s.memory_total - s.memory_used:
            continue
        holders = [p for p in s.other_processes if p.get("memory")]
        held = ", ".join(f"pid {p['pid']}: {p['memory'] / 2**30:.1f} GiB" for p in holders[:3])
        out.append(
            f"GPU {s.index} already has {s.memory_used / 2**30:.1f} of {s.memory_total / 2**30:.0f} GiB in use"
            + (f" ({held})" if held else "")
            + f": the plan's {need_bytes / 2**30:.1f} GiB per GPU does not fit in the "
            f"{max(0, s.memory_total - s.memory_used) / 2**30:.1f} GiB left; end that process, or pick another "
            "GPU (distributed.gpus, e.g. [1])."
        )
    return out


def gpu_problem(cfg: dict, card: Card) -> str | None:
    """One sentence when the distributed section asks for GPUs this machine does not have, else None. A count is
    checked against the GPUs torch can use; ids against every GPU of the machine (a process already pinned to
    one card by CUDA_VISIBLE_DEVICES still names it by nvidia-smi's number)."""
    gpus = cfg["distributed"]["gpus"]
    if gpus == 1:
        return None  # one process: the card the plan is made for
    have = card.count if card.device == "cuda" else 0
    if isinstance(gpus, list):
        installed = max(have, len(card.gpus)) if have else 0
        missing = [i for i in gpus if i >= installed]
        if missing:
            where = f"this machine has {installed} CUDA GPU{'s' if installed != 1 else ''}" + (
                f" ({card.label})" if installed else ""
            )
            valid = f"ids 0 to {installed - 1}" if installed else "no ids"
            return f"distributed.gpus names GPU {missing[0]} but {where}: use {valid}."
        return None
    where = f"this machine has {have} CUDA GPU{'s' if have != 1 else ''}" + (
        f" ({card.label})" if have else ""
    )
    if gpus > have:
        fix = f"set gpus: {have} or fewer" if have > 1 else "set gpus: 1 (one process)"
        return (
            f"distributed.gpus asks for {gpus} GPUs but {where}: {fix}, or plan another card with --gpu-gb."
        )
    return None


def resolve_strategy(cfg: dict, gpu_gb: float | None = None) -> str | None:
    """The strategy a run of `cfg` uses on several GPUs (auto resolved by the plan: DDP when it fits one card,
    else FSDP), or None for one process. On this machine's card unless `gpu_gb` names one."""
    if distributed.world_size(cfg) == 1:
        return None
    if gpu_gb is None:
        gpu_gb = card_for(cfg).gpu_gb
    return estimate_for_config(cfg, gpu_gb, "cuda").distributed["strategy"]


def write_accelerate_config(cfg: dict, run_dir, gpu_gb: float | None = None):
    """`<run_dir>/accelerate.yaml` for a run on several GPUs (its strategy resolved by the plan), or None for one
    process: what `accelerate launch --config_file` takes."""
    strategy = resolve_strategy(cfg, gpu_gb)
    if strategy is None:
        return None
    return distributed.write_accelerate_config(cfg, run_dir, strategy, resolve(cfg, Device.of("cuda")))


def plan_json(
    cfg: dict, gpu_gb: float | None = None, device: str | None = None, batch_size=None, smoke: bool = False
) -> dict:
    """The object a run's plan.json holds for `cfg`: on this machine's card unless a card is given; batch_size 1
    for a smoke test's. The trainer writes it (plan.json's one producer); --dry-run, `core.estimate --config` and
    the Train page's verdict call the same function, so they print the same numbers."""
    if device is None and gpu_gb is not None:
        device = "cuda"  # a card's size names a GPU: plan that card
    if gpu_gb is None or device is None:
        card = card_for(cfg)
        gpu_gb = card.gpu_gb if gpu_gb is None else gpu_gb
        device = device or card.device
    return plan_record(estimate_for_config(cfg, gpu_gb, device, batch_size, smoke=smoke))


# ---- the inverse: a Plan's settings written into a run config ------------------------------------------------


def _get(plan: Any, key: str, default=None):
    if isinstance(plan, dict):
        return plan.get(key, default)
    return getattr(plan, key, default)


def _put_images(plan: Any, cfg: dict) -> None:
    """A VLM plan's images as the run config's keys (image_fields' inverse): for a VLM model folder, or where the
    plan's images differ from the planner's defaults; a language model's config gets none."""
    values = {
        ("data", "image_size"): f"{_get(plan, 'image_width')}x{_get(plan, 'image_height')}",
        ("data", "max_pixels"): _get(plan, "max_pixels") or None,
        ("data", "images_per_row"): _get(plan, "images_per_row") or None,
        ("data", "pan_and_scan"): _get(plan, "pan_and_scan") or None,
        ("model", "freeze_vision"): None if _get(plan, "vision_frozen", True) else False,
    }
    defaults = {
        ("data", "image_size"): f"{Plan.image_width}x{Plan.image_height}",
        ("data", "images_per_row"): 1,
    }
    if _get(plan, "image_width") is None or not (
        vision.folder_is_vlm(cfg["model"].get("path") or "")
        or any(v is not None and v != defaults.get(k) for k, v in values.items())
    ):
        return
    for (section, key), value in values.items():
        if value is None:
            cfg[section].pop(key, None)
        else:
            cfg[section][key] = value


def plan_to_config(plan: Any, base: dict | None = None) -> dict:
    """A Plan (or its dict) as a run config, on top of `base`: the inverse of plan_for_config for the settings a
    run config carries. A measured step of a Plan builds its model through the engine, which reads run configs
    (core.measure.build); the pages never translate: both edit run configs.

    Tolerant: a missing or None key leaves the base value alone. Returns a validated config when base has the
    required paths, else an unvalidated dict the caller completes.
    """
    cfg = copy.deepcopy(base) if base else default_config()
    for section in SECTIONS:
        cfg.setdefault(section, {})
    plan = plan or {}

    def put(section, key, value, convert=lambda v: v):
        if value is not None:
            cfg[section][key] = convert(value)

    objective = _get(plan, "objective")
    if objective is not None:
        cfg["method"] = objective
        if cfg["data"].get("format") not in (None, "auto", *methods.get(objective).formats):
            cfg["data"]["format"] = "auto"
    if objective and methods.get(objective).traits.reference and _get(plan, "precompute_ref"):
        cfg["training"]["precompute_ref_log_probs"] = True
    method = str(_get(plan, "method") or "").lower()
    if method in ("full", "lora", "qlora"):
        set_method(cfg, method)

    lora = _get(plan, "lora") if isinstance(_get(plan, "lora"), dict) else {}
    put("lora", "r", _get(plan, "lora_r", lora.get("r")), int)
    put("lora", "lora_alpha", _get(plan, "lora_alpha", lora.get("alpha", lora.get("lora_alpha"))))
    put("lora", "lora_dropout", _get(plan, "lora_dropout", lora.get("dropout", lora.get("lora_dropout"))))
    targets = _get(plan, "target_modules", lora.get("target_modules"))
    if targets:
        if isinstance(targets, str) and targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        put("lora", "target_modules", targets if isinstance(targets, str) else list(targets))
    params = _get(plan, "target_parameters", lora.get("target_parameters"))
    if params or cfg["lora"].get("target_parameters"):
        params = [t.strip() for t in params.split(",") if t.strip()] if isinstance(params, str) else params
        cfg["lora"]["target_parameters"] = list(params or []) or None

    put(
        "training",
        "per_device_train_batch_size",
        _get(plan, "batch_size", _get(plan, "micro_batch_size")),
        int,
    )
    if methods.get(cfg.get("method")).traits.generates:
        # a prompt and its completion, said by the method's own keys (GRPOConfig has no max_length)
        own = methods.get(cfg.get("method")).training_of_plan(lambda k: _get(plan, k), cfg["training"])
        for key, value in own.items():  # None: the key goes (its default gives the plan's value)
            if value is None:
                cfg["training"].pop(key, None)
            else:
                cfg["training"][key] = value
    else:
        put("training", "max_length", _get(plan, "seq_len", _get(plan, "max_length")), int)
    # a plan that evaluates: its eval batch and the samples callback's prompts (0: the config keeps its own)
    if _get(plan, "eval_batch_size"):
        put("training", "per_device_eval_batch_size", _get(plan, "eval_batch_size"), int)
    if _get(plan, "eval_samples"):
        put("training", "eval_samples", _get(plan, "eval_samples"), int)
    put("training", "gradient_checkpointing", _get(plan, "gradient_checkpointing"), bool)
    put("training", "optim", _get(plan, "optim"))
    # the memory levers a run config carries (core.estimate.levers); the others are always on in the engine
    for plan_key, key in (
        ("padding_free", "padding_free"),
        ("packing", "packing"),
        ("activation_offloading", "activation_offloading"),
        ("liger", "use_liger_kernel"),
    ):
        value = _get(plan, plan_key)
        if value is not None and (value or key in cfg["training"]):
            cfg["training"][key] = bool(value)
    if _get(plan, "packing"):
        put("training", "packing_strategy", _get(plan, "packing_strategy"))

    attn = _get(plan, "attn", _get(plan, "attn_implementation"))
    if attn:
        put(
            "model",
            "attn_implementation",
            {"flash": "flash_attention_2", "fa2": "flash_attention_2"}.get(attn, attn),
        )
    put("model", "path", _get(plan, "model"), str)
    short = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    dtype = _get(plan, "load_dtype", _get(plan, "dtype"))
    if dtype:
        put("model", "dtype", short.get(str(dtype), str(dtype)))
    # The compute dtype is the Trainer's mixed-precision flag (and the 4-bit compute dtype).
    compute = _get(plan, "compute_dtype") or dtype
    if compute:
        compute = short.get(str(compute), str(compute))
        if _get(plan, "autocast") is False or compute == "float32":
            cfg["training"]["bf16"], cfg["training"]["fp16"] = False, False
        elif compute == "bfloat16":
            cfg["training"]["bf16"], cfg["training"]["fp16"] = "auto", False
        elif compute == "float16":
            cfg["training"]["bf16"], cfg["training"]["fp16"] = False, True
        if compute in DTYPES:
            cfg["quantization"]["bnb_4bit_compute_dtype"] = compute
    quant = _get(plan, "quant_type", _get(plan, "bnb_4bit_quant_type"))
    if quant:
        put("quantization", "bnb_4bit_quant_type", str(quant).lower())
    put("quantization", "bnb_4bit_use_double_quant", _get(plan, "double_quant"), bool)
    # several GPUs: the plan's process count is this machine's (num_machines stays as the base has it)
    gpus = _get(plan, "gpus")
    if gpus is not None:
        machines = cfg["distributed"].get("num_machines") or 1
        per_machine = max(1, int(gpus) // machines)
        now = cfg["distributed"].get("gpus", 1)
        if (len(now) if isinstance(now, list) else now) != per_machine:  # a list of ids of that length stays
            cfg["distributed"]["gpus"] = per_machine
    put("distributed", "strategy", _get(plan, "strategy"), str)
    put("distributed", "cpu_offload", _get(plan, "cpu_offload"), bool)
    _put_images(plan, cfg)

    if cfg["model"].get("path") and cfg["data"].get("path"):
        return validate_config(cfg)
    return cfg
