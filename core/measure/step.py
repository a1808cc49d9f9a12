"""Measure a training configuration for real: build the model the way a run builds it (transformers + peft +
bitsandbytes, gradient checkpointing, the optimizer Trainer would pick, and either TRL's SFTTrainer
preparation -- fused LM head, bf16 QLoRA adapters -- or the plain Trainer path with
`prepare_model_for_kbit_training`), run one step under the tracker, and compare with the planner.

- `measure_plan(config, plan, num_layers=...)`: one step of `plan` on a model built from a transformers config
  (random weights; the memory of a step does not depend on their values).
- `measure_depths(config, plan)`: the real widths at 2 and 3 layers, extrapolated to the full depth per phase
  (per-layer term = m3 - m2, the rest is constant): how we measure 7B-70B models on a CPU.
- `measure_config(model_dir_or_config, plan_or_run_config)`: the smoke-test hook; measured vs estimated.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import tempfile
import weakref
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from core.demo.toy import build_tokenizer
from core.estimate.bill import estimate
from core.estimate.from_config import plan_for_config
from core.estimate.plan import Plan, PlanError, flat_batch
from core.estimate.specs import SpecError
from core.measure.tracker import StepMemory, TrackerError, main_phase, main_phase_peaks, track_live_tensors
from core.precision import LONG, SHORT, Device, Precision, torch_dtype
from core.train import methods
from core.train.config import ConfigError, plan_to_config, validate_config
from core.train.trainer import load_model, make_trainer, quiet_progress_bars


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
    return _checked(plan)


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
    return _checked(
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


def _checked(plan: MeasurePlan) -> MeasurePlan:
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


# -- building the model --------------------------------------------------------------------------------------
def with_layers(config, num_layers: int):
    """A copy of a transformers config with `num_layers` decoder layers (per-layer lists cut to match)."""
    cfg = copy.deepcopy(config)
    attr = (
        "n_layer"
        if hasattr(cfg, "n_layer") and not hasattr(cfg, "num_hidden_layers")
        else "num_hidden_layers"
    )
    setattr(cfg, attr, num_layers)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:num_layers]
    return cfg


def _config_key(config) -> str:
    return hashlib.sha1(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


def _fill_random(model, seed: int = 0):
    # Random values keep the numerics finite (bnb quantizes them, the loss is defined); the memory of a step
    # does not depend on them. uniform_ is cheaper than each module's own init.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.uniform_(-0.02, 0.02, generator=g)


def _random_model(config, dtype: torch.dtype, attn: str | None = None):
    """The real architecture with random weights, skipping transformers' own (slow) initialisation."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    kwargs = {"attn_implementation": attn} if attn else {}
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    model.tie_weights()  # init_weights (skipped above) is also where tied embeddings get tied
    _fill_random(model)
    return model


def _saved_checkpoint(config, dtype: str, cache_dir: Path) -> Path:
    """QLoRA loads through from_pretrained (the real quantizing path), so the random model is saved once."""

    out = cache_dir / f"ckpt-{_config_key(config)}-{dtype}"
    if (out / "config.json").exists():
        return out
    model = _random_model(config, torch_dtype(dtype))
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out


