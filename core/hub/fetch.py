"""Downloads from the Hub into huggingface_hub's own cache, with hf_hub_download (no HTTP of our own).

A download first lists what it will fetch (only the files training needs: remote.training_files) and their
sizes, and refuses with one sentence when the cache's disk would not keep LORA_COCKPIT_HUB_KEEP_FREE free
afterwards. It records that list (the manifest) before the first byte, so that a snapshot is known complete only
when every listed file is there: a kill leaves huggingface_hub's *.incomplete file, never a file that reads as
complete, and the next download fetches only what is missing (continuing a partial file where the server honours
HTTP ranges). Progress (bytes, rate, time left) is reported through a tqdm class of ours.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from core.files import BadFile, atomic_write_text, load_json_object
from core.fmt import nbytes
from core.hub.ids import COMMIT, HubError, HubRef, cache_dir, endpoint, explain, offline, offline_sentence
from core.hub.remote import (
    RepoFacts,
    cached_commit,
    facts,
    has_weights,
    light_files,
    manifest_path,
    read_manifest,
    repo_folder,
    snapshot,
    training_files,
)

KEEP_FREE_ENV = "LORA_COCKPIT_HUB_KEEP_FREE"
DEFAULT_KEEP_FREE = 1 << 30  # a download never leaves the cache's disk with less than this free
WORKERS = 4  # files fetched at once (each large shard is one stream)
REPORT_EVERY_S = 0.5
RATE_WINDOW_S = 5.0

Report = Callable[[dict], None]


def keep_free() -> int:
    """Bytes a download leaves free on the cache's disk: LORA_COCKPIT_HUB_KEEP_FREE (bytes, or 500MB / 2GB)."""
    text = (os.environ.get(KEEP_FREE_ENV) or "").strip().upper().replace(" ", "")
    if not text:
        return DEFAULT_KEEP_FREE
    for unit, factor in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if text.endswith(unit):
            text, scale = text[: -len(unit)], factor
            break
    else:
        scale = 1
    try:
        return max(0, int(float(text) * scale))
    except ValueError:
        raise HubError(
            f"{KEEP_FREE_ENV}={os.environ.get(KEEP_FREE_ENV)!r} is not a size: give bytes or e.g. 500MB, 2GB."
        ) from None


