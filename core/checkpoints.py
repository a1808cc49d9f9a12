"""A run's checkpoints: the checkpoints/checkpoint-N folders the trainer saves, which of them can be resumed from
(checkpoint_problem reads what a cut-off or damaged save leaves), and the newest usable one. Reads only; the run
directory (core.rundir) names this folder among its files.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.files import BadFile, read_json_object, read_safetensors_header

CHECKPOINTS = "checkpoints"  # the run directory's folder of checkpoint-N folders
CHECKPOINT_CONFIG = "run_config.yaml"  # inside checkpoint-N: the config that trained it (core.train.resume)
CONFIG_HISTORY = "config.history"  # until-step-N.yaml: each config a resume with a changed config replaced


def checkpoint_step(path: Path) -> int | None:
    tail = path.name.removeprefix("checkpoint-")
    return int(tail) if path.name.startswith("checkpoint-") and tail.isdigit() else None


def checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every checkpoint-N folder of the run, newest first (whether usable or not)."""
    ckpts = Path(run_dir) / CHECKPOINTS
    if not ckpts.is_dir():
        return []
    found = [p for p in ckpts.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step, reverse=True)


def checkpoint_problem(path: str | os.PathLike, deep: bool = False) -> str | None:
    """None when the checkpoint folder can be resumed from; else why not, in a few words. Reads only.

    Checks what a cut-off or damaged save leaves: trainer_state.json readable and at the folder's step, weights
    (safetensors: the header parses and the file is as long as it says; .bin: a whole zip), and the optimizer,
    scheduler and RNG states written by torch.save as whole zip archives. `deep` also checks the CRC of every
    member of those archives (reads them through; the trainer does so for the one it resumes from)."""
    path = Path(path)
    state = read_json_object(path / "trainer_state.json")
    if state is None:
        return "trainer_state.json is missing or unreadable (cut off while saving?)"
    step = checkpoint_step(path)
    if state.get("global_step") != step:
        return f"trainer_state.json says step {state.get('global_step')!r}, not {step}"
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    weights = [w for w in weights if w.name != "training_args.bin"]
    if not weights:
        return "it holds no weights (no *.safetensors)"
    for w in weights:
        why = _safetensors_problem(w) if w.suffix == ".safetensors" else _torch_file_problem(w, deep)
        if why:
            return f"{w.name} {why}"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        f = path / name
        if not f.exists():
            if name == "rng_state.pth":
                continue  # optional for the Trainer
            return f"{name} is missing"
        why = _torch_file_problem(f, deep)
        if why:
            return f"{name} {why}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Why a checkpoint's weights file cannot be resumed from (core.files' one reader, then its size: a save cut
    off, or a file with bytes after its last tensor), or None."""
    try:
        header = read_safetensors_header(path)
    except BadFile as exc:
        return exc.why
    except OSError as exc:
        return f"is unreadable ({exc.__class__.__name__})"
    if header.data_end != header.size:
        return f"is {header.size:,} bytes where its header says {header.data_end:,} (truncated or damaged)"
    return None


def _torch_file_problem(path: Path, deep: bool) -> str | None:
    """torch.save writes a zip archive: a cut-off file has no central directory at its end."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if deep else None
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        return f"is damaged or truncated ({str(exc) or exc.__class__.__name__})"
    return f"is damaged ({bad} fails its checksum)" if bad else None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint that can be resumed from (checkpoint_problem), or None."""
    return next((p for p in checkpoints(run_dir) if checkpoint_problem(p) is None), None)
