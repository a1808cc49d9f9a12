"""The model and its trainer as a run builds them: the device and precision, the base model, the method's TRL
trainer, the final adapter saved. Used by the run (core.train.steps), core.measure and core.eval."""

from __future__ import annotations

import os
from pathlib import Path

from core import rundir
from core.precision import Device, Precision, PrecisionError, resolve, torch_dtype
from core.recipe import methods, vision
from core.recipe.engine_args import bnb_config, lora_config, model_kwargs, training_args
from core.train import ranks
from core.train.state import TrainError


def choose_precision(cfg: dict) -> Precision:
    """The run's device and precision on this machine (core.precision, the resolver the planner uses too)."""
    try:
        return resolve(cfg, Device.local())
    except PrecisionError as exc:
        raise TrainError(str(exc)) from None


def quiet_progress_bars():
    """Progress bars would bury the stderr tail the launcher shows when a run fails."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def load_model(cfg: dict, prec: Precision, path: str | None = None):
    """The base model as the run trains it: in the load dtype, 4-bit when asked (quantized where it lands), KV cache
    off. LoRA, the QLoRA preparation and the fused LM head are SFTTrainer's (make_trainer), so that the planner,
    the tracker and a run all see one model-building path."""
    import torch
    from transformers import AutoModelForCausalLM

    m = cfg["model"]
    kwargs = {
        "dtype": torch_dtype(prec.dtype),
        **model_kwargs(cfg, path or m["path"]),
        "trust_remote_code": m["trust_remote_code"],
    }
    quant = bnb_config(cfg, prec.dtype)
    vision.quantization(quant, path or m["path"])
    if quant is not None:
        kwargs["quantization_config"] = quant
        # 4-bit weights are quantized where they land: on the GPU choose_precision named (torch's current one)
        kwargs["device_map"] = {"": "cpu"} if prec.on_cpu else {"": torch.cuda.current_device()}
    auto = vision.model_class() if vision.folder_is_vlm(path or m["path"]) else AutoModelForCausalLM
    model = auto.from_pretrained(path or m["path"], **kwargs)
    model.config.use_cache = False  # the KV cache only costs memory in training
    return model


def make_trainer(
    cfg: dict,
    prec: Precision,
    model,
    tokenizer,
    train_ds,
    eval_ds=None,
    run_dir=None,
    smoke=False,
    collator=None,
    callbacks=(),
    report_to=None,
):
    """The run's trainer, its method's (SFTTrainer, DPOTrainer, KTOTrainer): LoRA (peft_config) or full, TRL's
    QLoRA handling (no fp32 upcast; adapters in bf16), its fused LM head, every training key of the config as the
    method's TRL config. A preference method's reference is the base with the adapter disabled (no second copy), a
    copy of the model for a full fine-tune (TRL's default), or model.reference_path. eval_ds: the held-out rows,
    or {source: its held-out rows} (core.train.eval_sources). Used by core.train and core.measure."""

    args = training_args(cfg, run_dir, prec, smoke=smoke, has_eval=eval_ds is not None, report_to=report_to)
    _fit_for_trl_fused_head(model)
    kwargs = dict(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        peft_config=lora_config(cfg, vision_model=vision.is_processor(tokenizer), model=model),
        callbacks=list(callbacks),
    )
    if collator is not None:  # GRPOTrainer batches its own generations and takes no collator
        kwargs["data_collator"] = collator
    method = methods.get(cfg)
    kwargs.update(method.trainer_kwargs(cfg, lambda path: load_model(cfg, prec, path=path), train_ds))
    if (
        vision.is_processor(tokenizer)
        and not cfg["lora"]["enabled"]
        and cfg["model"].get("freeze_vision", True)
    ):
        vision.freeze_tower(model)  # a full fine-tune of a VLM trains its language model, as LoRA does
    trainer_class = method.trainer_class()
    if isinstance(eval_ds, dict):  # a mix's held-out rows by source: one evaluation, a loss per source
        from core.train.eval_sources import each_source

        trainer_class = each_source(trainer_class)
    trainer = trainer_class(**kwargs)
    _fp32_trainable(trainer.model, prec)
    return trainer


def _fit_for_trl_fused_head(model) -> None:
    """What TRL's fused LM head (trl 1.16 trainer/utils.py add_fused_lm_head) reads, named as it reads it:
    - the load-balancing loss takes text_config.num_experts; Granite 4.0-H's config names it num_local_experts;
    - the backbone is `model.base_model` (getattr(model, base_model_prefix)); Llama4ForCausalLM's prefix is
      "language_model" but it holds its backbone as `model`, so TRL ran the whole model and failed on its output;
    - a dense Granite 4.0-H (num_local_experts 0) keeps a router_aux_loss_coef: no experts, no such loss.
    Without these the first step ends in an AttributeError."""
    text = model.config.get_text_config()
    # SFTTrainer turns output_router_logits on itself when the config has a router_aux_loss_coef
    if getattr(text, "router_aux_loss_coef", 0) and getattr(text, "num_experts", None) is None:
        experts = getattr(text, "num_local_experts", None)
        if experts:
            text.num_experts = experts
        elif experts == 0:
            text.router_aux_loss_coef = 0.0
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix) and hasattr(model, "model"):
        model.base_model_prefix = "model"  # this instance only: what base_model returns


def _fp32_trainable(model, prec: Precision):
    """fp16 mixed precision (CUDA only) needs float32 trainable weights: torch's GradScaler refuses float16
    gradients ("Attempting to unscale FP16 gradients"). peft makes the LoRA weights float32 already; trainable
    biases (lora.bias) and full fine-tuning on float16 weights would hit that at the first step."""
    if prec.fp16:
        import torch

        for p in model.parameters():
            if p.requires_grad and p.dtype == torch.float16:
                p.data = p.data.float()
    return model


def refuse_several_cards(prec: Precision) -> None:
    """A run on one process trains on one card. One that sees several (CUDA started in this process before
    run_training could pin its card: distributed.pin_gpus) is refused: the Trainer would wrap it in nn.DataParallel
    over all of them, with another batch and memory the plan does not describe."""
    if ranks.spec() is not None or prec.device.kind != "cuda":
        return
    import torch

    if torch.cuda.device_count() > 1:
        raise TrainError(
            f"this process sees {torch.cuda.device_count()} CUDA GPUs and would spread one process over all of "
            "them (nn.DataParallel): CUDA started before the run could pick its card; start it with "
            "CUDA_VISIBLE_DEVICES set to one GPU, or set distributed.gpus to train on several."
        )


def save_final(trainer, tokenizer, run_dir: Path, cfg: dict) -> Path:
    """The adapter (peft format) + tokenizer into DIR/adapter, written to a temp folder then renamed."""
    import shutil

    name = rundir.ADAPTER if cfg["lora"]["enabled"] else rundir.MODEL
    final, tmp = run_dir / name, run_dir / f".{name}.tmp"
    if ranks.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    if ranks.world() > 1:
        # every rank takes part (FSDP gathers the shards); the Trainer writes on rank 0 alone
        trainer.save_model(str(tmp))
        if not ranks.is_main():
            return final
        (tmp / "training_args.bin").unlink(missing_ok=True)  # a pickle, and no part of an adapter
    else:
        trainer.model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if cfg["lora"]["enabled"]:
        from core.merge.fingerprint import record_base  # the merge engine imports torch: not at module level

        record_base(tmp, cfg["model"]["path"])  # the base weights it was trained on, checked when merged
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
