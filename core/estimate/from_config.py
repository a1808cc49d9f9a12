"""The one mapping from a run config to the planner's input (a core.estimate Plan).

Everything that plans or measures a run goes through `plan_for_config`: the Train page's estimate, the launcher's
plan.json, the smoke test, the tracker and the benchmarks. Its dtypes come from core.precision (the resolver the
trainer uses) for the device, and its memory switches follow what the engine (TRL's SFTTrainer) really does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from core import machine
from core.estimate.bill import estimate
from core.estimate.config_map import ENGINE, PlanReader, plan_values, put_plan
from core.estimate.plan import Plan, PlanError, upgraded
from core.precision import SHORT, Device, resolve
from core.recipe import distributed, methods, vision
from core.recipe.config import default_config, validate_config
from core.recipe.config_keys import SECTIONS


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
    method = methods.get(cfg)
    fields = plan_values(cfg, method, smoke)  # every field the table reads from the config
    load, compute, autocast = plan_dtypes(cfg, device)
    batch = method.smoke_batch(cfg) if smoke else (batch_size or fields["batch_size"])
    world = 1 if smoke else distributed.world_size(cfg)
    fields.update(
        model=model or fields["model"],
        batch_size=batch,
        # DPO/KTOTrainer: the base with the adapter disabled, or a second model (full fine-tune, reference_path)
        reference="copy" if method.traits.reference and cfg["model"].get("reference_path") else "auto",
        load_dtype=load,
        compute_dtype=compute,
        autocast=autocast,
        gpu_gb=float(gpu_gb),
        expandable_segments=expandable_segments,
        device=device,
        **ENGINE,
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
    num_generations_eval, the samples callback's prompts (none on sharded weights: core.train.eval_callbacks)."""
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
    """This machine's card as the trainer will see it (core.machine.cuda_gpus: NVML's GPUs that torch can use, as
    `lora-cockpit doctor` reports them); its CPU and RAM when torch can use none."""
    here = machine.cuda_gpus()
    if here.usable and here.gpus and here.gpus[0].memory_total:
        first = here.gpus[0]
        return Card("cuda", first.memory_total / 2**30, f"the {first.name}", here.usable, here.gpus)
    return Card("cpu", machine.ram()[0] / 2**30, "this machine's CPU and RAM (no CUDA GPU)", 0)


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
    for s in machine.gpu_readings(ids):
        if s.memory_used is None or not s.memory_total or need_bytes <= s.memory_total - s.memory_used:
            continue
        holders = [p for p in s.others if p.get("memory")]
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
    plan = upgraded(plan) if isinstance(plan, dict) else plan  # a dict in a plan's older names reads too
    put_plan(PlanReader(plan or {}), cfg)  # core.estimate.config_map's table, row by row
    if cfg["model"].get("path") and cfg["data"].get("path"):
        return validate_config(cfg)
    return cfg
