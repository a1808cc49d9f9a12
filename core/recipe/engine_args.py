"""A validated run config turned into the libraries' own objects: BitsAndBytesConfig, LoraConfig, and the
method's TRL config (SFTConfig, DPOConfig, KTOConfig: core.recipe.methods).

The user's keys pass through unchanged; the engine adds only what it owns (the run directory, logging that the
UI reads, NaN visibility, the device and precision it resolved).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from core import rundir
from core.files import read_json_object
from core.precision import CUDA_ONLY, Precision, torch_dtype
from core.recipe import distributed, methods, peft_targets, trackers, vision
from core.recipe.config_keys import OWN_TRAINING

# Library defaults the engine fills in where the run config leaves them unset
LORA_ENGINE = {"task_type": "CAUSAL_LM"}


def bnb_config(cfg: dict, load_dtype: str | None = None):
    """BitsAndBytesConfig for QLoRA, or None. bnb_4bit_compute_dtype "auto" = the dtype the weights load in."""
    q = dict(cfg["quantization"])
    if not q.get("load_in_4bit"):
        return None
    from transformers import BitsAndBytesConfig

    compute = q.get("bnb_4bit_compute_dtype", "auto")
    if compute == "auto":
        compute = load_dtype or (cfg["model"]["dtype"] if cfg["model"]["dtype"] != "auto" else "bfloat16")
    q["bnb_4bit_compute_dtype"] = torch_dtype(compute)
    # several processes: the 4-bit weights stored in the compute dtype, so FSDP can shard them (derived, not a key)
    q["bnb_4bit_quant_storage"] = distributed.quant_storage(cfg, compute) or q.get("bnb_4bit_quant_storage")
    if q["bnb_4bit_quant_storage"] is None:
        q.pop("bnb_4bit_quant_storage")
    if isinstance(q.get("bnb_4bit_quant_storage"), str):
        q["bnb_4bit_quant_storage"] = torch_dtype(q["bnb_4bit_quant_storage"])
    return BitsAndBytesConfig(**q)


def model_kwargs(cfg: dict, path: str) -> dict:
    """from_pretrained's attention and (MXFP4 checkpoints) quantization arguments. sdpa is asked as transformers'
    default (None): sdpa where the model has it, eager where it does not (gpt-oss: attention sinks). gpt-oss
    ships its experts in MXFP4, which transformers keeps only for inference (with Triton and the kernels package
    on a GPU; its quantizer is not trainable): a run loads them dequantized to bf16, on any machine."""
    attn = cfg["model"]["attn_implementation"]
    kwargs = {"attn_implementation": None if attn == "sdpa" else attn}
    config = read_json_object(Path(path) / "config.json") if Path(path).is_dir() else None
    quant = (config or {}).get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4":
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return kwargs


def lora_dropout_problem(cfg: dict, model_config) -> str | None:
    """One sentence when the lora section asks for dropout on LoRA that wraps parameters -- a mixture-of-experts
    model's experts, asked by lora.target_parameters or added by peft 0.21 itself when target_modules names the
    experts' old Linear names ("all-linear" among them) on the Qwen-MoE and Mixtral families: peft's ParamWrapper
    refuses any dropout, and would say so only after the model has loaded."""
    lora = cfg["lora"]
    if not lora["enabled"] or not lora.get("lora_dropout"):
        return None
    asked = bool(lora.get("target_parameters"))
    if not (asked or _peft_adds_experts(lora.get("target_modules"), model_config)):
        return None
    why = "" if asked else f", which target_modules brings in for {model_config.model_type}"
    return (
        f"lora.lora_dropout must be 0 for this model: LoRA on its experts (peft's target_parameters{why}) cannot "
        "apply dropout; set lora.lora_dropout: 0, or leave the experts out with explicit target_modules such as "
        "[q_proj, k_proj, v_proj, o_proj]."
    )


def _peft_adds_experts(targets, model_config) -> bool:
    """Does peft's transformers-5 conversion turn these target_modules into expert parameters for this model?"""
    try:
        from peft.utils.transformers_weight_conversion import (
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_TARGET_MODULE_MAPPING,
        )
    except ImportError:  # another peft: it converts nothing, or says so itself
        return False
    mapping = _MOE_TARGET_MODULE_MAPPING.get(
        _MODEL_TO_CONVERSION_PATTERN.get(getattr(model_config, "model_type", ""))
    )
    if not mapping or not targets:
        return False
    names = [targets] if isinstance(targets, str) else list(targets)
    experts = [old for old, new in mapping.items() if new != "gate.weight"]
    return any(t == "all-linear" or t.rsplit(".", 1)[-1] in experts for t in names)


def lora_config(cfg: dict, vision_model: bool = False, model=None):
    """peft.LoraConfig from the lora section, or None for a full fine-tune. vision_model: a VLM, whose vision tower
    and projector LoRA leaves frozen unless model.freeze_vision is false (core.recipe.vision.lora_targets). With
    the loaded `model`, all-linear becomes the Linear layers peft can train on it (core.recipe.peft_targets: the
    planner's rule)."""
    lora = {k: v for k, v in cfg["lora"].items() if k != "enabled"}
    if not cfg["lora"]["enabled"]:
        return None
    from peft import LoraConfig

    lora = {**LORA_ENGINE, **lora}
    if model is not None and lora.get("target_modules") == "all-linear":
        lora["target_modules"] = peft_targets.all_linear(model)[0]
    freeze = cfg["model"].get("freeze_vision", True)
    return LoraConfig(**(vision.lora_targets(lora, freeze) if vision_model else lora))


