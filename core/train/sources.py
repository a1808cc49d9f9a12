"""The Hub ids a run trains on (model.path, model.reference_path, data.path), resolved to commits and fetched.

Before training, the trainer resolves each id to a commit (the Hub's answer; offline, the cache's), records them
in RUN/sources.json, downloads what the cache lacks (progress in RUN/download.json, drawn by the Monitor) and
trains on the cached folders. A resume holds to the recorded commits: another commit is refused in one sentence.
The Runs page shows each id @ its short commit.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from core.files import atomic_write_text, read_json_object
from core.hub import fetch, rows
from core.hub.ids import HubError, HubRef, parse
from core.hub.remote import facts
from core.recipe.config import ConfigError
from core.rundir import SOURCE_ROLES as ROLES
from core.rundir import SOURCES, write_status
from core.rundir import read_sources as read

DOWNLOAD = "download.json"  # the download in progress (or done) before training starts


class Fetched(dict):
    """A run config with cached folders in place of its Hub ids; `.recorded` is the config as the run records it
    (what its checkpoints say they were trained with, so that a resume compares ids, not cache paths)."""

    recorded: dict


def _fetched(local: dict, cfg: dict) -> Fetched:
    out = Fetched(local)
    out.recorded = recorded(cfg)
    return out


def recorded(cfg: dict) -> dict:
    return getattr(cfg, "recorded", cfg)


def hub_refs(cfg: dict) -> dict[str, HubRef]:
    """{role: HubRef} for each of the config's paths that is a Hub id (not a local path)."""
    out = {}
    for role, (section, key) in ROLES.items():
        ref = parse((cfg.get(section) or {}).get(key), "dataset" if role == "data" else "model")
        if ref is not None:
            out[role] = ref
    return out


def labels(run_dir) -> dict[str, str]:
    """{role: 'ORG/NAME @ abc1234'} for a run's Hub ids (empty for a run on local folders)."""
    return {
        role: f"{s.get('id')} @ {str(s.get('commit'))[:7]}"
        for role, s in read(run_dir).items()
        if isinstance(s, dict) and s.get("id")
    }


def check_resume(run_dir, cfg: dict) -> None:
    """A resume on other commits than the run trained on: HubError naming the recorded one (before the run
    folder is touched)."""
    recorded = read(run_dir)
    for role, ref in hub_refs(cfg).items():
        old = recorded.get(role)
        if not isinstance(old, dict) or not old.get("commit"):
            continue
        found = facts(ref)
        if found.commit != old["commit"] or found.ref.repo_id != old.get("id"):
            section, key = ROLES[role]
            raise HubError(
                f"--resume: {section}.{key} {ref} is now {found.ref.repo_id} @ {found.short}, but this run trained on "
                f"{old.get('id')} @ {old['commit'][:7]}: set {section}.{key}: {old.get('id')}@{old['commit']} in "
                "the run config to resume, or train the new commit as a new run."
            )


def fetch_for_run(cfg: dict, run_dir, log=None) -> dict:
    """Resolve, record and download the config's Hub ids; the config with the cached folders in their place
    (model paths: the snapshot folder; data: the id at its commit, read whole from the cache)."""
    refs = hub_refs(cfg)
    if not refs:
        return cfg
    log = log or (lambda line: print(line, flush=True))
    run_dir = Path(run_dir)
    resolved = {role: facts(ref) for role, ref in refs.items()}
    record = {
        role: {"id": f.ref.repo_id, "revision": f.ref.rev, "commit": f.commit, "type": f.ref.repo_type}
        for role, f in resolved.items()
    }
    atomic_write_text(run_dir / SOURCES, json.dumps(record, indent=1))
    local = copy.deepcopy(cfg)
    for role, found in resolved.items():
        section, key = ROLES[role]
        log(f"hub: {section}.{key} {refs[role]} is {found.label()}")
        report = _reporter(run_dir, role, log)
        if role == "data":  # the commit recorded above, whatever the branch says meanwhile
            rows.fetch(found.ref, cfg["data"], report, found)
            local["data"]["path"] = f"{found.ref.repo_id}@{found.commit}"
        else:
            local[section][key] = str(fetch.local_model(found.ref, report, found))
    return _fetched(local, cfg)


def pinned(cfg: dict, run_dir) -> dict:
    """The config with the recorded commits' cached folders in place of its Hub ids (a rank of a run on several
    processes: its supervisor fetched them)."""
    recorded = read(run_dir)
    local = copy.deepcopy(cfg)
    for role, ref in hub_refs(cfg).items():
        commit = (recorded.get(role) or {}).get("commit")
        if not commit:
            continue
        section, key = ROLES[role]
        if role == "data":
            local["data"]["path"] = f"{ref.repo_id}@{commit}"
            continue
        folder = fetch.complete_folder(ref, commit)
        if folder is None:
            raise HubError(
                f"{ref.repo_id} @ {commit[:7]} is no longer complete in the cache: run the run again."
            )
        local[section][key] = str(folder)
    return _fetched(local, cfg)


def _reporter(run_dir: Path, role: str, log):
    last = [0.0]

    def report(p: dict) -> None:
        atomic_write_text(run_dir / DOWNLOAD, json.dumps({**p, "role": role, "time": time.time()}))
        now = time.monotonic()
        if p.get("final") or now - last[0] >= 10:  # stdout.log: a line every 10 s, not a bar
            last[0] = now
            log(f"hub: {p['repo']} {fetch.progress_line(p)}")

    return report


def read_download(run_dir) -> dict | None:
    """The run's download progress (download.json), for the Monitor."""
    return read_json_object(Path(run_dir) / DOWNLOAD)


def download_line(p: dict) -> str:
    return f"Downloading {p.get('repo')} @ {str(p.get('commit'))[:7]}: {fetch.progress_line(p)}"


def refuse_other_commits(run_dir, cfg: dict) -> None:
    """check_resume, as the trainer's ConfigError (said before the run folder is touched)."""
    try:
        check_resume(run_dir, cfg)
    except HubError as exc:
        raise ConfigError(str(exc)) from None


def for_training(cfg: dict, run_dir) -> dict:
    """fetch_for_run in the trainer: the run's status says it is fetching; a Hub failure is the run's
    ConfigError (one sentence, exit 2)."""
    if not hub_refs(cfg):
        return cfg
    write_status(run_dir, reason="fetching its Hub model and data (progress: download.json)")
    try:
        local = fetch_for_run(cfg, run_dir)
    except HubError as exc:
        raise ConfigError(str(exc)) from None
    write_status(run_dir, reason=None)
    return local


def for_evaluation(cfg: dict, run_dir) -> dict:
    """The run's config with its Hub ids at the commits it trained on (sources.json), fetched when the cache lacks
    them: the base an evaluation loads and the held-out rows it reads are the run's own."""
    recorded = read(run_dir)
    local = copy.deepcopy(cfg)
    for role, ref in hub_refs(cfg).items():
        commit = (recorded.get(role) or {}).get("commit")
        at = ref.at(commit) if commit else ref
        section, key = ROLES[role]
        if role == "data":
            _, found = rows.fetch(at, cfg["data"])
            local["data"]["path"] = f"{ref.repo_id}@{found.commit}"
        else:
            local[section][key] = str(fetch.local_model(at))
    return _fetched(local, cfg)
