"""The run config's `distributed` section: how many processes train, how the work is spread over them, and the
accelerate config the engine launches them with (`<run>/accelerate.yaml`, written by `write_accelerate_config`).

    distributed:
      gpus: 2                  # a count of this machine's GPUs, or which ones: [0, 2] (nvidia-smi's numbers)
      strategy: auto           # auto (DDP when the plan fits one card, else FSDP) | ddp | fsdp | deepspeed_zero3
      fsdp_version: auto       # auto: FSDP2 for a 16-bit base, FSDP1 (the QLoRA recipe) for a 4-bit one
      cpu_offload: false       # fsdp / deepspeed_zero3: parameters, gradients and optimizer states in CPU RAM
      num_machines: 1          # several machines: the same config on each, with its own machine_rank
      machine_rank: 0
      main_process_ip: null    # the main machine's address (needed with num_machines > 1)
      main_process_port: null  # null: 29500 between machines; a free one on one machine

accelerate is the only engine (TRL, PEFT's docs, LLaMA-Factory's FSDP path and axolotl all launch through it);
the four configs and why 4-bit weights take FSDP1: docs/design/multi-gpu.md. The known-bad combinations are
refused here, each with its reason and its fix (`combination_problem`); what this machine lacks (`missing_here`:
the deepspeed package) only where the run is planned for it; "more GPUs than the box has" needs the machine, so
core.estimate.from_config checks it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import yaml

from core.files import atomic_write_text
from core.precision import Precision
from core.recipe.config_keys import STRATEGIES

ACCELERATE_FILE = (
    "accelerate.yaml"  # in the run directory: what the run is launched with (readable, reusable)
)
SHARDED = ("fsdp", "deepspeed_zero3")  # strategies that divide weights, gradients and optimizer states
FLOAT_STORAGE = ("bfloat16", "float16", "float32")


def gpus_per_machine(cfg: dict) -> int:
    gpus = cfg["distributed"]["gpus"]
    return len(gpus) if isinstance(gpus, list) else int(gpus)


def world_size(cfg: dict) -> int:
    """The number of training processes (one per GPU) over every machine."""
    return gpus_per_machine(cfg) * cfg["distributed"]["num_machines"]


def gpu_ids(cfg: dict) -> list[int] | None:
    """The GPUs the config names (`gpus: [1, 3]`), or None for a count (the first ones CUDA shows)."""
    gpus = cfg["distributed"]["gpus"]
    return list(gpus) if isinstance(gpus, list) else None


def pin_gpus(cfg: dict, one_process: bool, environ=None) -> str | None:
    """Make this process (and the processes it starts) train on the GPUs the config names, before CUDA starts.

    GPU ids are nvidia-smi's: CUDA's own default order puts the fastest card first, so the engine asks for PCI bus
    order (CUDA_DEVICE_ORDER=PCI_BUS_ID) unless the user chose an order. One process (a one-GPU run, or the smoke
    test of any run) trains on exactly one card, the first the config names: with several cards visible the
    Trainer would wrap it in nn.DataParallel (another batch, and memory the plan does not describe). The ranks of a
    run on several processes get theirs from accelerate (gpu_ids in accelerate.yaml), as any accelerate launch
    does. Returns the sentence the trainer prints when the config names a card, else None."""
    env = os.environ if environ is None else environ
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if not one_process:
        return None
    ids, before = gpu_ids(cfg), env.get("CUDA_VISIBLE_DEVICES")
    if ids is None:  # a count: the first card this process may see; an empty value hides them all (CPU)
        visible = [v.strip() for v in (before if before is not None else "0").split(",") if v.strip()]
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible[0]
        return None
    env["CUDA_VISIBLE_DEVICES"] = str(ids[0])
    instead = f", in place of CUDA_VISIBLE_DEVICES={before}" if before not in (None, str(ids[0])) else ""
    return f"GPU {ids[0]} (nvidia-smi's numbering: CUDA_VISIBLE_DEVICES={ids[0]}{instead})"


def fsdp_version(cfg: dict) -> int:
    """The FSDP version the engine uses: FSDP1 for a 4-bit base (bitsandbytes#1945: FSDP2 corrupts or replicates
    4-bit weights), FSDP2 otherwise, unless the config names one."""
    asked = cfg["distributed"]["fsdp_version"]
    if asked != "auto":
        return int(asked)
    return 1 if cfg["quantization"]["load_in_4bit"] else 2


def quant_storage(cfg: dict, compute: str) -> str | None:
    """bnb_4bit_quant_storage for a run on several processes: the compute dtype, so FSDP can flatten and shard the
    4-bit weights with the 16-bit ones (PEFT/Answer.AI FSDP-QLoRA recipe); harmless under DDP (same bytes). None:
    one process, or the config sets it (combination_problem checks that it is the compute dtype)."""
    q = cfg["quantization"]
    if world_size(cfg) == 1 or not q["load_in_4bit"] or q.get("bnb_4bit_quant_storage") is not None:
        return None
    return compute


def field_problem(path: str, value) -> str | None:
    """The checks of the section's own values that a type and a range cannot say."""
    if path == "distributed.gpus":
        if isinstance(value, int) and not isinstance(value, bool):
            return None if value >= 1 else "must be at least 1 (a count) or a list of GPU ids such as [0, 1]"
        ids = value if isinstance(value, list) else []
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            return "must be a count (2) or a non-empty list of GPU ids (nvidia-smi's numbers, from 0) such as [0, 2]"
        if len(set(ids)) != len(ids):
            return "lists a GPU twice: each id once, e.g. [0, 1]"
    if path == "distributed.fsdp_version" and value not in ("auto", 1, 2):
        return "must be auto, 1 or 2"
    if path == "distributed.main_process_ip" and isinstance(value, str) and not value.strip():
        return "must be the main machine's address (or null on one machine)"
    return None


