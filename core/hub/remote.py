"""What the Hub says about a repo without downloading it: its commit, its files and their sizes, the files
training needs, its config.json and the safetensors headers (exact parameter count and dtypes). Offline, the same
facts come from the cache (the commit a branch pointed at when it was fetched, the files fetched since).
"""

from __future__ import annotations

import fnmatch
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.files import BadFile, read_safetensors_header
from core.hub.ids import (
    COMMIT,
    HubError,
    HubRef,
    cache_dir,
    endpoint,
    explain,
    offline,
    offline_sentence,
    revision_sentence,
)

# What a training run needs from a model repo: the top-level files (subfolders hold other formats: original/,
# onnx/, gguf/ ...), safetensors weights when there are any, never GGUF or other frameworks' weights.
OTHER_WEIGHTS = ("*.bin", "*.pth", "*.pt", "*.ckpt", "*.h5", "*.msgpack", "*.ot", "*.onnx", "*.tflite")
NEVER = ("*.gguf", ".gitattributes")
# The files preflight and planning read: the config, the tokenizer and the chat template (no weights).
LIGHT = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)
FACTS_TTL_S = 300  # a branch's commit is asked again after this long (a page redraws every few seconds)


@dataclass(frozen=True)
class RepoFacts:
    ref: HubRef
    commit: str
    files: dict[str, int] = field(default_factory=dict)  # every file at that commit -> its size in bytes
    cached_only: bool = False  # offline: the files known are those in the cache

    @property
    def short(self) -> str:
        return self.commit[:7]

    def label(self) -> str:
        return f"{self.ref.repo_id} @ {self.short}"


def repo_folder(ref: HubRef) -> Path:
    """The repo's folder in the cache (huggingface_hub's layout: models--ORG--NAME)."""
    return cache_dir() / f"{ref.repo_type}s--{ref.repo_id.replace('/', '--')}"


def snapshot(ref: HubRef, commit: str) -> Path:
    return repo_folder(ref) / "snapshots" / commit


def cached_commit(ref: HubRef) -> str | None:
    """The commit `ref` names in the cache: itself when it is one, else what its branch or tag pointed at."""
    if COMMIT.match(ref.rev):
        return ref.rev if snapshot(ref, ref.rev).is_dir() else None
    try:
        commit = (repo_folder(ref) / "refs" / ref.rev).read_text().strip()
    except (OSError, ValueError):
        return None
    return commit if COMMIT.match(commit) else None


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint())


_FACTS: dict[tuple, tuple[float, RepoFacts]] = {}


def facts(ref: HubRef) -> RepoFacts:
    """The repo's commit and files (HubError with one sentence when it cannot be had). Online: the Hub's answer,
    kept FACTS_TTL_S (a commit's answer for good); offline: the cache's."""
    if offline():
        return cached_facts(ref)
    key = (endpoint(), str(cache_dir()), ref)
    hit = _FACTS.get(key)
    if hit and (COMMIT.match(ref.rev) or time.monotonic() - hit[0] < FACTS_TTL_S):
        return hit[1]
    from huggingface_hub.hf_api import RepoFile

    api = _api()
    try:
        # a revision is always named: the repo-info call without one needs more of the Hub than a mirror has
        info = api.repo_info(ref.repo_id, repo_type=ref.repo_type, revision=ref.rev)
        commit = info.sha
        tree = api.list_repo_tree(ref.repo_id, repo_type=ref.repo_type, revision=commit, recursive=True)
        files = {f.path: int(f.size or 0) for f in tree if isinstance(f, RepoFile)}
    except Exception as exc:
        raise HubError(_why(exc, ref)) from None
    found = RepoFacts(ref, commit, files)
    _FACTS[key] = (time.monotonic(), found)
    return found


def _why(exc: BaseException, ref: HubRef) -> str:
    """explain(), but a repo that exists at main and not at `ref`'s revision is a missing revision (some servers
    answer both with 'repository not found')."""
    from huggingface_hub import errors as e

    if ref.revision and ref.rev != "main" and isinstance(exc, e.RepositoryNotFoundError):
        try:
            _api().repo_info(ref.repo_id, repo_type=ref.repo_type, revision="main")
        except Exception:
            return explain(exc, ref)
        return revision_sentence(ref)
    return explain(exc, ref)


