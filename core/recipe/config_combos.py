"""Combinations of a run config's keys that cannot run together though each value is valid on its own (bf16 with
fp16, a data format of another method, GRPO's generation batch that does not divide by its group size...), and what
this machine lacks for a config valid elsewhere (vLLM, liger-kernel, a tracker's package). Each problem is
(key path, one sentence saying how to fix it); core.recipe.config.field_errors reports it on that key.
"""

from __future__ import annotations

import importlib.util

from core import machine
from core.recipe import distributed, methods, mix_config, trackers
from core.recipe import rewards as reward_specs


def combination_problem(cfg: dict) -> tuple[str, str] | None:
    if cfg["model"]["path"] is None:
        return "model.path", "model.path is required: the folder of a local model or a hub id."
    problem = mix_config.config_problem(cfg, methods.get(cfg))
    if problem:
        return problem
    if cfg["data"]["path"] is None and not mix_config.sources(cfg["data"]):
        return (
            "data.path",
            "data.path is required: a .jsonl/.json/.csv/.parquet file, a save_to_disk folder or a Hub dataset id.",
        )
    t, q = cfg["training"], cfg["quantization"]
    if t.get("bf16") is True and t.get("fp16"):
        return (
            "training.bf16",
            "training.bf16 and training.fp16 are both true: choose one (bf16 on recent GPUs).",
        )
    method, fmt = methods.get(cfg), cfg["data"]["format"]
    if fmt != "auto" and fmt not in method.formats:
        owners = [m.name for m in methods.REGISTRY.values() if fmt in m.formats]
        return (
            "data.format",
            f"data.format {fmt} is not a format of method {method.name} ({method.summary}): use "
            f"{', '.join(('auto', *method.formats))}"
            + (f", or set method: {owners[0]} for {fmt} data." if owners else "."),
        )
    if cfg["model"].get("reference_path") and not method.traits.reference:
        return (
            "model.reference_path",
            f"model.reference_path is the reference model of a preference run (DPO, KTO); method {method.name} "
            "has none: drop it or change the method.",
        )
    if method.smoke_batch_size > 1 and t["per_device_train_batch_size"] < method.smoke_batch_size:
        return (
            "training.per_device_train_batch_size",
            f"training.per_device_train_batch_size must be at least {method.smoke_batch_size} for method "
            f"{method.name}: {method.trainer_name} estimates its KL term from the other rows of a batch.",
        )
    if method.name == "grpo":
        problem = grpo_problem(cfg)
        if problem:
            return problem
    if t.get("early_stopping_patience") and (
        cfg["data"]["eval_split"] <= 0 or t.get("eval_strategy") == "no"
    ):
        return (
            "training.early_stopping_patience",
            "training.early_stopping_patience needs evaluations to judge by: set data.eval_split (e.g. 0.05) and "
            "leave training.eval_strategy at steps or epoch.",
        )
    if q.get("load_in_4bit") and not cfg["lora"]["enabled"]:
        return (
            "quantization.load_in_4bit",
            "quantization.load_in_4bit needs lora.enabled: true (4-bit weights cannot be trained directly).",
        )
    # padding_free without packing: the engine truncates rows to max_length itself (TRL would refuse the pair).
    return distributed.combination_problem(cfg)


def grpo_problem(cfg: dict) -> tuple[str, str] | None:
    """What trl.GRPOConfig would refuse with a traceback, said in the run config's words."""
    t = cfg["training"]
    g = t.get("num_generations", 8)
    if not isinstance(g, int) or g < 2:
        return (
            "training.num_generations",
            f"training.num_generations must be at least 2 (got {g!r}): GRPO compares each completion with the "
            "others of its prompt's group.",
        )
    weights = t.get("reward_weights")
    if weights is not None and len(weights) != len(cfg["rewards"]):
        return (
            "training.reward_weights",
            f"training.reward_weights has {len(weights)} weights for {len(cfg['rewards'])} reward functions "
            f"({', '.join(reward_specs.names(cfg['rewards']))}): give one weight per reward, in the same order.",
        )
    if t.get("generation_batch_size") is not None and t.get("steps_per_generation") is not None:
        return (
            "training.steps_per_generation",
            "training.generation_batch_size and training.steps_per_generation both set: TRL takes one of them.",
        )
    batch = t["per_device_train_batch_size"] * distributed.world_size(cfg)
    if t.get("generation_batch_size") is not None:
        generation = t["generation_batch_size"]
        if generation % batch:
            return (
                "training.generation_batch_size",
                f"training.generation_batch_size {generation} must be a multiple of the global batch size {batch} "
                "(per_device_train_batch_size x GPUs).",
            )
    else:
        steps = t.get("steps_per_generation") or t["gradient_accumulation_steps"]
        generation = batch * steps
    if generation % g:
        options = [b for b in range(g, 4 * g + 1, g)]
        return (
            "training.num_generations",
            f"The generation batch ({generation} completions: per_device_train_batch_size "
            f"{t['per_device_train_batch_size']} x {distributed.world_size(cfg)} GPU(s) x "
            f"{t.get('steps_per_generation') or t['gradient_accumulation_steps']} steps per generation) must divide "
            f"by training.num_generations {g}: set per_device_train_batch_size to a multiple of {g} (e.g. "
            f"{', '.join(map(str, options[:3]))}) or num_generations to a divisor of {generation}.",
        )
    return None


def missing_here(cfg: dict) -> tuple[str, str] | None:
    """What this machine lacks for the config (a setting valid elsewhere)."""
    if cfg["training"].get("use_vllm"):
        problem = vllm_problem()
        if problem:
            return "training.use_vllm", problem
    if cfg["training"].get("use_liger_kernel") and not machine.importable(machine.KERNELS["liger-kernel"]):
        return (
            "training.use_liger_kernel",
            "training.use_liger_kernel needs the liger-kernel package and a CUDA GPU (pip install liger-kernel); "
            "set it to false on this machine.",
        )
    problem = trackers.missing(cfg["training"].get("report_to"))
    if problem:
        return "training.report_to", problem
    return distributed.missing_here(cfg)


def vllm_problem() -> str | None:
    """Why GRPO cannot generate with vLLM on this machine, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "training.use_vllm needs the vllm package (pip install vllm, on a machine with a CUDA GPU); set it to "
            "false to generate with transformers."
        )
    import torch

    if not torch.cuda.is_available():
        return (
            "training.use_vllm needs a CUDA GPU (vLLM does not run on this machine's CPU); set it to false."
        )
    return None