def free_bytes(folder: Path) -> int:
    """Free space on the disk that holds `folder` (its nearest existing parent: the cache may not exist yet)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def present(found: RepoFacts, name: str) -> bool:
    """The file is complete in the snapshot (huggingface_hub links it there only once it is whole)."""
    path = snapshot(found.ref, found.commit) / name
    if not path.is_file():
        return False
    size = found.files.get(name)
    return not size or path.stat().st_size == size


@dataclass(frozen=True)
class DownloadPlan:
    facts: RepoFacts
    files: list[str]  # what the download needs in the snapshot
    missing: list[str]  # of those, what is not there yet
    total_bytes: int
    missing_bytes: int
    free_bytes: int
    keep_free: int

    @property
    def fits(self) -> bool:
        return self.free_bytes - self.missing_bytes >= self.keep_free

    def summary(self) -> str:
        have = len(self.files) - len(self.missing)
        return (
            f"{self.facts.label()}: {len(self.files)} files, {nbytes(self.total_bytes)}; "
            f"{have} already cached, {nbytes(self.missing_bytes)} to fetch; {nbytes(self.free_bytes)} free in "
            f"{cache_dir()}"
        )


def plan_download(
    ref: HubRef, files: list[str] | None = None, found: RepoFacts | None = None
) -> DownloadPlan:
    found = found or facts(ref)
    wanted = sorted(files) if files is not None else wanted_files(found)
    missing = [f for f in wanted if not present(found, f)]
    return DownloadPlan(
        found,
        wanted,
        missing,
        sum(found.files.get(f, 0) for f in wanted),
        sum(found.files.get(f, 0) for f in missing),
        free_bytes(cache_dir()),
        keep_free(),
    )


def wanted_files(found: RepoFacts) -> list[str]:
    """A model's training files (see remote.training_files); every file of a dataset's (rows narrows that)."""
    if found.ref.repo_type == "model":
        names = training_files(found.files)
        if not has_weights(names):
            raise HubError(
                f"{found.label()} has no safetensors or .bin weights at its top level (a GGUF-only, adapter or "
                "code repo): give a transformers model."
            )
        return names
    return sorted(f for f in found.files if f != ".gitattributes")


def check_space(plan: DownloadPlan) -> None:
    if not plan.fits:
        raise HubError(
            f"Downloading {plan.facts.label()} needs {nbytes(plan.missing_bytes)} more, but the disk of "
            f"{cache_dir()} has {nbytes(plan.free_bytes)} free and {nbytes(plan.keep_free)} must stay free "
            f"({KEEP_FREE_ENV}): free space there, or set HF_HOME to a folder on a larger disk."
        )


def download(
    ref: HubRef,
    progress: Report | None = None,
    files: list[str] | None = None,
    found: RepoFacts | None = None,
) -> Path:
    """Fetch what `ref` needs into the cache and return its snapshot folder. Offline: the cached snapshot when it
    is complete, else the offline sentence. HubError (one sentence) for every failure."""
    if offline():
        folder = complete_folder(ref)
        if folder is None:
            raise HubError(offline_sentence(ref))
        return folder
    plan = plan_download(ref, files, found)
    check_space(plan)
    found = plan.facts
    _write_manifest(found, plan.files)
    tracker = Tracker(found, plan, progress)
    if plan.missing:
        tracker.emit(force=True)
        fetch_files(found, plan.missing, tracker)
    tracker.emit(final=True)
    return snapshot(found.ref, found.commit)


def fetch_files(found: RepoFacts, names: list[str], tracker: Tracker | None = None) -> Path:
    """hf_hub_download each of `names` not yet in the snapshot, WORKERS at a time; the snapshot folder."""
    from huggingface_hub import hf_hub_download

    todo = [n for n in names if not present(found, n)]
    if offline() and todo:
        raise HubError(offline_sentence(found.ref))

    def one(name: str) -> None:
        try:
            hf_hub_download(
                found.ref.repo_id,
                name,
                repo_type=found.ref.repo_type,
                revision=found.commit,
                cache_dir=str(cache_dir()),
                endpoint=endpoint(),
                tqdm_class=tracker.bar_class() if tracker else _Quiet,
            )
        except OSError as exc:
            if exc.errno == 28:  # ENOSPC: another writer filled the disk after the space check
                raise HubError(
                    f"The disk of {cache_dir()} filled up while downloading {name} of {found.label()}: free "
                    "space and run it again (the files already complete are kept)."
                ) from None
            raise HubError(explain(exc, found.ref, name)) from None
        except Exception as exc:
            raise HubError(explain(exc, found.ref, name)) from None
        if tracker:
            tracker.file_done(name)

    if todo:
        pool = ThreadPoolExecutor(max_workers=min(WORKERS, len(todo)))
        try:
            futures = [pool.submit(one, n) for n in todo]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and not f.cancelled() and f.exception():
                    raise f.exception()
        finally:
            # a failure or Ctrl+C stops the files not started yet, without waiting for the ones in flight
            pool.shutdown(wait=False, cancel_futures=True)
    if not found.cached_only:
        _write_ref(found)
    return snapshot(found.ref, found.commit)


def _write_manifest(found: RepoFacts, names: list[str]) -> None:
    old = read_manifest(found.ref, found.commit) or {}
    sizes = {**old.get("sizes", {}), **{n: found.files.get(n, 0) for n in names}}
    record = {"repo": found.ref.repo_id, "type": found.ref.repo_type, "commit": found.commit, "sizes": sizes}
    try:
        atomic_write_text(manifest_path(found.ref, found.commit), json.dumps(record, sort_keys=True))
    except OSError as exc:
        raise HubError(f"The Hugging Face cache {cache_dir()} cannot be written ({exc.strerror}).") from None


def _write_ref(found: RepoFacts) -> None:
    """refs/BRANCH -> the commit, so that BRANCH finds this snapshot offline (as snapshot_download records it)."""
    if COMMIT.match(found.ref.rev):
        return
    ref_file = repo_folder(found.ref) / "refs" / found.ref.rev
    try:
        if not ref_file.is_file() or ref_file.read_text().strip() != found.commit:
            atomic_write_text(ref_file, found.commit)
    except OSError:
        pass  # the snapshot is complete; only its branch name is not remembered offline


def complete_folder(ref: HubRef, commit: str | None = None) -> Path | None:
    """The cached snapshot of `ref` (at `commit`, else the commit its branch pointed at when fetched) when it is
    complete: every file its download listed, at its size; without a list (fetched by another tool), a model's
    config.json, weights and every shard its index names."""
    commit = commit or cached_commit(ref)
    if commit is None:
        return None
    folder = snapshot(ref, commit)
    if not folder.is_dir():
        return None
    recorded = read_manifest(ref, commit)
    if recorded:
        for name, size in recorded["sizes"].items():
            path = folder / name
            if not path.is_file() or (size and path.stat().st_size != size):
                return None
        return folder
    if ref.repo_type != "model":
        return folder if any(folder.iterdir()) else None
    names = [p.name for p in folder.iterdir() if p.is_file()]
    if "config.json" not in names or not has_weights(names):
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(load_json_object(index)["weight_map"].values())
        except (BadFile, KeyError, TypeError, AttributeError):
            return None
        if not all((folder / s).is_file() for s in shards):
            return None
    return folder


def local_model(ref: HubRef, progress: Report | None = None, found: RepoFacts | None = None) -> Path:
    """The model's complete snapshot folder, downloaded first when the cache lacks any of it."""
    if not offline():
        found = found or facts(ref)
        folder = complete_folder(ref, found.commit)
        return folder if folder is not None else download(ref, progress, found=found)
    return download(ref, progress)


