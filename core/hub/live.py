"""Which runs of a workspace use a cached repo, so that a repo a live run trains on is never deleted under it."""

from __future__ import annotations

import os

from core import liveness, rundir
from core.files import read_yaml_mapping
from core.fmt import command
from core.hub import cache
from core.hub.ids import HubError, HubRef, parse


def uses(run_dir, ref: HubRef) -> bool:
    """The run trains on `ref`'s repo: recorded in its sources.json, or named in its config (not fetched yet)."""
    if any(isinstance(s, dict) and s.get("id") == ref.repo_id for s in rundir.read_sources(run_dir).values()):
        return True
    cfg = read_yaml_mapping(os.path.join(run_dir, rundir.CONFIG)) or {}
    for role, (section, key) in rundir.SOURCE_ROLES.items():
        value = (cfg.get(section) or {}).get(key) if isinstance(cfg.get(section), dict) else None
        named = parse(value, "dataset" if role == "data" else "model")
        if named is not None and named.repo_id == ref.repo_id and named.repo_type == ref.repo_type:
            return True
    return False


def live_users(workspace, ref: HubRef) -> list[str]:
    """The names of the workspace's live runs (their process holds the run) that use `ref`'s repo."""
    # alive as the Runs page reads it: the run's process holds its lock (a vanished one does not)
    return [d.name for d in rundir.run_folders(workspace) if liveness.live_state(d)[1] and uses(d, ref)]


def remove(workspace, ref: HubRef) -> int:
    """Delete `ref` from the cache unless a live run uses it (HubError naming the run); the bytes freed."""
    users = live_users(workspace, ref)
    if users:
        raise HubError(
            f"{ref} is used by the live run {', '.join(repr(u) for u in users)}: stop it first (Monitor: Stop, or "
            f"{command('runs')} stop {users[0]}), then delete it."
        )
    return cache.delete(ref)


def parse_or_fail(text: str, dataset: bool = False, revision: str | None = None) -> HubRef:
    ref = parse(text, "dataset" if dataset else "model", revision)
    if ref is None:
        raise HubError(
            f"'{text}' is not a Hub id: give ORG/NAME (optionally @REVISION), e.g. Qwen/Qwen2.5-0.5B"
            + (
                " (a local folder of that name exists: give the id from another folder)"
                if os.path.exists(text)
                else ""
            )
            + "."
        )
    return ref
