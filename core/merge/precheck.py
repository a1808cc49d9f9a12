"""Preflight: everything checked before anything is written (adapter, base, RAM, disk, target)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from core.files import disk_needed, disk_shortfall
from core.fmt import disk
from core.merge import delta
from core.merge.adapter import load_adapter
from core.merge.compat import check_recorded_base, check_vocabulary, signature
from core.merge.discover import is_qlora
from core.merge.errors import MergeError, load_json
from core.merge.mapping import MergePlan, plan_merge
from core.merge.model_files import TOKENIZER_FILES, tokenizer_source
from core.merge.shards import DTYPE_NAMES, MB
from core.workspace import WorkspaceError, default_workspace, inside

# Python + torch + transformers already use a few hundred MB before any tensor is read.
RUNTIME_OVERHEAD = 768 * MB


@dataclass
class Preflight:
    base_dir: str
    adapter_dir: str
    target: str
    out_dtype: str
    n_tensors: int
    n_lora_modules: int
    n_replaced: int
    n_shards: int
    base_bytes: int
    adapter_bytes: int
    out_bytes: int
    largest_tensor_bytes: int
    ram_available: int
    ram_needed: int
    verify_ram_needed: int
    disk_free: int
    disk_needed: int
    verify_mode: str
    qlora: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        return [
            f"base: {self.base_dir} ({disk(self.base_bytes)}), adapter: {self.adapter_dir} ({self.n_lora_modules} "
            f"LoRA modules, {self.n_replaced} replaced tensors)",
            f"output: {self.target} — {self.n_tensors} tensors, {disk(self.out_bytes)} in {self.out_dtype}, "
            f"{self.n_shards} shard(s)",
            f"RAM: need ~{disk(self.ram_needed)} to merge, {disk(self.verify_ram_needed)} for the logits check; "
            f"{disk(self.ram_available)} available",
            f"disk: need {disk(self.disk_needed)}, {disk(self.disk_free)} free",
            f"verification: {self.verify_mode}",
        ]


FORCE_FIX = (
    "point --base at the model the adapter was trained on, or pass --force (on the page: 'Merge anyway') if you "
    "are sure."
)


def workspace_target(out_dir: str | os.PathLike, workspace: str | os.PathLike | None = None) -> Path:
    """The page's rule: an export is written only inside the workspace (relative names start there)."""
    ws = Path(workspace) if workspace else default_workspace()
    try:
        return inside(ws, out_dir)
    except WorkspaceError as e:
        raise MergeError(f"Output folder: {e}") from e


def in_workspace(at):
    """`at` (merge_at, preflight_at: any output folder, the CLI's rule) for an output folder inside the workspace
    (the page's rule; relative names start there: workspace_target), with the same arguments and `workspace=`:
    one signature, written once."""

    @functools.wraps(at)
    def inside_workspace(base_dir, adapter_dir, out_dir, *args, workspace=None, **kwargs):
        return at(base_dir, adapter_dir, workspace_target(out_dir, workspace), *args, **kwargs)

    inside_workspace.__name__ = inside_workspace.__qualname__ = at.__name__.removesuffix("_at")
    inside_workspace.__doc__ = f"{at.__name__}() into a folder inside the workspace (keyword `workspace`)."
    return inside_workspace


def _folder(path: str | os.PathLike, what: str, flag: str, holds: str) -> Path:
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        state = "is a file, not a folder" if p.exists() else "does not exist"
        raise MergeError(f"{what} {p} {state}: point {flag} at the folder holding {holds}.")
    return p


def preflight_at(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    target: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    shard_size: int | str = "5GB",
    verify: str = "auto",
    force: bool = False,
) -> tuple[Preflight, MergePlan]:
    """Check everything before writing anything; `target` may be anywhere (relative: from the current folder).
    Structural problems (bad adapter, wrong base) raise MergeError; resource problems (RAM, disk, existing or
    unwritable target) are listed in `problems` with the numbers. A base or vocabulary that does not match the
    adapter is refused unless `force`, then kept as a note."""
    target = Path(target).expanduser().resolve()
    base_dir = _folder(base_dir, "Base model folder", "--base", "the base model's config.json and weights")
    adapter_dir = _folder(
        adapter_dir, "Adapter folder", "--adapter", "adapter_config.json (a run's adapter/ folder)"
    )
    if verify not in ("auto", "full", "quick"):
        raise MergeError(f"verify must be auto, full or quick, not {verify!r}.")
    adapter = load_adapter(adapter_dir)
    plan = plan_merge(base_dir, adapter, dtype, shard_size)

    notes = list(plan.base.warnings) + list(plan.notes)
    notes += _belonging_notes(plan, base_dir, adapter_dir, force)
    problems, probe = _target_problems(target, base_dir, adapter_dir)
    qlora = is_qlora(adapter_dir)
    if qlora:
        notes.append(
            "QLoRA adapter: it was trained against the 4-bit (NF4) dequantized weights, but it is merged into the "
            f"unquantized base (output in {DTYPE_NAMES[plan.out_dtype]}), the usual choice. The merged model is "
            "therefore not bit-identical to what training saw; expect a small deviation (the verification "
            "compares against base+adapter at full precision)."
        )
    ram = _ram_bill(plan)
    if ram.needed > ram.available:
        problems.append(
            f"Not enough free RAM: the merge needs about {disk(ram.needed)}, {disk(ram.available)} is available. "
            "Close other programs, or merge on a machine with more memory."
        )
    if verify == "auto":
        verify = "full" if ram.verify < 0.8 * ram.available else "quick"
        if verify == "quick":
            notes.append(
                f"The logits check needs ~{disk(ram.verify)} RAM but {disk(ram.available)} is available: only the quick "
                "check (every tensor re-read, merged rows recomputed, config and tokenizer loaded) will run."
            )
    disk_needed = _disk_needed(plan, adapter_dir, base_dir)
    disk_free, short = disk_shortfall(probe, disk_needed)
    if short:
        problems.append(short)
    pf = Preflight(
        base_dir=str(base_dir),
        adapter_dir=str(adapter_dir),
        target=str(target),
        out_dtype=DTYPE_NAMES[plan.out_dtype],
        n_tensors=len(plan.tensors),
        n_lora_modules=len(adapter.modules),
        n_replaced=len(adapter.replacements),
        n_shards=len(plan.shards),
        base_bytes=plan.base.total_bytes,
        adapter_bytes=adapter.nbytes,
        out_bytes=plan.out_bytes,
        largest_tensor_bytes=ram.largest_tensor,
        ram_available=ram.available,
        ram_needed=ram.needed,
        verify_ram_needed=ram.verify,
        disk_free=disk_free,
        disk_needed=disk_needed,
        verify_mode=verify,
        qlora=qlora,
        problems=problems,
        notes=notes,
    )
    return pf, plan