def model_path(path, progress: Report | None = None) -> str:
    """A model path as a folder with its weights: a Hub id becomes its complete cached snapshot (downloaded
    first when the cache lacks any of it); a local path stays as it is. HubError with one sentence."""
    from core.hub.ids import parse

    ref = parse(str(path)) if path is not None else None
    if ref is None:
        return path
    try:
        return str(local_model(ref, progress))
    except HubError as exc:  # it may have been meant as a folder: say both
        raise HubError(f"{path} is not a folder here (relative to {Path.cwd()}), and {exc}") from None


def light_folder(ref: HubRef) -> Path:
    """A snapshot folder holding the model's config, tokenizer and chat template (fetched when missing: kilobytes,
    no weights): what preflight, previews and plans read."""
    found = facts(ref)
    if "config.json" not in found.files:
        raise HubError(
            f"{found.label()} has no config.json: it is not a transformers model (a GGUF-only or adapter repo "
            "cannot be planned or trained here)."
        )
    return fetch_files(found, light_files(found.files))


def folder_for_checks(ref: HubRef, need_weights: bool) -> tuple[Path, bool]:
    """(the folder to check, whether to check its weights) for a model id: its complete snapshot; else, online,
    its config and tokenizer (the weights are listed on the Hub and fetched when a run starts)."""
    if offline():
        folder = complete_folder(ref)
        if folder is None and not need_weights:
            commit = cached_commit(ref)
            light = snapshot(ref, commit) if commit else None
            folder = light if light and (light / "config.json").is_file() else None
            need_weights = False
        if folder is None:
            commit = cached_commit(ref)
            if commit and need_weights:
                raise HubError(
                    f"{ref} ({ref.rev} @ {commit[:7]}) is only partly in the local Hugging Face cache and "
                    "HF_HUB_OFFLINE=1 keeps the Hub out of reach: download it with HF_HUB_OFFLINE unset (python -m "
                    f"core.hub download {ref}), or name a cached commit ({ref.repo_id}@COMMIT)."
                )
            raise HubError(offline_sentence(ref))
        return folder, need_weights
    found = facts(ref)
    folder = complete_folder(ref, found.commit)
    if folder is not None:
        return folder, need_weights
    wanted_files(found)  # a repo without weights is said so now, not after the download
    return light_folder(ref), False


def readable(path) -> str:
    """A model path as transformers can read its config and tokenizer: a Hub id becomes its cached folder (the
    complete snapshot, or the config and tokenizer files fetched: no weights); a local path stays as it is."""
    from core.hub.ids import parse

    ref = parse(path)
    if ref is None:
        return path
    return str(folder_for_checks(ref, need_weights=False)[0])