def build_model(
    config_or_dir, plan: MeasurePlan, cache_dir: str | os.PathLike | None = None, device: str = "cpu"
):
    """The model a run with `plan` trains: base (+ 4-bit) + LoRA, with the attention implementation and
    gradient checkpointing set as Trainer sets them, on `device` (4-bit weights are quantized where they
    land), prepared for QLoRA by prepare_model_for_kbit_training (plan.prepare_kbit) or as SFTTrainer does, and with
    SFTTrainer's fused LM head (plan.fused_lm_head). Returns (model, config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from_dir = isinstance(config_or_dir, (str, os.PathLike))
    config = AutoConfig.from_pretrained(str(config_or_dir)) if from_dir else config_or_dir
    config = copy.deepcopy(config)
    config.use_cache = False  # training: no KV cache
    if is_engine_path(plan):
        src = Path(config_or_dir) if from_dir else _saved_checkpoint(config, plan.dtype, Path(cache_dir))
        return _build_with_engine(src, plan, device), config
    dtype = torch_dtype(plan.dtype)
    if plan.method == "qlora":
        src = Path(config_or_dir) if from_dir else _saved_checkpoint(config, plan.dtype, Path(cache_dir))
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=plan.quant_type,
            bnb_4bit_use_double_quant=plan.double_quant,
            bnb_4bit_compute_dtype=torch_dtype(plan.compute_dtype),
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(src),
            quantization_config=quant,
            dtype=dtype,
            attn_implementation=plan.attn,
            # a bare "cuda" as core.train names it: the current GPU's index (the documented device_map form)
            device_map={"": torch.cuda.current_device() if device == "cuda" else device},
        )
    elif from_dir:
        model = AutoModelForCausalLM.from_pretrained(
            str(config_or_dir), dtype=dtype, attn_implementation=plan.attn
        )
    else:
        model = _random_model(config, dtype, plan.attn)
    if plan.method != "qlora":
        model.to(device)
    model.config.use_cache = False
    # As core.train builds it: prepare_model_for_kbit_training with non-reentrant checkpointing for QLoRA,
    # enable_input_require_grads for LoRA + checkpointing, then Trainer's gradient_checkpointing_enable.
    no_reentrant = {"use_reentrant": False}
    if plan.method == "qlora" and plan.prepare_kbit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=plan.gradient_checkpointing,
            gradient_checkpointing_kwargs=no_reentrant,
        )
    if plan.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=no_reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=no_reentrant)
        if plan.method == "lora":
            model.enable_input_require_grads()  # checkpointed blocks need a grad-requiring input
    if plan.method in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=plan.lora_r,
            lora_alpha=plan.lora_alpha,
            lora_dropout=plan.lora_dropout,
            target_modules=plan.target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    if plan.method == "qlora" and not plan.prepare_kbit:
        _trl_qlora_preparation(model, plan)
    if plan.fused_lm_head:
        from trl.trainer.utils import add_fused_lm_head

        # As SFTTrainer.__init__ does it, on the base model under the peft wrapper; the metrics' outputs
        # (entropy for logging, is_top1 for mean_token_accuracy) change the kernel's temporaries.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        add_fused_lm_head(base, outputs=TRL_FUSED_OUTPUTS)
    return model, config


TRL_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what trl 1.16 SFTTrainer asks of the fused head
# The engine's trainer of each model built through it: its optimizer and its loss are used for the step.
_ENGINE_TRAINERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_engine_path(plan: MeasurePlan) -> bool:
    """What core.train does (TRL's SFTTrainer): the fused LM head, QLoRA without prepare_model_for_kbit_training.
    Such plans are measured on the model the engine itself builds; the others (the HF-default baseline the
    planner also knows) on a model built here the way plain Trainer + peft would build it."""
    return plan.fused_lm_head and not plan.prepare_kbit


def _build_with_engine(src: Path, plan: MeasurePlan, device: str):
    """The model through core.train's own functions: load_model (the base, 4-bit where asked) and make_trainer
    (SFTTrainer: peft, its QLoRA casts, its fused head), from the run config that plan describes (the inverse of
    the one config -> plan mapping). Gradient checkpointing is switched on as Trainer.train does."""
    from datasets import Dataset

    quiet_progress_bars()

    planned = planner_plan(str(src), plan, device).to_dict()
    base = validate_config({"model": {"path": str(src)}, "data": {"path": "unused.jsonl"}})
    cfg = validate_config(plan_to_config(planned, base))
    cfg["model"]["dtype"], cfg["training"]["max_grad_norm"] = plan.dtype, plan.max_grad_norm
    autocast = plan.autocast_dtype()
    bf16, fp16 = autocast is torch.bfloat16, autocast is torch.float16
    compute = "bfloat16" if bf16 else "float16" if fp16 else plan.dtype
    prec = Precision(Device.of(device), plan.dtype, compute, bf16 or fp16, bf16, fp16)
    tokenizer = build_tokenizer()  # the measured batch is random ids: only the trainer's pad token matters
    data = Dataset.from_list(list(methods.get(plan.objective).measure_rows))
    model = load_model(cfg, prec)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = make_trainer(cfg, prec, model, tokenizer, data, run_dir=run_dir)
    model = trainer.model
    if plan.gradient_checkpointing:  # Trainer.train() switches it on with the args' kwargs
        kwargs = trainer.args.gradient_checkpointing_kwargs
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    _ENGINE_TRAINERS[model] = trainer
    return model


def _trl_qlora_preparation(model, plan: MeasurePlan) -> None:
    """SFTTrainer.__init__ (trl 1.16) for a quantized peft model, in place of prepare_model_for_kbit_training:
    input grads for checkpointed blocks, and every trainable parameter cast to bfloat16 (the QLoRA paper's
    recommendation; DoRA's magnitude vector excluded), so their grads and Adam states are bf16 too."""
    if plan.gradient_checkpointing:
        model.enable_input_require_grads()
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def build_optimizer(model, plan: MeasurePlan):
    """The optimizer Trainer builds for `plan.optim` (its own name→class mapping); the engine's trainer's own
    for a model built through the engine."""
    from transformers import Trainer, TrainingArguments

    trainer = _ENGINE_TRAINERS.get(model)
    if trainer is not None and plan.foreach is None:
        return trainer.create_optimizer()

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=plan.optim, report_to=[], use_cpu=True)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if cls.__module__.startswith("torch.optim") and plan.foreach is not None and "fused" not in kwargs:
        kwargs["foreach"] = plan.foreach
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = cls(params, **kwargs)
    if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
        # as Trainer.create_optimizer does: embeddings keep 32-bit states under a bnb 8-bit optimizer
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def make_batch(config, plan: MeasurePlan, seed: int = 0) -> dict:
    """A full batch of random tokens with labels: rows of seq_len tokens with an all-ones attention mask, as a
    padding collator gives for equal-length rows; or, padding-free (or BFD-packed), what TRL's collator makes
    of them: one row of every token with position_ids (two documents per packed row)."""
    g = torch.Generator().manual_seed(seed)
    own = methods.get(plan.objective).measure_batch(
        g, config.vocab_size, plan.batch_size, plan.seq_len, plan.precompute_ref
    )
    if own is not None:
        return own
    ids = torch.randint(0, config.vocab_size, (plan.batch_size, plan.seq_len), generator=g)

    if not flat_batch(plan):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = []
    for row in ids.tolist():
        example = {"input_ids": row, "labels": row}
        if plan.packing:
            half = max(1, plan.seq_len // 2)
            example["seq_lengths"] = [half, plan.seq_len - half] if plan.seq_len > half else [plan.seq_len]
        rows.append(example)
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)


def _trainer_forward(model, plan: MeasurePlan, device_type: str = "cpu"):
    """Wrap forward as accelerate does under Trainer(bf16=True): autocast, outputs converted to fp32."""
    dt = plan.autocast_dtype()
    if dt is None:
        return contextlib.nullcontext()
    from accelerate.utils import convert_outputs_to_fp32

    original = model.forward
    model.forward = convert_outputs_to_fp32(torch.autocast(device_type, dtype=dt)(original))

    @contextlib.contextmanager
    def restore():
        try:
            yield
        finally:
            model.forward = original

    return restore()


def run_step(model, optimizer, batch, plan: MeasurePlan, detail: bool = False) -> StepMemory:
    """One Trainer-like step under the tracker: forward + loss, backward, grad clipping, optimizer step,
    zero_grad(set_to_none)."""
    model.train()
    device_type = batch["input_ids"].device.type
    with (
        _trainer_forward(model, plan, device_type),
        # On a GPU only GPU memory is the planner's business (torch keeps e.g. Adam's step counts on the CPU).
        track_live_tensors(
            model, optimizer, tensors=batch, device="cuda" if device_type == "cuda" else None, detail=detail
        ) as tr,
    ):
        hooks = _backward_landmarks(model, tr)
        # SFTTrainer.training_step runs compute_loss inside its activation-offloading context (a no-op when off)
        trainer = _ENGINE_TRAINERS.get(model)
        offload = getattr(trainer, "maybe_activation_offload_context", None) or contextlib.nullcontext()
        with tr.phase("forward"), offload:
            loss = _loss(model, batch, plan)
        with tr.phase("backward"):
            loss.backward()
            del loss
        for h in hooks:
            h.remove()
        with tr.phase("optimizer"):
            if plan.max_grad_norm:
                params = [p for p in model.parameters() if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, plan.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result = tr.result()
    if detail:
        result.extra["peak_detail"] = tr.peak_detail
        result.extra["phase_detail"] = tr.phase_detail
    return result


def _backward_landmarks(model, tracker) -> list:
    """Name the moments of backward as sub-phases, so that each one's peak is linear in the depth:
    backward (loss, lm_head, final norm), :first-layer (the last decoder layer, met first), :middle,
    :last-layer (layer 0), :tail (the embedding). Where in backward the peak falls moves with the depth
    (activations drain while gradients pile up); within each of these moments it does not."""
    layers = _decoder_layers(model)
    n = len(layers)

    def landmark(name):
        def on_output(_module, _args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            # not during checkpoint recomputation (inside backward): that output is never backpropagated
            if torch.is_tensor(t) and t.requires_grad and torch._C._current_autograd_node() is None:
                t.register_hook(on_grad)

        def on_grad(_grad):  # the gradient w.r.t. this output is ready: its module's backward starts
            tracker.phase(name)

        return on_output

    hooks = []
    for i, layer in enumerate(layers):
        name = (
            "backward:first-layer" if i == n - 1 else "backward:last-layer" if i == 0 else "backward:middle"
        )
        hooks.append(layer.register_forward_hook(landmark(name)))
    hooks.append(model.get_input_embeddings().register_forward_hook(landmark("backward:tail")))
    return hooks


def _decoder_layers(model):
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise TrackerError(f"{type(model).__name__} has no decoder layers (no nn.ModuleList) to measure")
    return max(lists, key=len)


def _loss(model, batch, plan: MeasurePlan | None = None):
    """The training loss as the trainer computes it; the outputs die here, before backward."""
    trainer = _ENGINE_TRAINERS.get(model)
    if trainer is not None:
        return trainer.compute_loss(model, dict(batch))  # SFTTrainer's own (it edits the inputs: a copy)
    if plan is None or not plan.fused_lm_head:
        return model(**batch).loss  # Trainer.compute_loss: the (tokens x vocab) logits die with the outputs
    # SFTTrainer.compute_loss (trl 1.16, default loss_type "nll", no num_items_in_batch): per-token
    # log-probabilities from the fused head, then its logged metrics (entropy, mean_token_accuracy).
    outputs = model(**batch, use_cache=False, fused_lm_head=True)
    per_token_loss = -outputs.log_probs  # zero on ignored positions
    num_tokens = outputs.label_mask.sum()
    loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
    # the logged metrics: scalars, but the per-token outputs stay alive until they are taken
    num_valid = outputs.label_mask.sum().clamp(min=1)
    _ = (outputs.entropy.detach().sum() / num_valid, outputs.is_top1.sum() / num_valid)
    return loss


def measure_plan(config, plan, num_layers: int | None = None, cache_dir=None) -> StepMemory:
    """One measured step of `plan` on a model built from `config` (at `num_layers` when given)."""
    plan = _checked(copy.deepcopy(plan_from(plan)))
    if num_layers is not None:
        config = with_layers(config, num_layers)
    with tempfile.TemporaryDirectory() as tmp:
        model, cfg = build_model(config, plan, cache_dir or tmp)
        optimizer = build_optimizer(model, plan)
        return run_step(model, optimizer, make_batch(cfg, plan), plan)


# -- reduced depth ------------------------------------------------------------------------------------------
@dataclass
class DepthFit:
    """Per-phase peaks at two depths, extrapolated linearly in the number of layers."""

    layers: tuple[int, int]
    small: StepMemory
    large: StepMemory

    def _per_phase(self, which: str, num_layers: int) -> dict[str, int]:
        (l1, l2), out = self.layers, {}
        a, b = getattr(self.small, which), getattr(self.large, which)
        for p in a.keys() & b.keys():  # a "middle" layer exists only from 3 layers on: bounded by first/last
            per_layer = (b[p] - a[p]) // (l2 - l1)
            out[p] = a[p] + (num_layers - l1) * per_layer
        return out

    def phase_peaks_at(self, num_layers: int, steady: bool = True) -> dict[str, int]:
        """Extrapolated peak of each phase (sub-phases folded in)."""
        return main_phase_peaks(
            self._per_phase("steady_phase_peaks" if steady else "phase_peaks", num_layers)
        )

    def peak_at(self, num_layers: int, steady: bool = True) -> tuple[int, str]:
        """(bytes, phase) of the extrapolated peak. steady=True: a later step (optimizer state alive)."""
        peaks = self._per_phase("steady_phase_peaks" if steady else "phase_peaks", num_layers)
        phase = max(peaks, key=peaks.get)
        return peaks[phase], main_phase(phase)

    def saved_at(self, num_layers: int) -> int:
        (l1, l2), a, b = self.layers, self.small.saved_bytes, self.large.saved_bytes
        return a + (num_layers - l1) * ((b - a) // (l2 - l1))


def num_layers_of(config) -> int:
    n = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not n:
        raise TrackerError(f"{type(config).__name__} has no num_hidden_layers: not a decoder config")
    return int(n)


def measure_depths(config, plan, layers=(2, 3), seq_lens=None, cache_dir=None) -> dict[int, DepthFit]:
    """Measure `plan` at the real widths with layers[0] and layers[1] decoder layers, for each sequence length
    in `seq_lens` (default: the plan's). Returns {seq_len: DepthFit}; `fit.peak_at(num_layers_of(config))`.

    Why 2 and 3 layers by default, not 1 and 2: the first layer saves less (its input comes from a frozen
    embedding, so e.g. LoRA dropout keeps no mask there) and the last one differs too; a 1-layer model is both
    at once, so m(2) - m(1) is not a middle layer's bytes. From 2 layers on, each added layer is a middle one."""
    plan = plan_from(plan)
    out = {}
    for s in seq_lens or [plan.seq_len]:
        p = copy.copy(plan)
        p.seq_len = s
        small, large = (measure_plan(config, p, n, cache_dir) for n in layers)
        out[s] = DepthFit(tuple(layers), small, large)
    return out


# -- the smoke-test hook ---------------------------------------------------------------------------------------
def measure_config(model_dir_or_spec, plan_or_run_config, device: str = "cpu") -> dict:
    """One real step of the user's model and config under the tracker, next to the planner's estimate.
    `model_dir_or_spec`: a local model folder (its weights are loaded) or a transformers config.
    Returns {"measured": StepMemory as dict, "estimated": planner figures or None, "error": relative error}."""
    plan = plan_from(plan_or_run_config)
    if device != "cpu" and not torch.cuda.is_available():
        raise TrackerError(f"device {device!r} asked for but CUDA is not available; use device='cpu'")
    src = model_dir_or_spec
    if isinstance(src, (str, os.PathLike)) and not (Path(src) / "config.json").exists():
        raise TrackerError(
            f"{src} is not a model folder (no config.json); pass a local model folder or a config"
        )
    with tempfile.TemporaryDirectory() as tmp:
        model, cfg = build_model(src, plan, tmp, device)
        optimizer = build_optimizer(model, plan)
        batch = {k: v.to(device) for k, v in make_batch(cfg, plan).items()}
        measured = run_step(model, optimizer, batch, plan)
        if not isinstance(src, (str, os.PathLike)):  # the planner reads a folder's config.json
            src = Path(tmp) / "planner-config"
            src.mkdir()
            cfg.to_json_file(str(src / "config.json"))
        estimated = estimate_for(str(src), plan, device)
    out = {"measured": measured.to_dict(), "estimated": estimated, "error": None}
    if estimated and estimated.get("tensor_peak_bytes"):
        # the planner predicts a steady step (optimizer state alive), which the first step's figures give
        out["error"] = estimated["tensor_peak_bytes"] / measured.steady_peak_bytes - 1
    return out


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


def to_json(result: dict) -> str:
    return json.dumps(result, indent=2, default=str)
