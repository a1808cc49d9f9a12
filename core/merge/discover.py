"""Finding adapters and their base for the page: runs with a saved adapter, the base they name, export names."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from core.files import read_json_object, read_yaml_mapping
from core.workspace import suggest_run_name


def run_config_for(adapter_dir: Path) -> dict:
    """The run's config.yaml when the adapter lives in a run directory (runs/<name>/adapter), else {}."""
    for cand in (adapter_dir / "config.yaml", adapter_dir.parent / "config.yaml"):
        if cand.is_file():
            return read_yaml_mapping(cand) or {}
    return {}


def is_qlora(adapter_dir: Path) -> bool:
    """True when the run config says the base was loaded in 4 bit (QLoRA): `quantization.load_in_4bit`, the
    transformers.BitsAndBytesConfig field core.train hands to the model loader (core/recipe/config.py). An adapter
    outside a run directory (no config.yaml) is not known to be QLoRA."""
    q = run_config_for(adapter_dir).get("quantization")
    return isinstance(q, dict) and q.get("load_in_4bit") is True


@dataclass
class AdapterChoice:
    run: str | None
    adapter_dir: str
    base_dir: str | None
    state: str | None
    base_note: str


def guess_base(adapter_dir: str | os.PathLike) -> tuple[str | None, str]:
    """(base folder or None, where it came from): the run's config.yaml `model` section, else
    adapter_config.json's base_model_name_or_path, when that folder exists locally."""
    d = Path(adapter_dir)
    model = run_config_for(d).get("model")
    cands: list[tuple[str, str]] = []
    if isinstance(model, str):
        cands.append((model, "run config.yaml"))
    elif isinstance(model, dict):
        for k in ("path", "name_or_path", "base", "base_model", "name", "id"):
            if isinstance(model.get(k), str):
                cands.append((model[k], f"run config.yaml model.{k}"))
    cfg = read_json_object(d / "adapter_config.json")  # bounded, regular files only: a FIFO never hangs
    recorded = cfg.get("base_model_name_or_path") if cfg else None
    if recorded and isinstance(recorded, str):
        cands.append((recorded, "adapter_config.json"))
    for path, source in cands:
        p = Path(path).expanduser()
        if (p / "config.json").is_file():
            return str(p.resolve()), source
    if cands:
        return (
            None,
            f"{cands[0][0]!r} (from {cands[0][1]}) is not a local model folder: enter the base folder.",
        )
    return None, "the adapter does not name its base model: enter the base folder."


def list_adapters(workspace: str | os.PathLike) -> list[AdapterChoice]:
    """Finished (and other) runs with a saved adapter: <workspace>/runs/*/adapter/adapter_config.json."""
    out = []
    for cfg in sorted(Path(workspace).glob("runs/*/adapter/adapter_config.json")):
        adapter = cfg.parent
        # a broken status.json, a FIFO or a device in its place: no state (bounded, never a hang)
        state = (read_json_object(adapter.parent / "status.json") or {}).get("state")
        base, note = guess_base(adapter)
        out.append(AdapterChoice(adapter.parent.name, str(adapter), base, state, note))
    return out


def suggest_export_name(source: str, workspace: str | os.PathLike) -> str:
    """`<source>-merged`, numbered when that export already exists (never proposes an existing folder)."""

    stem = suggest_run_name(f"{source}-merged")[:56]
    exports = Path(workspace) / "exports"
    name, n = stem, 2
    while (exports / name).exists():
        name, n = f"{stem}-{n}", n + 1
    return name


def folder_listing(path: str | os.PathLike) -> tuple[list[tuple[str, int]], int]:
    files = sorted((p.name, p.stat().st_size) for p in Path(path).iterdir() if p.is_file())
    return files, sum(s for _, s in files)
