"""One evaluation from start to stored result: the target, its held-out rows, one model load with the adapter off
(the base) and on (the tuned model), greedy answers and answer losses, scores, and the result folder.

<run>/eval/<name>/ holds settings.json (exactly what was asked: target, data, rows, tokens, library versions),
rows.jsonl (per row: the prompt, the reference, both answers and their scores) and summary.json (the means and
the `eval: <metric> B -> A` lines). An evaluation asked again with the same settings is read back, not redone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core import generate
from core.eval import images, scores
from core.eval.heldout import (
    CLI_DATA,
    DataInput,
    EvalError,
    EvalRow,
    file_rows,
    method_rows,
    run_format,
    split_rows,
)
from core.eval.results import EVAL_DIR, ROWS, SETTINGS, SUMMARY, Result, read_result
from core.eval.target import Target, resolve
from core.files import atomic_write_text
from core.recipe import methods, vision

DEFAULT_BATCH = 32
Progress = Callable[..., None]


@dataclass
class Settings:
    what: str
    base: str
    tuned: str
    data: str  # "the run's eval split" or a file path
    kind: str  # the method's eval_kind: answers, pairs, rated, rewards
    limit: int | None = None
    max_new_tokens: int | None = None
    batch_size: int = DEFAULT_BATCH
    device: str = "cpu"
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)


def eval_root(target: Target) -> Path:
    if target.run_dir is not None:
        return target.run_dir / EVAL_DIR
    return Path(target.adapter or target.model) / EVAL_DIR


def default_name(data: str | None, target: Target) -> str:
    stem = Path(data).stem if data else "eval-split"
    return f"{stem}-{target.what.replace(' ', '-')}" if target.what not in ("adapter", "model") else stem


def evaluate(
    run: str | os.PathLike | None = None,
    *,
    data: str | None = None,
    adapter: str | None = None,
    model: str | None = None,
    base: str | None = None,
    name: str | None = None,
    limit: int | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = DEFAULT_BATCH,
    device: str | None = None,
    force: bool = False,
    workspace: str | os.PathLike | None = None,
    progress: Progress | None = None,
    asked: DataInput = CLI_DATA,
) -> Result:
    """Evaluate and store; returns the result (read back when the same settings were already evaluated). `asked`:
    how messages name the data file input (the CLI's --data, or the Evaluate page's field)."""
    report = progress or (lambda **_: None)
    report(phase="checking")
    target = resolve(run, adapter, model, base, workspace)
    method = methods.get(target.cfg)
    dev = _device(device)
    settings = Settings(
        target.what,
        target.base,
        target.adapter or target.model or "",
        str(Path(data).resolve()) if data else "the run's eval split",
        method.eval_kind,
        limit,
        max_new_tokens,
        batch_size,
        dev,
    )
    root = eval_root(target)
    folder = root / (name or default_name(data, target))
    old = read_result(folder)
    if old is not None and not force:
        if _same(old.settings, settings):
            old.reused, old.note = True, target.note
            return old
        folder = _free_name(folder)
    vlm = vision.folder_is_vlm(target.base)  # image conversations: core.eval.images
    tokenizer = _processor(target) if vlm else _tokenizer(target)
    if vlm:
        rows = images.rows(target.cfg, data, asked)
    elif method.eval_kind == "answers":
        rows = (
            file_rows(data, run_format(target.cfg, tokenizer), tokenizer, asked=asked)
            if data
            else split_rows(target.cfg, tokenizer, asked)
        )
    else:
        rows = method_rows(target.cfg, method, tokenizer, data, asked)
    if limit:
        rows = rows[:limit]
    if not rows:
        where = data or "the run's eval split"
        raise EvalError(f"{where} has no rows to evaluate (each needs a question and a reference answer).")
    model_obj, tuned_model, settings.dtype = _load(target, dev)
    t0 = time.time()
    if vlm:
        out_rows = images.answer_rows(rows, model_obj, tuned_model, tokenizer, max_new_tokens, report)
        summary = scores.summarize(out_rows)
        lines = scores.summary_lines(summary)
    elif method.eval_kind == "answers":
        new_tokens = _check_positions(rows, model_obj, max_new_tokens, tokenizer)
        settings.max_new_tokens = new_tokens
        out_rows = answer_rows(rows, model_obj, tuned_model, tokenizer, new_tokens, batch_size, report)
        summary = scores.summarize(out_rows)
        lines = scores.summary_lines(summary)
    elif method.eval_kind == "rewards":
        from core.eval import rewards

        settings.max_new_tokens = _completion_tokens(rows, model_obj, max_new_tokens, target.cfg, tokenizer)
        out_rows, summary, lines = rewards.evaluate_rewards(
            rows, target.cfg, model_obj, tuned_model, tokenizer, settings.max_new_tokens, batch_size, report
        )
    else:
        from core.eval import prefs

        out_rows, summary, lines = prefs.evaluate_prefs(
            rows,
            method,
            target.cfg,
            model_obj,
            tuned_model,
            tokenizer,
            max_new_tokens or 64,
            batch_size,
            report,
        )
    summary = {**summary, "rows": len(out_rows), "seconds": time.time() - t0, "finished": time.time()}
    _store(folder, settings, out_rows, summary, lines)
    return Result(folder, asdict(settings), summary, lines, out_rows, note=target.note)


def _same(stored: dict, settings: Settings) -> bool:
    mine = asdict(settings)
    keys = ("what", "base", "tuned", "data", "kind", "limit", "batch_size")
    return all(stored.get(k) == mine.get(k) for k in keys) and (
        settings.max_new_tokens is None or stored.get("max_new_tokens") == settings.max_new_tokens
    )


def _free_name(folder: Path) -> Path:
    n = 2
    while (folder.parent / f"{folder.name}-{n}").exists():
        n += 1
    return folder.parent / f"{folder.name}-{n}"


def _device(device: str | None) -> str:
    import torch

    if device:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EvalError(f"--device {device}: this machine has no CUDA GPU; use --device cpu.")
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _tokenizer(target: Target):
    from transformers import AutoTokenizer

    source = (
        target.adapter
        if target.adapter and (Path(target.adapter) / "tokenizer_config.json").is_file()
        else None
    )
    tok = AutoTokenizer.from_pretrained(
        source or target.base, trust_remote_code=target.cfg["model"]["trust_remote_code"]
    )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _processor(target: Target):
    """A VLM's processor: the adapter's (saved with it), else the base's."""
    has_own = target.adapter and (Path(target.adapter) / "processor_config.json").is_file()
    try:
        return vision.load_processor(
            target.adapter if has_own else target.base, target.cfg["model"]["trust_remote_code"]
        )
    except vision.DataError as exc:
        raise EvalError(str(exc)) from None


