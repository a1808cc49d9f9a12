"""A dataset on the Hub as training rows: a streamed sample for previews and preflight (datasets' streaming: the
first SAMPLE_ROWS rows, nothing downloaded whole), or the whole split, downloaded (only the files of the chosen
subset and split, with progress) for training and read from the cache.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from core.files import atomic_write_text, quiet_datasets
from core.fmt import error_line
from core.hub.fetch import Report, complete_folder, download
from core.hub.ids import HubError, HubRef, endpoint, explain, offline, offline_sentence
from core.hub.remote import RepoFacts, cached_commit, facts, manifest_path, read_manifest

SAMPLE_ROWS = 2000
SAMPLE_NOTE = "lora-cockpit: a streamed sample"
# files datasets reads to find a repo's subsets and splits, fetched with the data files
CARD_FILES = ("README.md", ".huggingface.yaml", "dataset_infos.json")


def _subset(data_cfg: dict) -> str | None:
    return data_cfg.get("subset") or None


def _split(data_cfg: dict) -> str:
    return data_cfg.get("split") or "train"


def part(data_cfg: dict) -> str:
    return f"{_subset(data_cfg) or 'default'}/{_split(data_cfg)}"


def data_files(found: RepoFacts, data_cfg: dict) -> list[str]:
    """The repo files holding the chosen subset's split, as datasets resolves them (its builder, online)."""
    import datasets

    ref, subset, split = found.ref, _subset(data_cfg), _split(data_cfg)
    try:
        with quiet_datasets():
            builder = datasets.load_dataset_builder(ref.repo_id, name=subset, revision=found.commit)
    except ValueError as exc:
        if "BuilderConfig" in str(exc) or "config name" in str(exc).lower():
            names = _subsets(ref, found.commit)
            raise HubError(
                f"data.subset {subset!r} is not a subset of the dataset {ref.repo_id}: it has "
                f"{', '.join(names) or 'none named'}."
            ) from None
        raise HubError(f"data.path: {explain(exc, ref)}") from None
    except Exception as exc:
        raise HubError(f"data.path: {explain(exc, ref)}") from None
    files = builder.config.data_files or {}
    if split not in files:
        raise HubError(
            f"data.split {split!r} is not a split of the dataset {ref.repo_id}"
            + (f" (subset {subset})" if subset else "")
            + f": it has {', '.join(files) or 'none'}."
        )
    prefix = f"hf://datasets/{ref.repo_id}@{found.commit}/"
    names = {str(u)[len(prefix) :] for u in files[split] if str(u).startswith(prefix)}
    names |= {f for f in CARD_FILES if f in found.files}
    return sorted(names)


def _subsets(ref: HubRef, commit: str) -> list[str]:
    import datasets

    try:
        with quiet_datasets():
            return list(datasets.get_dataset_config_names(ref.repo_id, revision=commit))
    except Exception:
        return []


def fetch(
    ref: HubRef, data_cfg: dict, progress: Report | None = None, found: RepoFacts | None = None
) -> tuple[Path, RepoFacts]:
    """Download the chosen subset's split into the cache (only its files), recording it as fetched."""
    found = found or facts(ref)
    if offline():
        folder = cached_part(ref, data_cfg, found.commit)
        if folder is None:
            raise HubError(offline_sentence(ref))
        return folder, found
    folder = download(ref, progress, files=data_files(found, data_cfg), found=found)
    record = read_manifest(ref, found.commit) or {"sizes": {}}
    record["parts"] = sorted({*record.get("parts", []), part(data_cfg)})
    atomic_write_text(manifest_path(ref, found.commit), json.dumps(record, sort_keys=True))
    return folder, found


def cached_part(ref: HubRef, data_cfg: dict, commit: str | None = None) -> Path | None:
    """The cached snapshot when the chosen subset's split was downloaded there whole."""
    commit = commit or cached_commit(ref)
    folder = complete_folder(ref, commit) if commit else None
    if folder is None:
        return None
    record = read_manifest(ref, commit) or {}
    return folder if part(data_cfg) in record.get("parts", []) else None


