"""The merge itself: preflight, stream every shard into a temporary folder beside the target, write the small
files, verify, then rename into place. A merge killed midway leaves no target folder."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from core import tempdirs
from core.fmt import disk
from core.merge.delta import tensor_stream
from core.merge.errors import MergeError
from core.merge.mapping import MergePlan, TensorPlan
from core.merge.model_files import TOKENIZER_FILES, tokenizer_source
from core.merge.precheck import Preflight, in_workspace, preflight_at
from core.merge.progress import MergeProgress, ProgressFn
from core.merge.shards import write_shard
from core.merge.verify import Verification, verify_export

TEMP_MARKER = ".lora-cockpit-merge"  # the owner record in a merge's temp folder (core.tempdirs.mark_temp)
TEMP_GLOB = ".*.merging-*"  # temp folders of merges into any target of one parent folder
PAUSE_ENV = "LORA_COCKPIT_TEST_MERGE_PAUSE_AFTER_FIRST_SHARD"  # test-only: makes the kill test deterministic


@dataclass
class MergeResult:
    out_dir: str
    preflight: Preflight
    verification: Verification
    files: list[tuple[str, int]]
    total_bytes: int
    seconds: float
    peak_rss: int

    def to_dict(self) -> dict:
        return asdict(self)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_small_files(plan: MergePlan, tmp: Path) -> None:
    (tmp / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")
    tok_dir = tokenizer_source(plan.adapter.dir, plan.base_dir)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, tmp / name)
    if (plan.base_dir / "generation_config.json").is_file():
        shutil.copyfile(plan.base_dir / "generation_config.json", tmp / "generation_config.json")
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": plan.out_bytes},  # bytes, as transformers expects
            "weight_map": {t.out_key: name for name, ts in plan.shards for t in ts},
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for p in tmp.iterdir():
        if p.is_file() and p.name != TEMP_MARKER:
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def merge_at(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    target: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    shard_size: int | str = "5GB",
    device: str = "cpu",
    verify: str = "auto",
    progress: ProgressFn | None = None,
    on_preflight: Callable[[Preflight], None] | None = None,
    force: bool = False,
) -> MergeResult:
    """Merge `adapter_dir` into `base_dir` and export to `target`, any folder the caller may write (relative:
    from the current folder; the CLI's rule). Raises MergeError with a sentence saying what to fix; on any
    failure nothing is left at `target`. `force` merges even into a base or vocabulary that does not match
    the adapter's record."""
    started = time.time()
    if device not in ("cpu", "cuda"):
        raise MergeError(f"Device {device!r} is not supported: use cpu or cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise MergeError("--device cuda was asked for but PyTorch sees no CUDA GPU: use --device cpu.")
    target = Path(target).expanduser().resolve()
    # what killed merges into any folder beside it left behind (only folders with our marker, never a live one's)
    tempdirs.clean_stale_temps(target.parent, TEMP_GLOB, TEMP_MARKER)
    pf, plan = preflight_at(base_dir, adapter_dir, target, dtype, shard_size, verify, force)
    if on_preflight:
        on_preflight(pf)
    if not pf.ok:
        raise MergeError(" ".join(pf.problems))

    proc = psutil.Process()
    peak = proc.memory_info().rss
    total_tensors, total_bytes = len(plan.tensors), plan.out_bytes
    done = {"tensors": 0, "bytes": 0}

    def report(phase: str, key: str = "") -> None:
        if progress:
            progress(MergeProgress(phase, done["tensors"], total_tensors, done["bytes"], total_bytes, key))

    def on_tensor(t: TensorPlan, n: int) -> None:
        nonlocal peak
        done["tensors"] += 1
        done["bytes"] += n
        peak = max(peak, proc.memory_info().rss)
        report("merge", t.out_key)

    tmp = target.parent / f".{target.name}.merging-{os.getpid()}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise MergeError(
            f"Cannot create {tmp} beside the target ({e.strerror or e}): choose an output folder (--out) you can "
            "write to."
        ) from e
    ok = False
    writing = "its first file"  # what a full disk interrupted, for the sentence
    try:
        tempdirs.mark_temp(tmp, TEMP_MARKER, target=str(target), started=started)
        report("merge")
        for i, (name, tensors) in enumerate(plan.shards):
            writing = name
            write_shard(tmp / name, tensors, lambda t: tensor_stream(t, plan.base, device), on_tensor)
            if i == 0 and os.environ.get(PAUSE_ENV):
                (tmp / ".paused").write_text("paused after the first shard (test hook)")
                time.sleep(float(os.environ[PAUSE_ENV]))
        writing = "config.json and the tokenizer files"
        _write_small_files(plan, tmp)
        report("verify")
        verification = verify_export(plan, tmp, pf.verify_mode, device, qlora=pf.qlora)
        peak = max(peak, proc.memory_info().rss)
        if not verification.passed:
            raise MergeError("Verification failed, nothing was exported: " + " ".join(verification.messages))
        (tmp / TEMP_MARKER).unlink()
        (tmp / ".paused").unlink(missing_ok=True)
        _fsync_dir(tmp)
        if target.exists():
            raise MergeError(f"The target {target} appeared while merging: not overwriting it.")
        os.rename(tmp, target)
        _fsync_dir(target.parent)
        ok = True
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # first: the free space then says what is left for a retry
        raise MergeError(
            f"The disk holding {target.parent} filled up while writing {writing} of the export ({e.strerror}): "
            f"the merge needs {disk(pf.disk_needed)} free there, {disk(shutil.disk_usage(target.parent).free)} is "
            f"free now; free some space or choose another --out. Nothing was written to {target}."
        ) from None
    finally:
        tempdirs.unmark_temp(tmp)
        if not ok:
            shutil.rmtree(tmp, ignore_errors=True)
    files = sorted((p.name, p.stat().st_size) for p in target.iterdir() if p.is_file())
    report("done")
    return MergeResult(
        out_dir=str(target),
        preflight=pf,
        verification=verification,
        files=files,
        total_bytes=sum(s for _, s in files),
        seconds=time.time() - started,
        peak_rss=peak,
    )


merge = in_workspace(merge_at)
