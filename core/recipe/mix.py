"""Several data sources mixed into one run's data (`data.sources`, `data.mix`; their keys: core.recipe.mix_config).

Each source goes through its method's own loader first, exactly as a single `data.path` does (SFT: its format's
rows tokenized with the prompt masked; DPO: prompt/chosen/rejected pairs; ...), so sources of different formats
meet as the method's common columns. Then `datasets` draws the mix itself: `shuffle` + `select` for `rows`
(without replacement), `select` of seeded indices with replacement, `concatenate_datasets` or
`interleave_datasets(probabilities=weights, seed, stopping_strategy)`; data.eval_split is held out of the mix
afterwards, as for one source. What was drawn (rows per source into train and eval, the seed, the rule, each
source's Hub commit or file fingerprint) is the record the trainer writes to RUN/mix.json.
"""

from __future__ import annotations

import copy
import hashlib
from collections import Counter
from pathlib import Path

from core import rundir
from core.files import read_json_object
from core.hub import ids as hub_ids
from core.recipe.data import DataError, _as_paths, load_rows, split_eval
from core.recipe.findings import Finding
from core.recipe.mix_config import SOURCE_KEYS, source_name, sources, strategy, where

SOURCE_COLUMN = "mix_source"  # each row's source index while the mix is drawn; dropped before training
FINGERPRINT_BYTES = 1 << 20  # a file's fingerprint hashes its first MiB (with its size and mtime)
_DEFAULTS = {"subset": None, "format": "auto", "columns": {}, "split": "train"}


def source_config(cfg: dict, src: dict) -> dict:
    """The run config as if `src` were its one data.path: the method's loader and preflight read it unchanged.
    Nothing is held out of a source (the mix's eval rows are held out of the mix)."""
    data = {k: v for k, v in cfg["data"].items() if k not in ("sources", "mix")}
    data.update({k: copy.deepcopy(src.get(k, _DEFAULTS.get(k))) for k in SOURCE_KEYS})
    data["eval_split"] = 0.0
    return {**cfg, "data": data}


def seed_of(cfg: dict) -> int:
    mix = cfg["data"].get("mix") or {}
    return int(mix["seed"]) if mix.get("seed") is not None else int(cfg["training"]["seed"])


def _strip(text: str) -> str:
    """A loader's sentence without its own 'data.path: ' lead (the source's name replaces it)."""
    for lead in ("data.path: ", "data.path ", "data: "):
        if text.startswith(lead):
            return text[len(lead) :]
    return text


# ---- preflight: every source read and checked before anything is written ---------------------------------------


def findings(cfg: dict, method, tokenizer=None, model_config=None, in_trainer: bool = False) -> list[Finding]:
    """The mix's own findings (a source missing, of another method's data, smaller than its rows without
    replacement), then each source's method preflight, each message led by the source's name."""
    from core.hub.rows import is_sample

    out: list[Finding] = []
    for i, src in enumerate(sources(cfg["data"])):
        here, scfg = where(i, src), source_config(cfg, src)
        try:
            rows = load_rows(scfg["data"])
        except DataError as exc:
            out.append(Finding("error", "sources", f"{here}: {_strip(str(exc))}", ""))
            continue
        problem = method.check_columns(scfg["data"])
        if problem:
            out.append(Finding("error", "sources", _other_method(here, scfg["data"], method, problem), ""))
            continue
        n = src.get("rows")
        if n and not src.get("replace") and not is_sample(rows) and n > len(rows):
            out.append(
                Finding(
                    "error",
                    "sources",
                    f"{here}: rows {n} is more than the {len(rows)} rows it has, and rows are drawn without "
                    "replacement: lower rows, or set replace: true.",
                    "",
                )
            )
            continue
        for f in method.preflight(scfg, tokenizer, model_config, in_trainer):
            out.append(Finding(f.level, f.check, f"{here}: {f.message}", f.fix, f.rows))
    return out


def _other_method(here: str, data: dict, method, problem: str) -> str:
    """A source that does not read as this method's data: which method's data it is, when another reads it."""
    from core.recipe import methods

    for other in methods.REGISTRY.values():
        if other.name == method.name:
            continue
        try:
            fits = other.check_columns(data) is None
        except Exception:  # another method's loader on foreign rows: it just does not fit
            fits = False
        if fits:
            return (
                f"{here}: its rows are {other.label} data ({other.data_noun}), not {method.label} data "
                f"({method.summary}): give it to a method: {other.name} run, or map its columns with columns."
            )
    return f"{here}: {_strip(problem)}"


# ---- the draw ----------------------------------------------------------------------------------------------------