def _best_checkpoint_args(t: dict, given: dict, method) -> None:
    """Early stopping keeps the best checkpoint and makes it the adapter (load_best_model_at_end): a checkpoint at
    every evaluation, judged by the method's eval metric, unless the config says otherwise."""
    metric, greater = method.best_metric
    t.setdefault("load_best_model_at_end", True)
    t.setdefault("metric_for_best_model", metric)
    t.setdefault("greater_is_better", greater)
    if "save_strategy" not in given:
        t["save_strategy"] = t["eval_strategy"]
    if t.get("save_strategy", "steps") == "steps" and t.get("eval_strategy") == "steps":
        t["save_steps"] = t["eval_steps"]  # the best evaluation's weights must be on disk to be kept


def training_args(
    cfg: dict,
    run_dir: str | os.PathLike | None = None,
    prec: Precision | None = None,
    smoke: bool = False,
    has_eval: bool = False,
    report_to: str | list | None = None,
):
    """The method's TRL config (trl.SFTConfig, DPOConfig, KTOConfig): every key of the training section as given,
    plus what the engine owns.

    `prec` is the run's core.precision.Precision (bf16/fp16 resolved for the device); without it (checking a
    config) "auto" counts as off. A smoke test is one optimizer step at the method's smallest batch size, no
    saving.
    """
    method = methods.get(cfg)
    args_class = method.config_class()

    own = {**OWN_TRAINING, **method.own_training}
    t = {k: v for k, v in cfg["training"].items() if k not in own}  # the cockpit's own keys
    if prec is not None:
        t["bf16"], t["fp16"] = prec.bf16, prec.fp16
    else:
        t["bf16"], t["fp16"] = t.get("bf16") not in ("auto", False, None), bool(t.get("fp16"))
    if t.get("eval_steps") is None:
        t["eval_steps"] = t.get("logging_steps")
    if "eval_strategy" not in cfg["training"]:
        t["eval_strategy"] = "steps" if has_eval else "no"
    elif not has_eval and t["eval_strategy"] != "no":
        t["eval_strategy"] = "no"  # no held-out rows (data.eval_split 0): nothing to evaluate
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns); TRL reads
    # either, since the old one mirrors the new one after __post_init__.
    new_name = "activation_checkpointing" in args_class.__dataclass_fields__
    on = t.pop("activation_checkpointing", None)
    on = t.pop("gradient_checkpointing", False) if on is None else on
    kwargs = t.pop("activation_checkpointing_kwargs", None) or t.pop("gradient_checkpointing_kwargs", None)
    t.pop("gradient_checkpointing_kwargs", None)
    if on:
        kwargs = dict(kwargs or {})
        kwargs.setdefault("use_reentrant", False)  # the planner models non-reentrant checkpointing
    prefix = "activation" if new_name else "gradient"
    t[f"{prefix}_checkpointing"], t[f"{prefix}_checkpointing_kwargs"] = bool(on), kwargs
    if cfg["training"].get("early_stopping_patience") and has_eval and not smoke:
        _best_checkpoint_args(t, cfg["training"], method)
    if report_to is not None and "report_to" not in cfg["training"]:
        t["report_to"] = report_to
    t.setdefault("report_to", "none")
    if run_dir is not None and "project" in args_class.__dataclass_fields__:
        t.setdefault("project", trackers.project(run_dir))  # Trackio's database is named after the run
    if distributed.world_size(cfg) > 1:
        # every trainable weight (LoRA's, or the model's) takes part in each forward: DDP's search for unused
        # ones is an extra pass over the graph per step, and with checkpointing it is what breaks (trl#921)
        t.setdefault("ddp_find_unused_parameters", False)
    if prec is not None and prec.on_cpu:
        for key in CUDA_ONLY:
            if t.get(key):
                t[key] = False
    if t.get("padding_free") and not t.get("packing") and method.traits.flat_batches:
        # TRL enforces no max_length for padding-free rows without packing: the engine truncates them itself
        # (core.recipe.data) to training.max_length.
        t["max_length"] = None
    if smoke:
        if "packing" in args_class.__dataclass_fields__:
            # one full row at batch size 1 is the same tensor padded or not; SmokeCollator fills it to max_length
            # (TRL takes no custom collator with padding-free batches)
            t.update(padding_free=False, packing=False, max_length=cfg["training"]["max_length"])
        if "max_completion_length" in args_class.__dataclass_fields__:
            # GRPO: every completion as long as the run allows (min_new_tokens), so the step is the longest one
            t["generation_kwargs"] = {
                **(t.get("generation_kwargs") or {}),
                "min_new_tokens": t.get("max_completion_length", 256),
            }
            t.update(generation_batch_size=None, steps_per_generation=None, num_iterations=1)
        t.update(
            per_device_train_batch_size=method.smoke_batch(cfg),
            per_device_eval_batch_size=method.smoke_eval_batch(cfg),
            gradient_accumulation_steps=1,
            max_steps=1,
            logging_steps=1,
            # held-out rows: one evaluation after the step (one batch of them: core.train.smoke), measured too
            eval_strategy="no" if t["eval_strategy"] == "no" else "steps",
            eval_steps=1,
            save_strategy="no",
            report_to="none",
            load_best_model_at_end=False,
        )
    out = (
        Path(run_dir) / rundir.CHECKPOINTS
        if run_dir is not None
        else Path(tempfile.gettempdir()) / "lc-check"
    )
    return args_class(
        output_dir=str(out),
        disable_tqdm=True,  # progress bars would bury the stderr tail shown when a run fails
        logging_nan_inf_filter=False,  # the default hides NaN losses; the engine must see them to stop
        remove_unused_columns=False,
        use_cpu=prec is not None and prec.on_cpu,
        **t,
    )
