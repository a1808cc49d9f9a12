"""Resuming a run: which checkpoint, and with which config.

A checkpoint (TRL/transformers Trainer, <run>/checkpoints/checkpoint-N) holds the adapter's weights (their names
and shapes follow the base model, `lora.*` and `quantization.*`), the optimizer's state (its layout follows
`training.optim`), the scheduler's step and the RNG state, and — written by the trainer beside them —
`run_config.yaml`, the config that trained it. A resume continues from those bytes, so it refuses a config that
changes what they mean (CANNOT_RESUME) and records every other change: the config that trained up to step N goes
to `config.history/until-step-N.yaml`, `config.yaml` becomes the config that trains from here.

Reads only, except record_config (called by the trainer once it owns the run directory); keep_new_hyperparameters
makes a resumed trainer take the config's new learning rate and schedule.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from core import checkpoints, rundir
from core.files import atomic_write_text
from core.recipe import distributed
from core.recipe.config import ConfigError, config_to_yaml, load_config

# What a checkpoint's bytes depend on: the base the adapter adapts (its weights for a full fine-tune), the adapter's
# modules, shapes and scaling, the quantized base it was trained against, the trainer (method) whose state it is,
# and the optimizer whose moments it holds.
CANNOT_RESUME = (
    ("method", "the checkpoint is a {old} trainer's state"),
    ("model.path", "the checkpoint's weights belong to that base model"),
    ("quantization.", "the adapter was trained against that (quantized) base"),
    ("lora.enabled", "the checkpoint holds an adapter (lora.enabled: true) or a whole model (false)"),
    ("lora.", "the checkpoint's adapter weights have that shape, modules and scaling"),
    ("training.optim", "the checkpoint's optimizer state is that optimizer's"),
)
RESUMABLE_LORA = ("lora.lora_dropout",)  # dropout holds no weights


def flatten(cfg: dict) -> dict[str, Any]:
    """{"method": "sft", "model.path": ..., "lora.r": 8, ...}: one entry per key of a validated config."""
    out: dict[str, Any] = {}
    for section, value in cfg.items():
        if isinstance(value, dict):
            out.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            out[section] = value
    return out


def changed_keys(old: dict, new: dict) -> list[str]:
    a, b = flatten(old), flatten(new)
    return [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def _why_fixed(key: str) -> str | None:
    if key in RESUMABLE_LORA:
        return None
    for prefix, why in CANNOT_RESUME:
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)) or key.startswith(prefix + "_"):
            return why
    return None


def resume_conflict(old: dict, new: dict, checkpoint: Path) -> str | None:
    """One sentence naming the first changed key a resume from `checkpoint` cannot take, or None."""
    was, now = distributed.world_size(old), distributed.world_size(new)
    if was != now:
        # sharded optimizer states and per-rank RNG files belong to that many processes, and the effective batch
        # (per device x accumulation x processes) would change under the schedule
        return (
            f"--resume: {checkpoint.name} was trained by {was} process{'es' if was > 1 else ''} and this config "
            f"starts {now} (distributed.gpus x num_machines): resume with the same number (distributed.gpus: "
            f"{old['distributed']['gpus']}, num_machines: {old['distributed']['num_machines']}), or train the "
            "new config as a new run (another --run-dir)."
        )
    a, b = flatten(old), flatten(new)
    for key in changed_keys(old, new):
        why = _why_fixed(key)
        if why:
            return (
                f"--resume: {key} changed from {_short(a.get(key))} to {_short(b.get(key))} since "
                f"{checkpoint.name} was saved, and {why.format(old=a.get(key))}: resume with "
                f"{key}: {_short(a.get(key))}, or train the new config as a new run (another --run-dir)."
            )
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def trained_config(run_dir: Path, checkpoint: Path | None, config_path: str | os.PathLike) -> dict | None:
    """The config the checkpoint was trained with: its run_config.yaml, else (a checkpoint from before the trainer
    wrote one) the run's config.yaml when the resume was given another file. None when it cannot be told."""
    candidates = []
    if checkpoint is not None:
        candidates.append(checkpoint / checkpoints.CHECKPOINT_CONFIG)
    recorded = run_dir / rundir.CONFIG
    if Path(config_path).resolve() != recorded.resolve():
        candidates.append(recorded)
    for path in candidates:
        if path.is_file():
            try:
                return load_config(path)
            except ConfigError:
                continue  # written by another version: not a reference
    return None