def _pinned(here: str, scfg: dict) -> tuple[dict, dict | None]:
    """A Hub source fetched whole at the commit its revision names now (a mix is never drawn from a streamed
    sample); (its config at that commit, {"id", "revision", "commit"}), or unchanged with None for local files."""
    ref = hub_ids.parse(scfg["data"]["path"], "dataset")
    if ref is None:
        return scfg, None
    from core.hub import rows

    try:
        _, found = rows.fetch(ref, scfg["data"])
    except hub_ids.HubError as exc:
        raise DataError(f"{here}: {exc}") from None
    pinned = {**scfg, "data": {**scfg["data"], "path": f"{found.ref.repo_id}@{found.commit}"}}
    return pinned, {"id": found.ref.repo_id, "revision": ref.rev, "commit": found.commit}


def _take(ds, src: dict, seed: int, here: str):
    """The rows drawn of one source: all of them, or `rows` of them (shuffled then cut, or seeded indices with
    replacement)."""
    n = src.get("rows")
    if not n:
        return ds
    if src.get("replace"):
        import numpy as np

        return ds.select(np.random.default_rng(seed).integers(0, len(ds), size=n).tolist())
    if n > len(ds):
        raise DataError(
            f"{here}: rows {n} is more than the {len(ds)} rows it has, and rows are drawn without replacement: "
            "lower rows, or set replace: true."
        )
    return ds.shuffle(seed=seed).select(range(n))


def _kind(feature) -> str:
    import datasets

    if isinstance(feature, datasets.Value):
        return "texts" if feature.dtype in ("string", "large_string") else f"{feature.dtype} values"
    if isinstance(feature, (list, datasets.Sequence)) or type(feature).__name__ in ("List", "LargeList"):
        return "lists (messages)"
    return type(feature).__name__


def _cannot_mix(parts: list, listed: list[dict], method) -> str | None:
    """Why two sources' rows cannot share one dataset, after each went through its format's conversion: a column
    one has and the other lacks, or the same column holding texts in one and message lists in the other (an Arrow
    column holds one type, and the trainer formats every row the same way)."""
    first = parts[0].features
    for i, part in enumerate(parts[1:], 1):
        here, there = where(i, listed[i]), where(0, listed[0])
        if set(part.features) != set(first):
            return (
                f"{here} cannot be mixed with {there}: as {method.label} rows it has the columns "
                f"{', '.join(sorted(set(part.features) - {SOURCE_COLUMN}))} where {there} has "
                f"{', '.join(sorted(set(first) - {SOURCE_COLUMN}))}: give both the same columns (columns maps them)."
            )
        for col in first:
            if part.features[col] != first[col] and _kind(part.features[col]) != _kind(first[col]):
                return (
                    f"{here} cannot be mixed with {there}: its {col} are {_kind(part.features[col])} where "
                    f"{there}'s are {_kind(first[col])}, and one dataset column holds one type ({method.trainer_name} "
                    "formats every row alike): convert one source to the other's format."
                )
    return None


def combine(parts: list, cfg: dict) -> tuple:
    """(the mix, {"strategy", "seed", ...}): the sources' drawn rows concatenated or interleaved by their weights
    with the mix's seed and stopping rule (datasets' own concatenate_datasets / interleave_datasets)."""
    import datasets

    listed, seed = sources(cfg["data"]), seed_of(cfg)
    rule = strategy(cfg["data"])
    record = {"strategy": rule, "seed": seed}
    if rule != "interleave":
        return datasets.concatenate_datasets(parts), record
    weights = [s.get("weight") for s in listed]
    probabilities = [w / sum(weights) for w in weights] if all(weights) else None
    stop = (cfg["data"].get("mix") or {}).get("stopping_strategy") or "first_exhausted"
    mixed = datasets.interleave_datasets(
        parts, probabilities=probabilities, seed=seed, stopping_strategy=stop
    )
    record.update(stopping_strategy=stop, probabilities=probabilities)
    return mixed, record


def draw(cfg: dict, tokenizer, method) -> tuple:
    """(train, eval or None, record): the sources loaded by the method, drawn and mixed with the mix's seed, and
    data.eval_split held out of the mix with training.seed. DataError names the source of a problem."""
    listed, seed = sources(cfg["data"]), seed_of(cfg)
    parts, entries = [], []
    for i, src in enumerate(listed):
        here = where(i, src)
        scfg, hub = _pinned(here, source_config(cfg, src))
        try:
            ds, _ = method.datasets(scfg, tokenizer)
        except DataError as exc:
            raise DataError(f"{here}: {_strip(str(exc))}") from None
        available = len(ds)
        ds = _take(ds, src, seed + i, here)  # seed + i: two equal sources are not cut alike
        parts.append(ds.add_column(SOURCE_COLUMN, [i] * len(ds)))
        entry = {
            "source": source_name(src),
            **{
                k: src[k]
                for k in ("path", "subset", "split", "format", "weight", "rows", "replace")
                if k in src
            },
            "available": available,
        }
        entry.update({"hub": hub} if hub else {"files": fingerprints(scfg["data"]["path"])})
        entries.append(entry)
    problem = _cannot_mix(parts, listed, method)
    if problem:
        raise DataError(problem)
    mixed, record = combine(parts, cfg)
    train, evaluation = split_eval(mixed, cfg)
    in_train = Counter(train[SOURCE_COLUMN])
    in_eval = Counter(evaluation[SOURCE_COLUMN]) if evaluation is not None else Counter()
    if evaluation is not None:  # held-out rows grouped by source, in the sources' order: eval_parts cuts them
        held = evaluation[SOURCE_COLUMN]
        evaluation = evaluation.select([k for i in range(len(listed)) for k, s in enumerate(held) if s == i])
    for i, (entry, name) in enumerate(zip(entries, eval_names(listed), strict=True)):
        entry.update(drawn=in_train[i] + in_eval[i], train=in_train[i], eval=in_eval[i])
        if in_eval[i]:
            entry["eval_metric"] = f"eval_{name}_loss"  # the per-source eval loss in metrics.jsonl
    record.update(
        eval_split=cfg["data"]["eval_split"],
        eval_seed=cfg["training"]["seed"],
        train_rows=len(train),
        eval_rows=len(evaluation) if evaluation is not None else 0,
        sources=entries,
    )
    train = train.remove_columns(SOURCE_COLUMN)
    evaluation = evaluation.remove_columns(SOURCE_COLUMN) if evaluation is not None else None
    return train, evaluation, record


