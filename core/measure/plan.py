"""What a measured step does (MeasurePlan) and its two-way mapping to the planner's Plan and run configs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from core.estimate.bill import estimate
from core.estimate.from_config import plan_for_config
from core.estimate.plan import Plan, PlanError
from core.estimate.specs import SpecError
from core.measure.tracker import TrackerError
from core.precision import LONG, SHORT
from core.train import methods
from core.train.config import ConfigError, validate_config


@dataclass
class MeasurePlan:
    """What a run does that changes its memory. Names follow TrainingArguments / LoraConfig / BitsAndBytesConfig."""

    method: str = "lora"  # lora | qlora | full
    dtype: str = "bfloat16"  # load dtype of the base weights
    mixed_precision: str | None = (
        "auto"  # "bf16"/"fp16" = Trainer autocast; "auto": bf16 when dtype is 16-bit
    )
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    # QLoRA only. True: peft.prepare_model_for_kbit_training (the plain-Trainer path). False: what TRL's
    # SFTTrainer does instead: enable_input_require_grads with checkpointing, trainable params cast to bf16.
    prepare_kbit: bool = False
    # SFTTrainer's trl.trainer.utils.add_fused_lm_head + compute_loss (no full logits); False = the plain
    # causal-LM loss over (tokens x vocab) logits.
    fused_lm_head: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: str | list = "all-linear"
    batch_size: int = 1
    seq_len: int = 512
    gradient_checkpointing: bool = False
    attn: str = "sdpa"
    optim: str = "adamw_torch"
    # SFTConfig.padding_free / packing: the batch as TRL's collator gives it (one row of all tokens, position_ids)
    padding_free: bool = False
    packing: bool = False
    packing_strategy: str = "bfd"
    # SFTConfig.activation_offloading / use_liger_kernel: CUDA only (the engine leaves them out on a CPU)
    activation_offloading: bool = False
    liger: bool = False
    # DPOTrainer (method dpo): a chosen and a rejected row per example, the reference forward inside the step
    # (the base with the adapter off) unless precompute_ref_log_probs
    objective: str = "sft"
    precompute_ref: bool = False
    max_grad_norm: float = 1.0
    foreach: bool | None = (
        None  # torch optimizers: None = torch default for the device (CPU: per-tensor loop)
    )
    extra: dict = field(default_factory=dict)

    def autocast_dtype(self) -> torch.dtype | None:
        mp = self.mixed_precision
        if mp == "auto":
            mp = {"bfloat16": "bf16", "float16": "fp16"}.get(self.dtype)
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp) if mp else None


def _dtype_name(value) -> str:
    name = str(value).replace("torch.", "")
    name = LONG.get(name, "float16" if name == "half" else name)
    if name not in SHORT:
        raise TrackerError(f"unknown dtype {value!r}: use one of {', '.join(SHORT)}")
    return name


def plan_from(obj) -> MeasurePlan:
    """A MeasurePlan from a MeasurePlan, a flat dict of its fields, a run config (sections model, quantization,
    lora, data, training) or any object with those attributes (e.g. the planner's plan)."""
    if isinstance(obj, MeasurePlan):
        return obj
    if not isinstance(obj, dict):
        obj = asdict(obj) if hasattr(obj, "__dataclass_fields__") else dict(vars(obj))
    if {"model", "training"} & set(obj) and isinstance(obj.get("training", {}), dict):
        return _plan_from_run_config(obj)
    names = {f.name for f in fields(MeasurePlan)}
    unknown = sorted(set(obj) - names)
    plan = MeasurePlan(**{k: v for k, v in obj.items() if k in names})
    plan.extra.update({k: obj[k] for k in unknown})
    return checked_plan(plan)


def _plan_from_run_config(cfg: dict, device: str = "cpu") -> MeasurePlan:
    """Through the one run config -> plan mapping (core.estimate.from_config), then into the measurement's terms:
    the dtypes are resolved for `device` exactly as the trainer resolves them."""

    cfg = dict(cfg)  # the data and the weights play no part in a step's memory: placeholders where absent
    for section in ("model", "data"):
        cfg[section] = {"path": "unused", **(cfg.get(section) or {})}
    try:
        cfg = validate_config(cfg)
    except ConfigError as exc:
        raise TrackerError(str(exc)) from None
    return from_planner(plan_for_config(cfg, device=device), max_grad_norm=cfg["training"]["max_grad_norm"])


# Fields a MeasurePlan and a core.estimate Plan share under the same name and meaning (the levers, DPO)
SAME_NAMED = (
    "padding_free",
    "packing",
    "packing_strategy",
    "objective",
    "precompute_ref",
    "activation_offloading",
    "liger",
)


def from_planner(plan, max_grad_norm: float = 1.0) -> MeasurePlan:
    """The MeasurePlan of a core.estimate Plan (the inverse of planner_plan)."""
    long = {v: k for k, v in {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.items()}
    mixed = plan.compute_dtype if plan.autocast and plan.compute_dtype != "fp32" else None
    return checked_plan(
        MeasurePlan(
            method=plan.method,
            dtype=long[plan.load_dtype],
            mixed_precision=mixed,
            quant_type=plan.quant_type,
            double_quant=plan.double_quant,
            compute_dtype=long[plan.compute_dtype],
            prepare_kbit=plan.prepare_kbit,
            fused_lm_head=plan.fused_lm_head,
            lora_r=plan.lora_r,
            lora_alpha=plan.lora_alpha,
            lora_dropout=plan.lora_dropout,
            target_modules=plan.target_modules,
            batch_size=plan.batch_size,
            seq_len=plan.seq_len,
            gradient_checkpointing=plan.gradient_checkpointing,
            attn=plan.attn,
            optim=plan.optim,
            **{name: getattr(plan, name) for name in SAME_NAMED},
            max_grad_norm=max_grad_norm,
        )
    )


def checked_plan(plan: MeasurePlan) -> MeasurePlan:
    if plan.method not in ("lora", "qlora", "full"):
        raise TrackerError(f"method {plan.method!r} is not one of lora, qlora, full")
    plan.dtype = _dtype_name(plan.dtype)
    plan.compute_dtype = _dtype_name(plan.compute_dtype)
    for name in ("batch_size", "seq_len", "lora_r"):
        if int(getattr(plan, name)) < 1:
            raise TrackerError(f"{name} must be a positive integer, got {getattr(plan, name)!r}")
    if isinstance(plan.target_modules, str) and plan.target_modules.strip() != "all-linear":
        plan.target_modules = [t.strip() for t in plan.target_modules.split(",") if t.strip()]
    if plan.attn not in ("sdpa", "eager"):
        raise TrackerError(f"attention {plan.attn!r} is not measurable here: use sdpa or eager")
    try:
        method = methods.get(plan.objective)
    except ValueError as exc:
        raise TrackerError(str(exc)) from None
    if method.traits.reference and not is_engine_path(plan):
        raise TrackerError(
            f"{method.label} is measured through the engine only ({method.trainer_name}: fused LM head, no "
            "prepare_kbit)"
        )
    return plan


def planner_plan(model: str, plan: MeasurePlan, device: str = "cpu"):
    """The core.estimate Plan for the same configuration (model: a preset id or a folder with config.json)."""

    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    targets = plan.target_modules
    autocast = plan.autocast_dtype()
    if autocast is not None:  # Trainer's bf16/fp16 flag decides the activations' dtype
        compute = short[str(autocast).replace("torch.", "")]
    else:
        compute = short[plan.compute_dtype] if plan.method == "qlora" else short[plan.dtype]
    return Plan(
        model=str(model),
        method=plan.method,
        load_dtype=short[plan.dtype],
        compute_dtype=compute,
        quant_type=plan.quant_type,
        double_quant=plan.double_quant,
        prepare_kbit=plan.prepare_kbit,
        fused_lm_head=plan.fused_lm_head,
        lora_r=plan.lora_r,
        lora_alpha=plan.lora_alpha,
        # DPO/KTOConfig.disable_dropout: every dropout p=0
        lora_dropout=0.0 if methods.get(plan.objective).traits.reference else plan.lora_dropout,
        target_modules=targets if isinstance(targets, str) else ",".join(targets),
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        gradient_checkpointing=plan.gradient_checkpointing,
        attn=plan.attn,
        optim=plan.optim,
        **{name: getattr(plan, name) for name in SAME_NAMED},
        device="cpu" if device == "cpu" else "cuda",
        autocast=autocast is not None,
    )


def estimate_for(model: str, plan: MeasurePlan, device: str = "cpu") -> dict | None:
    """The planner's figures for this model and plan: tensor_peak_bytes, peak_phase, phases, components."""

    try:
        est = estimate(planner_plan(model, plan, device))
    except (PlanError, SpecError) as exc:
        return {"error": str(exc)}
    keep = (
        "tensor_peak_bytes",
        "reserved_peak_bytes",
        "device_total_bytes",
        "peak_phase",
        "phases",
        "components",
    )
    return {k: getattr(est, k) for k in keep}


def is_engine_path(plan: MeasurePlan) -> bool:
    """What core.train does (TRL's SFTTrainer): the fused LM head, QLoRA without prepare_model_for_kbit_training.
    Such plans are measured on the model the engine itself builds; the others (the HF-default baseline the
    planner also knows) on a model built here the way plain Trainer + peft would build it."""
    return plan.fused_lm_head and not plan.prepare_kbit