def choose_checkpoint(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint that can be resumed from, [(newer unusable checkpoint, why)]). Reads only; the
    resume's candidate is checked through (every archive's checksum)."""
    bad: list[tuple[Path, str]] = []
    for path in checkpoints.checkpoints(run_dir):
        why = checkpoints.checkpoint_problem(path, deep=True)
        if why is None:
            return path, bad
        bad.append((path, why))
    return None, bad


def check_resume(
    run_dir: Path, cfg: dict, config_path: str | os.PathLike
) -> tuple[Path | None, list, dict | None]:
    """(checkpoint, unusable newer checkpoints, the config the checkpoint was trained with), or RunRefused (one
    sentence, nothing touched): every checkpoint is unusable, or the config changes what the checkpoint holds."""
    checkpoint, bad = choose_checkpoint(run_dir)
    if checkpoint is None and bad:
        named = "; ".join(f"{p.name}: {why}" for p, why in bad[:3])
        raise rundir.RunRefused(
            f"--resume: no checkpoint of {run_dir.name} can be resumed from ({named}): start a new run."
        )
    old = trained_config(run_dir, checkpoint, config_path) if checkpoint is not None else None
    if old is not None:
        problem = resume_conflict(old, cfg, checkpoint)
        if problem:
            raise rundir.RunRefused(problem)
    return checkpoint, bad, old


def record_config(run_dir: Path, cfg: dict, trained: dict | None, checkpoint: Path | None) -> list[str]:
    """Make config.yaml say what trains from here; a changed config of a resume first keeps the one that trained
    up to the checkpoint in config.history/until-step-N.yaml. Both written atomically. Returns the changed keys."""
    current = run_dir / rundir.CONFIG
    text = config_to_yaml(cfg)
    changed: list[str] = []
    if trained is not None and checkpoint is not None:
        changed = changed_keys(trained, cfg)
        if changed:
            step = checkpoints.checkpoint_step(checkpoint)
            a, b = flatten(trained), flatten(cfg)
            header = [
                f"# The config that trained steps 1-{step} of this run; resumed from {checkpoint.name} on "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')} with:",
                *(f"#   {k}: {_short(a.get(k))} -> {_short(b.get(k))}" for k in changed),
            ]
            history = run_dir / checkpoints.CONFIG_HISTORY / f"until-step-{step}.yaml"
            atomic_write_text(history, "\n".join(header) + "\n" + config_to_yaml(trained))
    try:
        same = current.is_file() and load_config(current) == cfg
    except ConfigError:
        same = False
    if not same:
        atomic_write_text(current, text)
    return changed


def keep_new_hyperparameters(trainer) -> None:
    """A resume with a changed learning rate (or weight decay, betas, schedule length) trains with the new values.

    torch's Optimizer.load_state_dict brings back the checkpoint's param-group hyperparameters along with the
    moments, and the scheduler its base learning rates: without this, a resumed run with a new learning_rate
    trains on at the old one while config.yaml says the new. The moments and the step count are the checkpoint's;
    the hyperparameters this config's (create_optimizer / create_scheduler are the Trainer's overridable API)."""
    from torch.optim.lr_scheduler import LambdaLR

    create_optimizer, create_scheduler = trainer.create_optimizer, trainer.create_scheduler

    def take_new_groups(optimizer, state_dict):
        saved = state_dict["param_groups"]
        if len(saved) != len(optimizer.param_groups):
            return None  # not this optimizer's state: torch says so
        groups = [
            {**{k: v for k, v in new.items() if k != "params"}, "params": old["params"]}
            for old, new in zip(saved, optimizer.param_groups, strict=True)
        ]
        return {**state_dict, "param_groups": groups}

    def new_create_optimizer(*args, **kwargs):
        optimizer = create_optimizer(*args, **kwargs)
        optimizer.register_load_state_dict_pre_hook(take_new_groups)
        return optimizer

    def new_create_scheduler(*args, **kwargs):
        scheduler = create_scheduler(*args, **kwargs)
        load = scheduler.load_state_dict
        if not isinstance(scheduler, LambdaLR):
            return scheduler

        def load_state_dict(state):
            # once: the scheduler's own method again, and nothing unpicklable left in the state it saves
            del scheduler.load_state_dict
            load(state)  # the step count; then this config's learning rates at that step
            groups = scheduler.optimizer.param_groups
            scheduler.base_lrs = [g["initial_lr"] for g in groups]
            lrs = [
                base * fn(scheduler.last_epoch)
                for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
            ]
            for group, lr in zip(groups, lrs, strict=True):
                group["lr"] = lr
            scheduler._last_lr = lrs

        scheduler.load_state_dict = load_state_dict
        return scheduler

    trainer.create_optimizer, trainer.create_scheduler = new_create_optimizer, new_create_scheduler