def load(ref: HubRef, data_cfg: dict):
    """The rows of `ref`'s chosen subset and split: all of them when downloaded (or downloadable offline: never),
    else a streamed sample of the first SAMPLE_ROWS rows (is_sample tells). HubError with one sentence."""
    import datasets

    commit = cached_commit(ref) if offline() else facts(ref).commit
    if commit is None:
        raise HubError(offline_sentence(ref))
    folder = cached_part(ref, data_cfg, commit)
    if folder is not None:
        try:
            with quiet_datasets():
                return datasets.load_dataset(str(folder), name=_subset(data_cfg), split=_split(data_cfg))
        except Exception as exc:
            raise HubError(
                damaged(exc, f"{ref.repo_id} @ {commit[:7]}", data_cfg)
                or f"data.path: the cached copy of {ref.repo_id} @ {commit[:7]} does not load ({error_line(exc)})."
            ) from None
    if offline():
        raise HubError(offline_sentence(ref))
    return sample(ref.at(commit), data_cfg)


_SAMPLES: dict[tuple, object] = {}  # a commit's rows never change: a page's redraws stream them once


def sample(ref: HubRef, data_cfg: dict, n: int = SAMPLE_ROWS):
    """The first `n` rows, streamed (datasets' streaming: only what they take is read)."""
    import datasets

    found = facts(ref)
    key = (endpoint(), ref.repo_id, found.commit, _subset(data_cfg), _split(data_cfg), n)
    if key in _SAMPLES:
        return _SAMPLES[key]
    data_files(found, data_cfg)  # a wrong subset or split, said in the run config's words
    try:
        with quiet_datasets():
            stream = datasets.load_dataset(
                ref.repo_id,
                name=_subset(data_cfg),
                split=_split(data_cfg),
                revision=found.commit,
                streaming=True,
            ).decode(False)  # images stay bytes: a broken one is a preflight finding, not a failed stream
            rows = list(itertools.islice(stream, n))
    except Exception as exc:
        raise HubError(damaged(exc, found.label(), data_cfg) or f"data.path: {explain(exc, ref)}") from None
    if not rows:
        raise HubError(f"data.path: the dataset {found.label()} has no rows in {part(data_cfg)}.")
    info = datasets.DatasetInfo(
        description=f"{SAMPLE_NOTE} of the first {len(rows)} rows of {found.label()}",
        features=stream.features,
    )
    if len(_SAMPLES) >= 8:
        _SAMPLES.pop(next(iter(_SAMPLES)))
    _SAMPLES[key] = datasets.Dataset.from_list(rows, features=stream.features, info=info)
    return _SAMPLES[key]


def damaged(exc: BaseException, label: str, data_cfg: dict) -> str | None:
    """The sentence for a data file the reader cannot parse (a parquet cut short, garbage bytes): the file's
    fault, not the Hub's, whatever wraps the reader's error (datasets' own generation error)."""
    import pyarrow as pa

    seen, cause = 0, exc
    while cause is not None and seen < 8 and not isinstance(cause, pa.ArrowException):
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    if not isinstance(cause, pa.ArrowException):
        return None
    return (
        f"data.path: a data file of the dataset {label} ({part(data_cfg)}) cannot be read ({error_line(cause, 160)}): "
        "it is damaged or cut short; fix it on the Hub, or pin a revision where it reads (ORG/NAME@REVISION)."
    )


def is_sample(ds) -> str | None:
    """'a streamed sample of the first N rows of ORG/NAME @ abc1234' for a sample, else None."""
    text = getattr(getattr(ds, "info", None), "description", None) or ""
    return text.removeprefix("lora-cockpit: ") if text.startswith(SAMPLE_NOTE) else None