def cached_facts(ref: HubRef) -> RepoFacts:
    """The facts the cache holds (offline): the commit from the cache's refs and the files of its snapshot (with
    the sizes recorded when it was fetched, when it was)."""
    commit = cached_commit(ref)
    if commit is None:
        raise HubError(
            offline_sentence(ref) if offline() else f"{ref} is not in the local Hugging Face cache."
        )
    folder = snapshot(ref, commit)
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    recorded = read_manifest(ref, commit)
    if recorded:
        files = {**recorded.get("sizes", {}), **files}
    return RepoFacts(ref, commit, files, cached_only=True)


def manifest_path(ref: HubRef, commit: str) -> Path:
    """What a download set out to fetch, beside huggingface_hub's own folders (its cache scan ignores it)."""
    return repo_folder(ref) / "lora-cockpit" / f"{commit}.json"


def read_manifest(ref: HubRef, commit: str) -> dict | None:
    try:
        data = json.loads(manifest_path(ref, commit).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("sizes"), dict) else None


def training_files(files: dict[str, int]) -> list[str]:
    """The files a run needs from a model repo: top-level, safetensors weights when there are any (otherwise the
    .bin ones), never GGUF, original/ or other subfolders."""
    top = [f for f in files if "/" not in f and not any(fnmatch.fnmatch(f, p) for p in NEVER)]
    if any(f.endswith(".safetensors") for f in top):
        top = [f for f in top if not any(fnmatch.fnmatch(f, p) for p in OTHER_WEIGHTS)]
    return sorted(top)


def has_weights(files) -> bool:
    return any(f.endswith((".safetensors", ".bin")) and "/" not in f for f in files)


def light_files(files) -> list[str]:
    return sorted(f for f in files if f in LIGHT)


@dataclass(frozen=True)
class Weights:
    """The checkpoint as its safetensors headers describe it."""

    params: int
    dtypes: dict[str, int]  # dtype -> parameters stored in it
    files: int

    def label(self) -> str:
        kinds = ", ".join(f"{k} {v:,}" if len(self.dtypes) > 1 else k for k, v in self.dtypes.items())
        return f"{self.params:,} params in {kinds} ({self.files} safetensors file{'s' * (self.files != 1)})"


_WEIGHTS: dict[tuple, Weights | None] = {}


def weights(found: RepoFacts) -> Weights | None:
    """The exact parameter count and dtypes from the safetensors headers alone (huggingface_hub reads only the
    headers), None when the repo has no safetensors; offline, from the cached files' headers."""
    key = (endpoint(), found.ref.repo_id, found.ref.repo_type, found.commit)
    if key in _WEIGHTS:
        return _WEIGHTS[key]
    if not any(f.endswith(".safetensors") for f in training_files(found.files)):
        return None
    counts: dict[str, int] = {}
    n_files = 0
    if found.cached_only:
        for path in snapshot(found.ref, found.commit).glob("*.safetensors"):
            header = _local_header(path)
            if header is None:
                return None
            n_files += 1
            _count(header, counts)
    else:
        from huggingface_hub import get_safetensors_metadata
        from huggingface_hub.utils import (
            are_progress_bars_disabled,
            disable_progress_bars,
            enable_progress_bars,
        )

        bars = not are_progress_bars_disabled()
        disable_progress_bars()  # its per-file bar would precede the plan on stderr
        try:
            meta = get_safetensors_metadata(
                found.ref.repo_id, repo_type=found.ref.repo_type, revision=found.commit
            )
        except Exception as exc:
            raise HubError(_why(exc, found.ref)) from None
        finally:
            if bars:
                enable_progress_bars()
        n_files = len(meta.files_metadata)
        counts = dict(meta.parameter_count)
    result = Weights(sum(counts.values()), dict(sorted(counts.items())), n_files) if counts else None
    _WEIGHTS[key] = result
    return result


def _local_header(path: Path) -> dict | None:
    """A cached file's header (core.files' one reader), None when it is not a whole safetensors file."""
    try:
        return read_safetensors_header(path).header
    except (BadFile, OSError):
        return None


def _count(header: dict, counts: dict[str, int]) -> None:
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        n = 1
        for d in entry.get("shape") or []:
            n *= int(d)
        counts[entry.get("dtype", "?")] = counts.get(entry.get("dtype", "?"), 0) + n
