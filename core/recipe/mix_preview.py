"""The data of a run as the Train page and the planner see it before training, a mix of data.sources included
(issue #50 item 4): each source's row count, format and first rows, and the token lengths of the rows the mix
draws, for the length histogram and the planner's batch of real rows (`core.estimate --data-lengths`).

The mix's lengths come from the mix's own draw (core.recipe.mix.combine: datasets' interleave / concatenate with
its weights, rows, seed and stopping rule) over the sources' row numbers, so a source weighted 3 is three times
as present in the histogram as one weighted 1, whatever their sizes; at most `length_rows` of the drawn rows,
picked with the mix's seed, are tokenized. Row counts are those read (a Hub source not downloaded yet: its
streamed sample), before the method drops a row it cannot train on.
"""

from __future__ import annotations

from core.recipe import methods
from core.recipe.data import (
    IGNORE_INDEX,
    DataError,
    detect_format,
    load_rows,
    missing_columns,
    preview_dataset,
    row_segments,
    tokenize_row,
)
from core.recipe.mix import _strip, _take, combine, seed_of, source_config
from core.recipe.mix_config import source_name, sources, where


def run_preview(cfg: dict, tokenizer, model_config=None, n: int = 5, length_rows: int = 5000) -> dict:
    """core.recipe.vision_checks.run_preview for one data.path (its rows, lengths, format), preview for a mix."""
    from core.recipe import vision, vision_checks

    if sources(cfg["data"]) and model_config is not None and vision.is_vlm(model_config):
        # the mix's lengths are text tokens; images would need each source's processor view
        raise DataError(
            "a mix of image conversations is not previewed here yet (it trains, and preflight checks each "
            "source): give one source as data.path to preview its rows and images."
        )
    if sources(cfg["data"]):
        return preview(cfg, tokenizer, n=n, length_rows=length_rows)

    return vision_checks.run_preview(cfg, tokenizer, model_config, n=n, length_rows=length_rows)


def row_count(data: dict) -> int:
    """The rows of one data.path, or of every source of a mix together (as read: before any draw)."""
    listed = sources(data)
    if not listed:
        return len(load_rows(data))
    cfg = {"data": data}
    return sum(len(load_rows(source_config(cfg, src)["data"])) for src in listed)


def source_summary(cfg: dict, i: int, tokenizer, n: int = 3) -> dict:
    """One source as the Train page lists it: {"source", "where", "rows", "format", "sample", "preview": its
    first n rows, "problem": one sentence or None}."""
    src = sources(cfg["data"])[i]
    here, data = where(i, src), source_config(cfg, src)["data"]
    out = {"source": source_name(src), "where": here, "rows": None, "format": None, "sample": False}
    out.update(preview=[], problem=None)
    method = methods.get(cfg)
    try:
        shown = method.preview(data, n=n, specs=cfg.get("rewards"))
        if shown is not None:  # a preference or prompt method's view of its rows
            out["rows"], out["preview"] = shown
            out["format"] = method.name
            return out
        pv = preview_dataset(data, tokenizer, n=n, length_rows=0, max_length=cfg["training"]["max_length"])
    except (DataError, OSError, ValueError) as exc:
        out["problem"] = f"{here}: {_strip(str(exc))}"
        return out
    out.update(rows=pv["total_rows"], format=pv["format"], sample=bool(pv.get("sample")), preview=pv["rows"])
    return out


def data_preview(cfg: dict, tokenizer, n: int, length_rows: int, max_length: int) -> dict:
    """core.recipe.data.preview_dataset of the config's data, a mix of data.sources included (the planner's rows:
    core.estimate --data-lengths)."""
    if sources(cfg["data"]):
        return preview(cfg, tokenizer, n=n, length_rows=length_rows, max_length=max_length)
    return preview_dataset(cfg["data"], tokenizer, n=n, length_rows=length_rows, max_length=max_length)


def preview(cfg: dict, tokenizer, n: int = 5, length_rows: int = 5000, max_length: int | None = None) -> dict:
    """A mix as preview_dataset shows one source: {"format": "mix", "rows": the mix's first n rows (each with its
    source), "lengths" (SFT: of at most length_rows drawn rows), "max_length", "truncated", "total_rows": rows the
    mix draws, "sample", "sources": each source's {"source", "rows", "format", "drawn"}}. DataError names the
    source of a problem."""
    import datasets
    import numpy as np

    listed, seed = sources(cfg["data"]), seed_of(cfg)
    max_length = max_length or cfg["training"]["max_length"]
    sft = methods.get(cfg).reads_text_formats  # token lengths and masking: the others have views of their own
    raws, formats, parts, summaries = [], [], [], []
    for i, src in enumerate(listed):
        here, data = where(i, src), source_config(cfg, src)["data"]
        try:
            ds = load_rows(data)
            fmt = detect_format(ds.column_names, data.get("format", "auto")) if sft else methods.get(cfg).name
        except (DataError, OSError, ValueError) as exc:
            raise DataError(f"{here}: {_strip(str(exc))}") from None
        missing = missing_columns(ds.column_names, fmt) if sft else []
        if missing:
            raise DataError(
                f"{here}: format {fmt} needs the columns {', '.join(missing)} (have {', '.join(ds.column_names)})."
            )
        raws.append(ds)
        formats.append(fmt)
        index = datasets.Dataset.from_dict({"s": [i] * len(ds), "r": list(range(len(ds)))})
        parts.append(_take(index, src, seed + i, here))  # as draw takes them: seed + i
        summaries.append({"source": source_name(src), "rows": len(ds), "format": fmt})
    picks, _ = combine(parts, cfg)  # (source, row) of each drawn row, in the draw's order
    drawn = np.bincount(np.asarray(picks["s"], dtype=np.int64), minlength=len(listed))
    for summary, count in zip(summaries, drawn, strict=True):
        summary["drawn"] = int(count)

    def shown(k: int) -> dict:
        s, r = picks[k]["s"], picks[k]["r"]
        row, fmt = raws[s][r], formats[s]
        segs = row_segments(row, fmt, tokenizer)
        enc = tokenize_row(row, fmt, tokenizer, max_length, cfg["data"].get("mask_prompt", True))
        return {
            "row": k + 1,
            "source": summaries[s]["source"],
            "prompt": "".join(t for t, trainable in segs if not trainable),
            "completion": "".join(t for t, trainable in segs if trainable),
            "n_tokens": enc["length"],
            "n_trained": sum(label != IGNORE_INDEX for label in enc["labels"]),
        }

    lengths: list[int] = []
    if sft and len(picks):
        chosen = np.arange(len(picks))
        if len(picks) > length_rows:  # a sample of the drawn rows, with the mix's seed
            chosen = np.sort(np.random.default_rng(seed).choice(len(picks), length_rows, replace=False))
        which = picks.select(chosen.tolist())
        for i, ds in enumerate(raws):
            rows = [r for s, r in zip(which["s"], which["r"], strict=True) if s == i]
            lengths += [
                tokenize_row(row, formats[i], tokenizer, max_length)["length"] for row in ds.select(rows)
            ]
    from core.hub.rows import is_sample

    return {
        "format": "mix",
        "rows": [shown(k) for k in range(min(n, len(picks)))] if sft else [],
        "lengths": lengths,
        "max_length": max_length,
        "truncated": sum(t > max_length for t in lengths),
        "total_rows": len(picks),
        "sample": any(is_sample(ds) for ds in raws),
        "sources": summaries,
    }
