"""A Hub reference (ORG/NAME[@REVISION], a model or a dataset), where the Hub is (HF_ENDPOINT), whether it may be
reached (HF_HUB_OFFLINE), where its cache lies, and the one sentence each Hub failure gets.

Settings are read from the environment at each call, the way huggingface_hub reads them when it starts, so a
test or a server started with other values sees its own. Ground layer: no torch, no transformers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from core.fmt import command

DEFAULT_ENDPOINT = "https://huggingface.co"
# huggingface_hub's rules for a repo id: ORG/NAME, letters, digits, '-', '_', '.', no '--' or '..', <= 96 chars
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# a data path with one of these endings is a file the user meant, never a dataset on the Hub
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow", ".yaml", ".yml")


class HubError(ValueError):
    """A Hub id that cannot be used (missing, gated, offline, no disk space ...); the message is one sentence."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None  # None: the default branch
    repo_type: str = "model"  # model | dataset

    @property
    def rev(self) -> str:
        return self.revision or "main"

    @property
    def kind(self) -> str:
        return "dataset" if self.repo_type == "dataset" else "model"

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id

    def at(self, commit: str) -> HubRef:
        return HubRef(self.repo_id, commit, self.repo_type)

    def page(self) -> str:
        """The repo's page on the Hub (where a gated model's licence is accepted)."""
        return f"{endpoint()}/{'datasets/' if self.repo_type == 'dataset' else ''}{self.repo_id}"


def parse(text, repo_type: str = "model", revision: str | None = None) -> HubRef | None:
    """The Hub id `text` names, or None when it is (or reads as) a local path.

    A path that exists, starts with /, ./, ../ or ~, or has more than one '/' before any '@' is local; so is a
    data path ending in a data file's suffix. Anything else of the form ORG/NAME[@REVISION] is a Hub id;
    `revision` (a --revision flag) is used when the text names none."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    if not text or text.startswith(("/", "./", "../", "~", ".\\")):
        return None
    name, sep, rev = text.partition("@")
    if sep and not rev.strip():
        return None
    if not REPO_ID.match(name) or "--" in name or ".." in name:
        return None
    if repo_type == "dataset" and name.lower().endswith(DATA_FILE_SUFFIXES):
        return None
    try:
        if Path(text).expanduser().exists():
            return None
    except OSError:
        return None
    return HubRef(name, rev.strip() if sep else revision, repo_type)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> Path:
    """huggingface_hub's cache folder: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def describe() -> str:
    """The Hub this process uses, for the sidebar and the CLIs: 'https://huggingface.co' or '... (offline)'."""
    return endpoint() + (" (offline: HF_HUB_OFFLINE=1, cached ids only)" if offline() else "")


def offline_sentence(ref: HubRef | str) -> str:
    return (
        f"{ref} is not in the local Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE=1 keeps the Hub out of "
        f"reach: download it first with HF_HUB_OFFLINE unset ({command('hub')} download {ref}), or use a local "
        "folder."
    )


def revision_sentence(ref: HubRef) -> str:
    return (
        f"the Hub at {endpoint()} has no revision '{ref.rev}' of {ref.repo_id}: give a branch, tag or commit it "
        "has (e.g. main)."
    )


def explain(exc: BaseException, ref: HubRef, filename: str | None = None) -> str:
    """One sentence for a huggingface_hub / datasets / network failure about `ref`: what, where, how to fix."""
    from huggingface_hub import errors as e

    where = f"the Hub at {endpoint()}"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    name = type(exc).__name__
    if offline() or isinstance(exc, e.OfflineModeIsEnabled):
        return offline_sentence(ref)
    if isinstance(exc, e.GatedRepoError) or status == 403:
        return (
            f"{ref} is gated ({where} refused it, {status or 403}): accept its licence on {ref.page()}, then set "
            "HF_TOKEN to a token of that account (or log in with `hf auth login`)."
        )
    if isinstance(exc, e.RevisionNotFoundError):
        return revision_sentence(ref)
    if isinstance(exc, e.RepositoryNotFoundError) or name == "DatasetNotFoundError":
        return (
            f"{where} has no {ref.kind} {ref.repo_id}"
            + (f" at revision '{ref.revision}'" if ref.revision else "")
            + ": check the id (ORG/NAME) and the revision; a private or gated one needs HF_TOKEN set to a token "
            "that can read it."
        )
    if isinstance(exc, (e.EntryNotFoundError, e.RemoteEntryNotFoundError)):
        return (
            f"{ref} has no file {filename or '(named)'} on {where}: it is not a {ref.kind} this tool can use."
        )
    if status == 401:
        return (
            f"{where} refused {ref} (401): a private or gated {ref.kind} needs HF_TOKEN set to a token that can "
            f"read it (accept the licence on {ref.page()} first)."
        )
    if isinstance(exc, e.HFValidationError):
        return f"'{ref}' is not a valid Hub id: give ORG/NAME, optionally @REVISION (e.g. Qwen/Qwen2.5-0.5B@main)."
    if isinstance(exc, e.LocalEntryNotFoundError) or any(
        w in name for w in ("Connect", "Timeout", "Network")
    ):
        return (
            f"{where} cannot be reached for {ref} ({name}): check the network and HF_ENDPOINT, or set "
            "HF_HUB_OFFLINE=1 to use only what is cached."
        )
    if status:
        return f"{where} answered {status} for {ref}: try again later, or check HF_ENDPOINT."
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else name
    return f"{ref} could not be read from {where} ({text})."
