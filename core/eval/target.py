"""What an evaluation compares: the run's base and its adapter (or a merged export / fully fine-tuned model), the
run's config, and which checkpoint when the run has not finished. Every refusal is one sentence (EvalError)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from core import checkpoints, liveness, rundir
from core.eval.heldout import EvalError
from core.files import read_json_object
from core.hub import fetch
from core.hub.ids import HubError
from core.recipe.config import ConfigError, load_config
from core.train import sources
from core.workspace import default_workspace, runs_dir

ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class Target:
    cfg: dict  # the run config (the base's loading, the data and its split, the method)
    base: str  # the base model folder
    adapter: str | None  # a peft adapter folder: base and tuned share one model load (adapter off / on)
    model: str | None  # a merged export or a fully fine-tuned model: the tuned side is a second load
    run_dir: Path | None
    what: str  # "adapter", "checkpoint-50", "export my-merge" ... for the settings and the lines
    note: str = ""  # a sentence the CLI prints (e.g. the run is still training)


def find_run(run: str | os.PathLike, workspace: str | os.PathLike | None = None) -> Path:
    """A run folder from a path or a run name under <workspace>/runs."""
    p = Path(run).expanduser()
    if not p.is_dir() and not p.is_absolute():
        p = runs_dir(workspace or default_workspace()) / str(run)
    if not p.is_dir():
        raise EvalError(
            f"{run} is not a run folder (nor a run name under {runs_dir(workspace or default_workspace())})."
        )
    if not (p / rundir.CONFIG).is_file():
        raise EvalError(f"{p} has no {rundir.CONFIG}: it is not a run folder written by core.train.")
    return p.resolve()


def _is_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def _run_weights(run_dir: Path) -> tuple[Path, str, str]:
    """(folder, what, note): the run's final adapter (or full model) when it has ended, else its newest
    checkpoint; a run still training is evaluated at its newest checkpoint."""
    _, state, alive = liveness.read_live_status(run_dir)
    final = [run_dir / rundir.ADAPTER, run_dir / rundir.MODEL]
    if not alive:
        for path in final:
            if _is_adapter(path) or (path / "config.json").is_file():
                return path, path.name, ""
    ckpt = checkpoints.latest_checkpoint(run_dir)
    if ckpt is None:
        if alive:
            raise EvalError(
                f"The run {run_dir.name} is still training and has saved no checkpoint yet: evaluate it after its "
                "first checkpoint (training.save_steps) or when it ends."
            )
        raise EvalError(
            f"The run {run_dir.name} ({state}) saved no adapter and no checkpoint: nothing to evaluate."
        )
    why = "is still training" if alive else f"ended {state} without its final adapter"
    return ckpt, ckpt.name, f"note: the run {why}: evaluating its newest checkpoint, {ckpt.name}."


def resolve(
    run: str | os.PathLike | None = None,
    adapter: str | os.PathLike | None = None,
    model: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
    workspace: str | os.PathLike | None = None,
) -> Target:
    """The target from a run (its adapter or checkpoint), or an adapter / model folder with its base."""
    cfg, run_dir, note = None, None, ""
    if run is not None:
        run_dir = find_run(run, workspace)
        try:
            cfg = load_config(run_dir / rundir.CONFIG)
        except ConfigError as exc:
            raise EvalError(f"The run's config does not load: {exc}") from None
    try:  # Hub ids: the run's at the commits it trained on; --base / --model ones at their branch
        cfg = sources.for_evaluation(cfg, run_dir) if cfg is not None else None
        base, model = fetch.model_path(base), fetch.model_path(model)
    except HubError as exc:
        raise EvalError(str(exc)) from None
    tuned: Path | None = Path(model or adapter).expanduser().resolve() if (model or adapter) else None
    what = ""
    if tuned is None:
        if run_dir is None:
            raise EvalError(
                "Say what to evaluate: --run RUN, or --adapter DIR / --model DIR with --base DIR."
            )
        tuned, what, note = _run_weights(run_dir)
    if not tuned.is_dir():
        raise EvalError(f"{tuned} does not exist: give an adapter folder or a model folder.")
    is_adapter = _is_adapter(tuned)
    if not is_adapter and not (tuned / "config.json").is_file():
        raise EvalError(
            f"{tuned} is neither a peft adapter (no {ADAPTER_CONFIG}) nor a model (no config.json)."
        )
    what = what or ("adapter " if is_adapter else "model ") + tuned.name
    if cfg is None:
        cfg = _config_beside(tuned)
    base_dir = Path(base).expanduser() if base else (Path(cfg["model"]["path"]) if cfg else None)
    if base_dir is None and is_adapter:
        recorded = (read_json_object(tuned / ADAPTER_CONFIG) or {}).get("base_model_name_or_path")
        base_dir = Path(recorded) if isinstance(recorded, str) and recorded else None
    if base_dir is None or not (base_dir / "config.json").is_file():
        raise EvalError(
            f"The base model {base_dir or '(not named)'} is not a local model folder: give --base DIR."
        )
    base_dir = base_dir.resolve()
    if cfg is None:
        from core.recipe.config import validate_config

        cfg = validate_config({"model": {"path": str(base_dir)}, "data": {"path": str(base_dir)}})
    cfg["model"]["path"] = str(base_dir)
    if is_adapter:
        _check_belongs(tuned, base_dir)
    return Target(
        cfg,
        str(base_dir),
        str(tuned) if is_adapter else None,
        None if is_adapter else str(tuned),
        run_dir,
        what,
        note,
    )


def _config_beside(tuned: Path) -> dict | None:
    for cand in (tuned / rundir.CONFIG, tuned.parent / rundir.CONFIG, tuned.parent.parent / rundir.CONFIG):
        if cand.is_file():
            try:
                return load_config(cand)
            except ConfigError:
                return None
    return None


def _check_belongs(adapter_dir: Path, base_dir: Path) -> None:
    """Refuse an adapter trained on another base (core.merge.compat's checks: the recorded fingerprint of the
    base weights, else the recorded base's config.json)."""
    from core.merge import MergeError
    from core.merge.adapter import load_adapter
    from core.merge.compat import check_recorded_base
    from core.merge.errors import load_json
    from core.merge.shards import BaseCheckpoint

    try:
        base_config = load_json(base_dir / "config.json", "restore it from the base model's original files.")
        mismatch, _ = check_recorded_base(load_adapter(adapter_dir), BaseCheckpoint(base_dir), base_config)
    except (MergeError, OSError, ValueError) as exc:
        raise EvalError(f"The adapter {adapter_dir} cannot be checked against {base_dir}: {exc}") from None
    if mismatch:
        raise EvalError(f"{mismatch.rstrip('.')}: evaluate it with the base it was trained on (--base DIR).")