def eval_names(listed: list[dict]) -> list[str]:
    """Each source's name in its eval metrics (eval_<name>_loss): its file's stem or Hub id, lower case, other
    characters than letters and digits as _, made unique with its index where two sources share one."""
    import re

    names = [
        re.sub(r"[^a-z0-9]+", "_", Path(source_name(s)).stem.lower()).strip("_") or "source" for s in listed
    ]
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def eval_parts(evaluation, record: dict | None) -> dict | None:
    """{name: that source's held-out rows} of a mix's eval rows as draw grouped them (the trainer evaluates
    each, logging eval_<name>_loss beside the overall eval_loss), or None: one data.path, no held-out rows, or
    fewer than two sources holding some."""
    if evaluation is None or not record or not isinstance(record.get("sources"), list):
        return None
    parts, start = {}, 0
    for entry in record["sources"]:
        n = entry.get("eval", 0)
        if n:
            parts[entry["eval_metric"][len("eval_") : -len("_loss")]] = evaluation.select(
                range(start, start + n)
            )
        start += n
    return parts if len(parts) > 1 and start == len(evaluation) else None


# ---- what was drawn from ------------------------------------------------------------------------------------------


def fingerprints(path) -> list[dict]:
    """Each local file of a source (a folder's files, at most 50): its size, mtime and the sha256 of its first MiB,
    enough to tell whether a rerun reads the same data without hashing gigabytes."""
    files: list[Path] = []
    for p in _as_paths(path):
        files += sorted(f for f in p.rglob("*") if f.is_file())[:50] if p.is_dir() else [p]
    out = []
    for f in files[:50]:
        try:
            st = f.stat()
            with open(f, "rb") as fh:
                head = hashlib.sha256(fh.read(FINGERPRINT_BYTES)).hexdigest()
        except OSError:
            continue
        out.append(
            {"path": str(f.resolve()), "size": st.st_size, "mtime": st.st_mtime, "sha256_first_mib": head}
        )
    return out


def record_lines(record: dict) -> list[str]:
    """One line per source of a recorded mix (RUN/mix.json), for `runs show`."""
    if not isinstance(record, dict) or not isinstance(record.get("sources"), list):
        return []
    rule = record.get("strategy", "?")
    if rule == "interleave":
        rule += f", {record.get('stopping_strategy', '?')}"
    lines = [
        f"  mix          {rule}, seed {record.get('seed', '?')}: {record.get('train_rows', '?')} train rows, "
        f"{record.get('eval_rows', 0)} eval rows"
    ]
    for i, s in enumerate(record["sources"]):
        if not isinstance(s, dict):
            continue
        share = (
            f"weight {s['weight']}"
            if "weight" in s
            else f"rows {s['rows']}{' with replacement' if s.get('replace') else ''}"
            if "rows" in s
            else "all rows"
        )
        hub = s.get("hub") if isinstance(s.get("hub"), dict) else None
        files = s.get("files") if isinstance(s.get("files"), list) else []
        origin = (
            f"{hub.get('id')} @ {str(hub.get('commit'))[:7]}"
            if hub
            else f"sha256 {str(files[0].get('sha256_first_mib'))[:12]}"
            if files and isinstance(files[0], dict)
            else "?"
        )
        lines.append(
            f"  source {i}     {s.get('source', '?')}: {share}, {s.get('drawn', '?')} of {s.get('available', '?')} "
            f"rows drawn (train {s.get('train', '?')}, eval {s.get('eval', '?')}), {origin}"
        )
    return lines


def drawn_lines(run_dir) -> list[str]:
    """A run folder's recorded mix (RUN/mix.json) as record_lines gives it; [] for a run of one source or a
    record that cannot be read (a page showing it never breaks on one run's files)."""
    return record_lines(read_json_object(Path(run_dir) / rundir.MIX) or {})