def _load(target: Target, dev: str):
    """(model, tuned or None, dtype): the base with the adapter on top (one load; the base is the adapter switched
    off), or the base and the merged/full model as two loads."""
    from core.precision import Device
    from core.precision import resolve as precision
    from core.train.model import load_model

    device = Device.local() if dev.startswith("cuda") else Device.of("cpu")
    prec = precision(target.cfg, device)
    model = load_model(target.cfg, prec)
    if not target.cfg["quantization"].get("load_in_4bit"):
        model = model.to(dev)
    model.config.use_cache = True
    tuned = None
    if target.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, target.adapter)
        model = model.to(dev) if not target.cfg["quantization"].get("load_in_4bit") else model
    else:
        tuned = load_model(target.cfg, prec, target.model).to(dev)
        tuned.config.use_cache = True
    return model, tuned, prec.dtype


def _positions(model) -> int | None:
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check_positions(rows: list[EvalRow], model, max_new_tokens: int | None, tokenizer) -> int:
    """max_new_tokens (default: the longest reference answer + 8 tokens), refusing prompts the model cannot
    hold and shortening the answers to the positions left."""
    longest_answer = max(len(r.answer_ids) for r in rows)
    new = max_new_tokens or longest_answer + 8
    limit = _positions(model)
    if limit is None:
        return new
    over = [r.row for r in rows if len(r.prompt_ids) + 1 > limit]
    if over:
        shown = ", ".join(map(str, over[:5])) + (" ..." if len(over) > 5 else "")
        raise EvalError(
            f"{len(over)} prompt(s) are longer than the model's {limit} positions (rows {shown}): shorten them "
            "or leave them out of the data."
        )
    room = limit - max(len(r.prompt_ids) for r in rows)
    return max(1, min(new, room))


def _completion_tokens(rows: list[dict], model, max_new_tokens: int | None, cfg: dict, tokenizer) -> int:
    """A reward run's answer length: the run's own training.max_completion_length unless asked, within the
    positions the longest prompt leaves."""
    from core.recipe.prompts import prompt_ids

    new = max_new_tokens or cfg["training"].get("max_completion_length") or 256
    limit = _positions(model)
    if limit is None:
        return new
    longest = max(len(prompt_ids(r["prompt"], tokenizer)) for r in rows)
    if longest + 1 > limit:
        raise EvalError(
            f"A prompt of {longest} tokens is longer than the model's {limit} positions: shorten it."
        )
    return max(1, min(new, limit - longest))


def answer_rows(rows, model, tuned, tokenizer, max_new_tokens, batch_size, report) -> list[dict]:
    """The per-row table: prompt, reference, both answers, their scores and answer losses."""
    prompts, answers = [r.prompt_ids for r in rows], [r.answer_ids for r in rows]
    out = [
        {"row": r.row, "prompt": r.prompt, "reference": r.reference, "n_answer_tokens": len(r.answer_ids)}
        for r in rows
    ]
    for side, (said, (losses,)) in generate.both_sides(
        model, tuned, tokenizer, prompts, [answers], max_new_tokens, batch_size, report
    ).items():
        for row, text, loss in zip(out, said, losses, strict=True):
            row[f"{side}_answer"] = text
            row[f"{side}_loss_sum"] = loss
            for key, value in scores.score(text, row["reference"]).items():
                row[f"{side}_{key}"] = value
    for row in out:
        row["change"] = scores.change(row)
    return out


def _store(folder: Path, settings: Settings, rows: list[dict], summary: dict, lines: list[str]) -> None:
    """Written beside the final name, then renamed: a half-written result is never read back."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.writing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    info = {**asdict(settings), "versions": _versions()}
    atomic_write_text(tmp / SETTINGS, json.dumps(info, indent=1))
    atomic_write_text(tmp / ROWS, "".join(json.dumps(r, default=str) + "\n" for r in rows))
    atomic_write_text(tmp / SUMMARY, json.dumps({"summary": summary, "lines": lines}, indent=1, default=str))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "peft", "trl", "rouge-score", "sacrebleu"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out