def combination_problem(cfg: dict) -> tuple[str, str] | None:
    """(key path, one sentence with the reason and the fix) for a distributed setting that cannot work, or None."""
    d, q, t = cfg["distributed"], cfg["quantization"], cfg["training"]
    if d["machine_rank"] >= d["num_machines"]:
        return (
            "distributed.machine_rank",
            f"distributed.machine_rank {d['machine_rank']} is not below num_machines {d['num_machines']}: the "
            f"machines are ranked 0 to {d['num_machines'] - 1} (0: the main one).",
        )
    if d["num_machines"] > 1 and not d["main_process_ip"]:
        return (
            "distributed.main_process_ip",
            "distributed.main_process_ip is required with num_machines > 1: the address of machine_rank 0, which "
            "every machine can reach.",
        )
    if world_size(cfg) == 1:
        return None
    strategy = d["strategy"]
    if d["cpu_offload"] and strategy in ("ddp", "auto"):
        return (
            "distributed.cpu_offload",
            f"distributed.cpu_offload needs a sharding strategy: DDP keeps everything on every GPU (strategy "
            f"{strategy}); set strategy: fsdp or deepspeed_zero3.",
        )
    four_bit = q["load_in_4bit"]
    if four_bit and strategy in ("fsdp", "auto") and fsdp_version(cfg) == 2:
        return (
            "distributed.fsdp_version",
            "distributed.fsdp_version 2 cannot shard 4-bit weights: FSDP2 turns bitsandbytes' Params4bit into "
            "plain parameters (replicated, or their packed bytes altered: bitsandbytes#1945, accelerate#3983); "
            "set fsdp_version: 1 (or auto), the FSDP1 QLoRA recipe the engine writes (fsdp_use_orig_params: "
            "false, fsdp_cpu_ram_efficient_loading: true, bnb_4bit_quant_storage = the compute dtype).",
        )
    storage = q.get("bnb_4bit_quant_storage")
    if four_bit and strategy != "ddp" and storage is not None and str(storage) not in FLOAT_STORAGE:
        return (
            "quantization.bnb_4bit_quant_storage",
            f"quantization.bnb_4bit_quant_storage {storage} cannot be sharded: FSDP flattens the 4-bit weights "
            'with the 16-bit ones ("Cannot flatten integer dtype tensors"); drop the key (the engine then '
            "stores them in the compute dtype) or set it to the compute dtype, e.g. bfloat16.",
        )
    kwargs = t.get("activation_checkpointing_kwargs") or t.get("gradient_checkpointing_kwargs") or {}
    on = t.get("activation_checkpointing", t.get("gradient_checkpointing"))
    if on and isinstance(kwargs, dict) and kwargs.get("use_reentrant") and strategy in ("ddp", "auto"):
        return (
            "training.gradient_checkpointing_kwargs",
            'training.gradient_checkpointing_kwargs use_reentrant: true breaks DDP ("Expected to mark a variable '
            'ready only once", trl#921)'
            + (" and strategy auto picks DDP when the plan fits one card" if strategy == "auto" else "")
            + ": set use_reentrant: false (the engine's default) or strategy: fsdp.",
        )
    return None


