"""`data.sources` and `data.mix` of a run config: several datasets mixed into one, each source described by the same
keys as a single `data.path` (path, subset, format, columns, split; a Hub id's revision is its `@REV`), plus how
much of it to draw: a `weight` (its share of an interleaved mix) or `rows` (how many, `replace` to draw with
replacement). `data.mix`: `strategy` (concat / interleave), `stopping_strategy` (datasets' own names:
first_exhausted / all_exhausted) and `seed` (default: training.seed).

Only the shape of the config is checked here (core.recipe.config_combos asks); what needs the data read (a source
that is missing, of another method's format, smaller than its `rows`) is core.recipe.mix's preflight.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

# the keys a source shares with data (one description of a source: core.recipe.data.load_rows reads them)
SOURCE_KEYS = ("path", "subset", "format", "columns", "split")
DRAW_KEYS = ("weight", "rows", "replace")
STRATEGIES = ("concat", "interleave")
STOPPING = ("first_exhausted", "all_exhausted")  # datasets.interleave_datasets' stopping_strategy
MIX_KEYS = ("strategy", "stopping_strategy", "seed")
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")


def sources(data: dict) -> list[dict] | None:
    """The config's sources, or None for a run on one data.path."""
    return data.get("sources") or None


def source_name(src: Any) -> str:
    """How a sentence names a source: its file's name, or its Hub id as written."""
    path = src.get("path") if isinstance(src, dict) else None
    if isinstance(path, list):
        path = path[0] if path else None
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        return "no path"
    text = str(path).strip()
    local = text.startswith(("/", ".", "~")) or Path(text).suffix.lower() in DATA_SUFFIXES
    return Path(text).name if local or Path(text).expanduser().exists() else text  # a Hub id as written


def where(i: int, src: Any) -> str:
    """'data.sources[2] (domain.jsonl)': the words every sentence about a source starts with."""
    return f"data.sources[{i}] ({source_name(src)})"


def strategy(data: dict) -> str:
    """The mix's strategy: as given, else interleave when the sources have weights, concat otherwise."""
    mix = data.get("mix") or {}
    if mix.get("strategy"):
        return mix["strategy"]
    return "interleave" if any("weight" in s for s in sources(data) or []) else "concat"


