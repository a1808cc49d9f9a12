"""The model and optimizer of a measured step, built the way a run builds them: through the engine itself
(load_model + make_trainer) or the plain Trainer + peft path the planner also knows."""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from core.demo.toy import build_tokenizer
from core.estimate.from_config import plan_to_config
from core.estimate.plan import Plan
from core.measure.step_plan import StepOptions, autocast_dtype, is_engine_path, lora_targets
from core.precision import LONG, Device, Precision, torch_dtype
from core.recipe import methods
from core.recipe.config import validate_config
from core.train.model import load_model, make_trainer, quiet_progress_bars


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
    config_or_dir,
    plan: Plan,
    cache_dir: str | os.PathLike | None = None,
    options: StepOptions = StepOptions(),
):
    """The model a run with `plan` trains: base (+ 4-bit) + LoRA, with the attention implementation and
    gradient checkpointing set as Trainer sets them, on plan.device (4-bit weights are quantized where they
    land), prepared for QLoRA by prepare_model_for_kbit_training (plan.prepare_kbit) or as SFTTrainer does, and with
    SFTTrainer's fused LM head (plan.fused_lm_head). Returns (model, config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from_dir = isinstance(config_or_dir, (str, os.PathLike))
    config = AutoConfig.from_pretrained(str(config_or_dir)) if from_dir else config_or_dir
    config = copy.deepcopy(config)
    config.use_cache = False  # training: no KV cache
    device = plan.device
    if is_engine_path(plan):
        src = Path(config_or_dir) if from_dir else _saved_checkpoint(config, plan.load_dtype, Path(cache_dir))
        return _build_with_engine(src, plan, options), config
    dtype = torch_dtype(plan.load_dtype)
    if plan.tuning == "qlora":
        src = Path(config_or_dir) if from_dir else _saved_checkpoint(config, plan.load_dtype, Path(cache_dir))
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
    if plan.tuning != "qlora":
        model.to(device)
    model.config.use_cache = False
    # As core.train builds it: prepare_model_for_kbit_training with non-reentrant checkpointing for QLoRA,
    # enable_input_require_grads for LoRA + checkpointing, then Trainer's gradient_checkpointing_enable.
    no_reentrant = {"use_reentrant": False}
    if plan.tuning == "qlora" and plan.prepare_kbit:
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
        if plan.tuning == "lora":
            model.enable_input_require_grads()  # checkpointed blocks need a grad-requiring input
    if plan.tuning in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=plan.lora_r,
            lora_alpha=plan.lora_alpha,
            lora_dropout=plan.lora_dropout,
            target_modules=lora_targets(plan),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    if plan.tuning == "qlora" and not plan.prepare_kbit:
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
ENGINE_TRAINERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _build_with_engine(src: Path, plan: Plan, options: StepOptions):
    """The model through core.train's own functions: load_model (the base, 4-bit where asked) and make_trainer
    (SFTTrainer: peft, its QLoRA casts, its fused head), from the run config that plan describes (the inverse of
    the one config -> plan mapping). Gradient checkpointing is switched on as Trainer.train does."""
    from datasets import Dataset

    quiet_progress_bars()

    base = validate_config({"model": {"path": str(src)}, "data": {"path": "unused.jsonl"}})
    cfg = validate_config(plan_to_config(replace(plan, model=str(src)), base))
    load = LONG[plan.load_dtype]
    cfg["model"]["dtype"], cfg["training"]["max_grad_norm"] = load, options.max_grad_norm
    autocast = autocast_dtype(plan)
    bf16, fp16 = autocast is torch.bfloat16, autocast is torch.float16
    compute = "bfloat16" if bf16 else "float16" if fp16 else LONG[plan.compute_dtype]
    prec = Precision(Device.of(plan.device), load, compute, bf16 or fp16, bf16, fp16)
    tokenizer = build_tokenizer()  # the measured batch is random ids: only the trainer's pad token matters
    data = Dataset.from_list(list(methods.get(plan.method).measure_rows))
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
    ENGINE_TRAINERS[model] = trainer
    return model


def _trl_qlora_preparation(model, plan: Plan) -> None:
    """SFTTrainer.__init__ (trl 1.16) for a quantized peft model, in place of prepare_model_for_kbit_training:
    input grads for checkpointed blocks, and every trainable parameter cast to bfloat16 (the QLoRA paper's
    recommendation; DoRA's magnitude vector excluded), so their grads and Adam states are bf16 too."""
    if plan.gradient_checkpointing:
        model.enable_input_require_grads()
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def build_optimizer(model, plan: Plan, options: StepOptions = StepOptions()):
    """The optimizer Trainer builds for `plan.optim` (its own name→class mapping); the engine's trainer's own
    for a model built through the engine."""
    from transformers import Trainer, TrainingArguments

    trainer = ENGINE_TRAINERS.get(model)
    if trainer is not None and options.foreach is None:
        return trainer.create_optimizer()

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=plan.optim, report_to=[], use_cpu=True)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if cls.__module__.startswith("torch.optim") and options.foreach is not None and "fused" not in kwargs:
        kwargs["foreach"] = options.foreach
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