def missing_here(cfg: dict) -> tuple[str, str] | None:
    """What this machine lacks for the section (valid elsewhere: the Estimate page plans any machine)."""
    d = cfg["distributed"]
    if (
        world_size(cfg) > 1
        and d["strategy"] == "deepspeed_zero3"
        and importlib.util.find_spec("deepspeed") is None
    ):
        return (
            "distributed.strategy",
            "distributed.strategy deepspeed_zero3 needs the deepspeed package (pip install deepspeed) on every "
            "machine; or use strategy: fsdp (no extra package).",
        )
    return None


def accelerate_config(cfg: dict, strategy: str, prec: Precision) -> dict:
    """The accelerate config (what `accelerate config` would write) for a validated run config, `strategy`
    resolved (ddp | fsdp | deepspeed_zero3: core.estimate.from_config.resolve_strategy decides auto), and the
    run's precision (the Trainer's bf16/fp16 flag is accelerate's mixed_precision)."""
    if strategy not in STRATEGIES or strategy == "auto":
        raise ValueError(f"strategy {strategy!r}: resolve auto first (one of ddp, fsdp, deepspeed_zero3)")
    d = cfg["distributed"]
    out: dict = {"compute_environment": "LOCAL_MACHINE"}
    offload = bool(d["cpu_offload"])
    if strategy == "ddp":
        out["distributed_type"] = "MULTI_GPU"
    elif strategy == "fsdp":
        out["distributed_type"] = "FSDP"
        version = fsdp_version(cfg)
        fsdp = {"fsdp_version": version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
        if version == 1:
            # the PEFT / Answer.AI FSDP-QLoRA recipe (peft docs/source/accelerate/fsdp.md)
            fsdp.update(
                fsdp_sharding_strategy="FULL_SHARD",
                fsdp_backward_prefetch="BACKWARD_PRE",
                fsdp_forward_prefetch=False,
                fsdp_cpu_ram_efficient_loading=True,
                fsdp_sync_module_states=True,
                fsdp_use_orig_params=False,
            )
        else:
            fsdp.update(fsdp_reshard_after_forward=True, fsdp_cpu_ram_efficient_loading=True)
        fsdp.update(fsdp_offload_params=offload, fsdp_state_dict_type="SHARDED_STATE_DICT")
        out["fsdp_config"] = fsdp
    else:
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {
            "zero_stage": 3,
            "zero3_init_flag": True,
            "zero3_save_16bit_model": True,
            "offload_optimizer_device": "cpu" if offload else "none",
            "offload_param_device": "cpu" if offload else "none",
        }
    gpus = d["gpus"]
    out.update(
        mixed_precision="bf16" if prec.bf16 else "fp16" if prec.fp16 else "no",
        num_machines=d["num_machines"],
        num_processes=world_size(cfg),
        machine_rank=d["machine_rank"],
        gpu_ids=",".join(str(i) for i in gpus) if isinstance(gpus, list) else "all",
        rdzv_backend="static",
        same_network=True,
        use_cpu=False,
    )
    if d["main_process_ip"]:
        out["main_process_ip"] = d["main_process_ip"]
    if d["main_process_port"] is not None:
        out["main_process_port"] = d["main_process_port"]
    return out


def write_accelerate_config(cfg: dict, run_dir: str | os.PathLike, strategy: str, prec: Precision) -> Path:
    """`<run_dir>/accelerate.yaml` for `accelerate launch --config_file` (atomic: never half a file)."""
    text = yaml.safe_dump(accelerate_config(cfg, strategy, prec), sort_keys=False, default_flow_style=False)
    return atomic_write_text(Path(run_dir) / ACCELERATE_FILE, text)
