"""The Hugging Face cache you can see: every cached model and dataset with its size, revisions and last use (from
huggingface_hub's own cache scan), and deleting one (core.hub.live refuses what a live run uses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.fmt import command
from core.hub.fetch import complete_folder
from core.hub.ids import HubError, HubRef, cache_dir


@dataclass(frozen=True)
class CachedRevision:
    commit: str
    refs: tuple[str, ...]  # branches and tags that pointed at it when fetched
    size_bytes: int
    complete: bool  # every file its download listed is there (a killed download: False)


@dataclass(frozen=True)
class CachedRepo:
    repo_id: str
    repo_type: str
    size_bytes: int
    last_used: float  # the newest access time of its files
    last_modified: float
    path: Path
    revisions: tuple[CachedRevision, ...] = field(default_factory=tuple)

    def label(self) -> str:
        revs = ", ".join(
            f"{'/'.join(r.refs) + ' ' if r.refs else ''}@ {r.commit[:7]}{'' if r.complete else ' (partial)'}"
            for r in self.revisions
        )
        return f"{self.repo_id} {revs}".strip()


def scan():
    """huggingface_hub's HFCacheInfo of the cache folder (an empty one when there is no cache yet)."""
    from huggingface_hub import scan_cache_dir

    root = cache_dir()
    if not root.is_dir():
        return None
    try:
        return scan_cache_dir(root)
    except Exception as exc:  # CacheNotFound, an unreadable folder
        raise HubError(f"The Hugging Face cache {root} cannot be read ({exc}).") from None


def list_cached() -> list[CachedRepo]:
    """Every cached repo, newest use first."""
    info = scan()
    if info is None:
        return []
    out = []
    for repo in info.repos:
        ref = HubRef(repo.repo_id, None, repo.repo_type)
        revisions = tuple(
            CachedRevision(
                rev.commit_hash,
                tuple(sorted(rev.refs)),
                rev.size_on_disk,
                complete_folder(ref, rev.commit_hash) is not None,
            )
            for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        )
        out.append(
            CachedRepo(
                repo.repo_id,
                repo.repo_type,
                repo.size_on_disk,
                repo.last_accessed,
                repo.last_modified,
                repo.repo_path,
                revisions,
            )
        )
    return sorted(out, key=lambda r: r.last_used, reverse=True)


def find(ref: HubRef) -> CachedRepo | None:
    return next((r for r in list_cached() if r.repo_id == ref.repo_id and r.repo_type == ref.repo_type), None)


def commits_of(ref: HubRef, repo: CachedRepo) -> list[str]:
    """The cached commits `ref` names: all of them without a revision, else the one its revision is."""
    if ref.revision is None:
        return [r.commit for r in repo.revisions]
    return [r.commit for r in repo.revisions if r.commit.startswith(ref.revision) or ref.revision in r.refs]


def delete(ref: HubRef) -> int:
    """Delete `ref` from the cache (every revision, or the one named); the bytes freed. HubError when it is not
    cached. Callers check first that no live run uses it (core.hub.live.remove)."""
    import shutil

    repo = find(ref)
    if repo is None:
        raise HubError(
            f"{ref} is not in the Hugging Face cache ({cache_dir()}): {command('hub')} list lists it."
        )
    commits = commits_of(ref, repo)
    if not commits:
        raise HubError(
            f"{ref.repo_id} has no cached revision '{ref.revision}'; cached: "
            + ", ".join(r.commit[:7] + (f" ({'/'.join(r.refs)})" if r.refs else "") for r in repo.revisions)
            + "."
        )
    info = scan()
    strategy = info.delete_revisions(*commits)
    freed = strategy.expected_freed_size
    strategy.execute()
    if len(commits) == len(repo.revisions) and repo.path.exists():
        shutil.rmtree(repo.path, ignore_errors=True)  # our manifests and partial files go with the repo
    return freed