preflight = in_workspace(preflight_at)


def mismatches(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike) -> list[str]:
    """Why the adapter may not belong to this base (the base it recorded, its vocabulary), one sentence each: what
    force ('Merge anyway') overrides, so a page offers that only when there is one. MergeError for an adapter or
    a base that cannot be merged at all (preflight says why)."""
    base_dir = _folder(base_dir, "Base model folder", "--base", "the base model's config.json and weights")
    adapter_dir = _folder(adapter_dir, "Adapter folder", "--adapter", "adapter_config.json")
    plan = plan_merge(base_dir, load_adapter(adapter_dir), None, "5GB")
    return _mismatches(plan, base_dir, adapter_dir)[0]


def _mismatches(plan: MergePlan, base_dir: Path, adapter_dir: Path) -> tuple[list[str], list[str]]:
    """(mismatches, notes) of the adapter against this base: its recorded base, its vocabulary."""
    # plan_merge has read and checked it; the recorded-base check needs it as on disk, before any resize
    base_config = load_json(base_dir / "config.json", "restore it.")
    mismatch, notes = check_recorded_base(plan.adapter, plan.base, base_config)
    vocab = check_vocabulary(adapter_dir, base_dir, signature(plan.config).get("vocab_size"))
    return [m for m in (mismatch, vocab) if m], notes


def _belonging_notes(plan: MergePlan, base_dir: Path, adapter_dir: Path, force: bool) -> list[str]:
    """Does the adapter belong to this base (its recorded base, its vocabulary)? A mismatch is a MergeError
    with the fix, unless `force`: then it is kept as a note, with any note the checks made."""
    mismatches, notes = _mismatches(plan, base_dir, adapter_dir)
    if mismatches and not force:
        raise MergeError("; ".join(mismatches) + ": " + FORCE_FIX)
    return [f"Merging anyway (forced): {m}." for m in mismatches] + notes


def _target_problems(target: Path, base_dir: Path, adapter_dir: Path) -> tuple[list[str], Path]:
    """(problems, probe): why the export cannot be created at `target`, and the nearest existing folder above
    it (where the free disk is measured)."""
    problems: list[str] = []
    if target.exists():
        problems.append(
            f"The target {target} already exists: choose a new folder name (an export is never overwritten)."
        )
    if target in (base_dir, adapter_dir) or base_dir in target.parents or adapter_dir in target.parents:
        problems.append(
            f"The target {target} lies inside the base or adapter folder: choose a folder under exports/."
        )
    probe = target.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        problems.append(
            f"Cannot create {target}: {probe} is a file, not a folder; choose another output folder (--out)."
        )
    elif not os.access(probe, os.W_OK | os.X_OK):
        problems.append(f"Cannot write into {probe}: choose an output folder (--out) you can write to.")
    return problems, probe


@dataclass
class _RamBill:
    needed: (
        int  # to merge: the adapter, a few blocks of the largest tensor, the runtime (+ a whole .bin file)
    )
    verify: int  # for the logits check: one fp32 model at a time
    available: int
    largest_tensor: int


def _ram_bill(plan: MergePlan) -> _RamBill:
    largest = max((t.nbytes for t in plan.tensors), default=0)
    largest_src = max((t.nbytes for t in plan.base.tensors.values()), default=0)
    chunk = min(delta.CHUNK_BYTES, max(largest_src, largest) * 4)
    needed = plan.adapter.nbytes + 4 * chunk + RUNTIME_OVERHEAD
    if plan.base.kind == "bin":
        needed += plan.base.largest_file_bytes
    n_params = sum(math.prod(t.shape) for t in plan.tensors)
    verify = n_params * 4 + plan.adapter.nbytes + RUNTIME_OVERHEAD  # one fp32 model at a time
    return _RamBill(needed, verify, psutil.virtual_memory().available, largest)


def _disk_needed(plan: MergePlan, adapter_dir: Path, base_dir: Path) -> int:
    """The export's bytes: its tensors and the tokenizer files it copies, with the exports' margin."""
    tok_dir = tokenizer_source(adapter_dir, base_dir)
    small = sum((tok_dir / n).stat().st_size for n in TOKENIZER_FILES if (tok_dir / n).is_file())
    return disk_needed(plan.out_bytes + small)