def source_problem(i: int, src: Any, method) -> str | None:
    """One sentence for what is wrong with one source's keys, or None."""
    here = where(i, src)
    if not isinstance(src, dict):
        return f"data.sources[{i}] must be a mapping such as {{path: domain.jsonl, weight: 1}} (got {src!r})."
    for key in src:
        if key not in SOURCE_KEYS + DRAW_KEYS:
            near = difflib.get_close_matches(str(key), SOURCE_KEYS + DRAW_KEYS, n=1, cutoff=0.6)
            hint = (
                f" Did you mean {near[0]}?"
                if near
                else f" A source takes {', '.join(SOURCE_KEYS + DRAW_KEYS)}."
            )
            return f"{here}: unknown key {key}.{hint}"
    path = src.get("path")
    ok = (isinstance(path, str) and path.strip()) or (
        isinstance(path, list) and path and all(isinstance(p, str) and p.strip() for p in path)
    )
    if not ok:
        return f"{here}: path is required: a .jsonl/.json/.csv/.parquet file, a save_to_disk folder or a Hub dataset id."
    fmt = src.get("format", "auto")
    if fmt != "auto" and fmt not in method.formats:
        return (
            f"{here}: format {fmt!r} is not a format of method {method.name} ({method.summary}): use "
            f"{', '.join(('auto', *method.formats))}."
        )
    for key in ("subset", "split"):
        if src.get(key) is not None and not (isinstance(src[key], str) and src[key].strip()):
            return f"{here}: {key} must be a name (got {src[key]!r})."
    columns = src.get("columns")
    if columns is not None and not (
        isinstance(columns, dict) and all(isinstance(v, str) and v for v in columns.values())
    ):
        return f"{here}: columns must map expected names to your columns, e.g. {{output: answer}} (got {columns!r})."
    if "weight" in src:
        w = src["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w:
            return f"{here}: weight must be a number > 0 (got {w!r})."
        if w <= 0:
            return f"{here}: weight must be > 0 (got {w})."
    if "rows" in src:
        n = src["rows"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return f"{here}: rows must be a whole number of rows, at least 1 (got {n!r})."
    if "replace" in src:
        if not isinstance(src["replace"], bool):
            return f"{here}: replace must be true or false (got {src['replace']!r})."
        if "rows" not in src:
            return f"{here}: replace says how rows are drawn: give rows too, or drop replace."
    return None


def config_problem(cfg: dict, method) -> tuple[str, str] | None:
    """(key path, one sentence) for the first problem of data.sources / data.mix, or None (also for a config on
    one data.path)."""
    data = cfg["data"]
    if "sources" not in data and "mix" not in data:
        return None
    listed = data.get("sources")
    if data.get("path") is not None and listed is not None:
        return (
            "data.sources",
            "data.path and data.sources are both set: give one data.path, or list every source (that one "
            "included) under data.sources.",
        )
    if not isinstance(listed, list) or not listed:
        return (
            "data.sources",
            "data.sources must be a non-empty list of sources, each {path, weight} or {path, rows} "
            f"(got {listed!r}).",
        )
    weights = [
        s["weight"] for s in listed if isinstance(s, dict) and isinstance(s.get("weight"), (int, float))
    ]
    if len(weights) == len(listed) and all(w == 0 for w in weights):
        return (
            "data.sources",
            "data.sources: every weight is 0, so nothing would be drawn: give each source a weight > 0.",
        )
    for i, src in enumerate(listed):
        problem = source_problem(i, src, method)
        if problem:
            return f"data.sources[{i}]", problem
    with_weight = [i for i, s in enumerate(listed) if "weight" in s]
    with_rows = [i for i, s in enumerate(listed) if "rows" in s]
    if with_weight and with_rows:
        return (
            "data.sources",
            f"data.sources: {where(with_weight[0], listed[with_weight[0]])} gives a weight and "
            f"{where(with_rows[0], listed[with_rows[0]])} gives rows: weights share a mix and rows count what is "
            "drawn, so give every source a weight, or every source rows.",
        )
    if with_weight and len(with_weight) < len(listed):
        i = next(i for i in range(len(listed)) if i not in with_weight)
        return (
            "data.sources",
            f"{where(i, listed[i])}: weight is missing: give every source a weight, or none.",
        )
    return _mix_problem(data)


def _mix_problem(data: dict) -> tuple[str, str] | None:
    mix = data.get("mix")
    if mix is None:
        return None
    if not isinstance(mix, dict):
        return (
            "data.mix",
            f"data.mix must be a mapping such as {{strategy: interleave, seed: 42}} (got {mix!r}).",
        )
    if data.get("sources") is None:
        return "data.mix", "data.mix says how data.sources are mixed: list the sources under data.sources."
    for key in mix:
        if key not in MIX_KEYS:
            near = difflib.get_close_matches(str(key), MIX_KEYS, n=1, cutoff=0.6)
            hint = f" Did you mean data.mix.{near[0]}?" if near else f" data.mix takes {', '.join(MIX_KEYS)}."
            return f"data.mix.{key}", f"data.mix.{key}: unknown key.{hint}"
    if mix.get("strategy") is not None and mix["strategy"] not in STRATEGIES:
        return (
            "data.mix.strategy",
            f"data.mix.strategy must be concat or interleave (got {mix['strategy']!r}).",
        )
    stop = mix.get("stopping_strategy")
    if stop is not None and stop not in STOPPING:
        return (
            "data.mix.stopping_strategy",
            f"data.mix.stopping_strategy must be first_exhausted (stop when a source runs out) or all_exhausted "
            f"(go on, drawing the exhausted sources again, until each has been drawn whole) (got {stop!r}).",
        )
    seed = mix.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        return "data.mix.seed", f"data.mix.seed must be a whole number, 0 or more (got {seed!r})."
    if strategy(data) == "concat" and any("weight" in s for s in data["sources"]):
        return (
            "data.mix.strategy",
            "data.mix.strategy concat takes each source whole, one after the other, so weights mean nothing there: "
            "use strategy interleave with weights, or rows per source with concat.",
        )
    return None