def config_json(ref: HubRef) -> tuple[dict, RepoFacts]:
    """The repo's config.json (fetched into the cache when missing: a few KiB) and the facts it came with."""
    found = facts(ref)
    if "config.json" not in found.files:
        raise HubError(
            f"{found.label()} has no config.json: it is not a transformers model (a GGUF-only or adapter repo "
            "cannot be planned or trained here)."
        )
    folder = fetch_files(found, ["config.json"])
    try:
        return load_json_object(folder / "config.json"), found
    except BadFile as exc:
        raise HubError(f"The config.json of {found.label()} {exc.why}.") from None


# ---- progress ---------------------------------------------------------------------------------------------------


class _Quiet:
    """A tqdm stand-in that shows nothing (small files fetched for a plan or a preflight)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Tracker:
    """Adds up the bytes every file's bar receives and reports {bytes_done, bytes_total, files_done, files_total,
    rate_bps, eta_s, ...} at most every REPORT_EVERY_S (and at each file's end)."""

    def __init__(self, found: RepoFacts, plan: DownloadPlan, report: Report | None):
        self.found, self.report = found, report
        self.total, self.files_total = plan.total_bytes, len(plan.files)
        self.done = plan.total_bytes - plan.missing_bytes  # cached files count as done from the start
        self.files_done = len(plan.files) - len(plan.missing)
        self.fetched = 0
        self.lock = threading.Lock()
        self.samples: list[tuple[float, int]] = [(time.monotonic(), 0)]
        self.last = 0.0
        self.current = ""

    def bar_class(self) -> type:
        tracker = self

        class Bar(_Quiet):
            def __init__(self, *args, desc: str = "", **kwargs):
                tracker.current = desc or tracker.current
                self.n = 0

            def update(self, n=1):
                if n:
                    self.n += n
                    tracker.add(int(n))

        return Bar

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            self.fetched += n
        self.emit()

    def file_done(self, name: str) -> None:
        with self.lock:
            self.files_done += 1
            self.current = name
        self.emit(force=True)

    def rate(self) -> float:
        now = time.monotonic()
        self.samples.append((now, self.fetched))
        while len(self.samples) > 2 and now - self.samples[1][0] > RATE_WINDOW_S:
            self.samples.pop(0)
        t0, b0 = self.samples[0]
        return (self.fetched - b0) / (now - t0) if now > t0 else 0.0

    def emit(self, force: bool = False, final: bool = False) -> None:
        if self.report is None:
            return
        now = time.monotonic()
        if not (force or final) and now - self.last < REPORT_EVERY_S:
            return
        self.last = now
        with self.lock:
            rate = self.rate()
            left = max(0, self.total - self.done)
            self.report(
                {
                    "phase": "download",
                    "repo": self.found.ref.repo_id,
                    "repo_type": self.found.ref.repo_type,
                    "revision": self.found.ref.rev,
                    "commit": self.found.commit,
                    "file": self.current,
                    "bytes_done": min(self.done, self.total) if self.total else self.done,
                    "bytes_total": self.total,
                    "files_done": self.files_done,
                    "files_total": self.files_total,
                    "rate_bps": round(rate, 1),
                    "eta_s": round(left / rate, 1) if rate > 0 and left else (0.0 if not left else None),
                    "final": final,
                }
            )


def progress_line(p: dict) -> str:
    """One line of a download's progress: '42% 1.2 GiB of 2.9 GiB, 3/5 files, 85.0 MiB/s, 0:21 left'."""
    from core.fmt import duration

    total = p.get("bytes_total") or 0
    share = f"{p.get('bytes_done', 0) / total:.0%} " if total else ""
    rate = f", {nbytes(p['rate_bps'])}/s" if p.get("rate_bps") else ""
    eta = p.get("eta_s")
    left = f", {duration(eta)} left" if eta else ""
    return (
        f"{share}{nbytes(p.get('bytes_done', 0))} of {nbytes(total)}, {p.get('files_done', 0)}/"
        f"{p.get('files_total', 0)} files{rate}{left}"
    )
