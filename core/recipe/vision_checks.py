"""The checks and the preview of image conversations (core.recipe.vision): preflight's findings by row, and the
Train page's preview with each row's images and its image tokens counted."""

from __future__ import annotations

from core.fmt import command
from core.recipe import image_column
from core.recipe.data import _chat_segments
from core.recipe.mix_config import source_name
from core.recipe.vision import (
    IMAGE_KEYS,
    ImageChat,
    image_problem,
    is_vlm,
    processor_for,
    takes_max_pixels,
    token_count,
)

SHOW_IMAGE_FINDINGS = 20


def findings(cfg: dict, ds, processor) -> list:
    """The preflight of image conversations: each missing or unreadable image by row (one finding each), rows
    without a conversation or an answer, rows whose images do not fit in training.max_length (an image cannot be
    cut: its features and its tokens would not match), rows that would be truncated."""
    from core.recipe.findings import Finding, format_rows

    fmt, t = ImageChat(cfg["data"]), cfg["training"]
    max_length = t["max_length"]
    out: list[Finding] = []
    if cfg["data"].get("max_pixels") and not takes_max_pixels(processor.image_processor):
        out.append(
            Finding(
                "warning",
                "max_pixels",
                f"data.max_pixels is ignored: the processor of {cfg['model']['path']} resizes every image to a "
                "fixed size (Qwen-VL's processors take max_pixels).",
                "Drop data.max_pixels.",
            )
        )
    for key in ("padding_free", "packing"):
        if t.get(key):
            out.append(
                Finding(
                    "error",
                    key,
                    f"training.{key} is on, but image conversations are batched row by row (TRL has no {key} for "
                    "vision data).",
                    f"Set training.{key}: false.",
                )
            )
    if t.get("eval_samples"):
        out.append(
            Finding(
                "warning",
                "eval_samples",
                "training.eval_samples writes no samples for image conversations yet (no samples.jsonl).",
                f"Evaluate the run's held-out image rows after training: {command('eval')} --run RUN.",
            )
        )
    wrong_column = image_column.column_problem(ds)
    if wrong_column:
        return [*out, Finding("error", "images", wrong_column, "")]
    source = source_name(cfg["data"])
    empty, cut, truncated, bad_images = [], [], [], 0
    for i, row in enumerate(ds):
        msgs = fmt.messages(row)
        if msgs is None or not any(m["role"] == "assistant" and _has_text(m["content"]) for m in msgs):
            empty.append(i + 1)
            continue
        refs = fmt.refs(row, msgs)
        problems = [_count_sentence(i + 1, source, row, msgs)]
        for written, ref, from_column in refs:
            problem = image_problem(ref) if written else "names no file"
            if problem and from_column:
                problems.append(
                    f"Row {i + 1} of {source}: {written} {image_column.label(ref)} {problem}; replace that "
                    "image in the dataset or drop the row."
                )
            elif problem:
                problems.append(_image_sentence(i + 1, written, ref, problem))
        for sentence in filter(None, problems):
            bad_images += 1
            if bad_images <= SHOW_IMAGE_FINDINGS:
                out.append(Finding("error", "images", sentence, "", rows=[i + 1]))
        if any(problems):
            continue
        total, _, last = token_count(msgs, processor, [ref for _, ref, _ in refs])
        if last > max_length:
            cut.append(i + 1)
        elif total > max_length:
            truncated.append(i + 1)
    if bad_images > SHOW_IMAGE_FINDINGS:
        out.append(
            Finding("error", "images", f"{bad_images - SHOW_IMAGE_FINDINGS} more images cannot be used.", "")
        )
    if empty:
        out.append(
            Finding(
                "error",
                "empty_rows",
                f"{len(empty)} row(s) are not image conversations with an assistant answer: rows "
                f"{format_rows(empty)}.",
                "Give each row `messages`: [{role, content}], content a string or a list of "
                '{"type": "image", "image": PATH} / {"type": "text", "text": ...} entries, with an assistant turn.',
                rows=empty,
            )
        )
    if cut:
        out.append(
            Finding(
                "error",
                "image_truncation",
                f"{len(cut)} row(s) have image tokens beyond training.max_length {max_length} (an image cannot be "
                f"cut): rows {format_rows(cut)}.",
                "Raise training.max_length, or use smaller images (Qwen-VL: data.max_pixels).",
                rows=cut,
            )
        )
    if truncated:
        out.append(
            Finding(
                "warning",
                "truncation",
                f"{len(truncated)} of {len(ds)} rows would be truncated at training.max_length {max_length}: rows "
                f"{format_rows(truncated)}.",
                "Raise training.max_length (memory grows with it) or shorten those rows.",
                rows=truncated,
            )
        )
    return out


def ignored_image_keys(cfg: dict, model_config) -> list:
    """A warning naming the image settings (config_keys.IMAGE_KEYS) set for a text model: they are ignored (the
    same config may be tried on a VLM and on a text model; a typo'd key is still an error of the validator)."""
    from core.recipe.findings import Finding

    if is_vlm(model_config):
        return []
    keys = [k for k in IMAGE_KEYS if k.partition(".")[2] in (cfg.get(k.partition(".")[0]) or {})]
    if not keys:
        return []
    return [
        Finding(
            "warning",
            "image_keys",
            f"{', '.join(keys)} {'is' if len(keys) == 1 else 'are'} ignored: {cfg['model']['path']} is a text model "
            "(its config.json has no vision_config).",
            "Drop them, or point model.path at a vision-language model.",
        )
    ]


def _count_sentence(row: int, source: str, raw: dict, messages: list[dict]) -> str | None:
    """A row whose image column holds more images than its conversation's image entries take."""
    name, column = image_column.row_images(raw)
    wanted = ImageChat.placeholders(messages) - len(ImageChat.images(messages))
    if not column or len(column) <= wanted:
        return None  # fewer: the entries left without an image are named one by one
    return (
        f"Row {row} of {source}: the column {name} holds {len(column)} image(s) but the conversation has "
        f'{wanted} image entr{"y" if wanted == 1 else "ies"} without a file ({{"type": "image"}}) to show '
        "them; give each image its entry, in order."
    )


def _image_sentence(row: int, written: str, path, problem: str) -> str:
    if not written:  # {"type": "image"} with no image left in the row's image column
        return (
            f'Row {row}: an image entry names no file; give its path as {{"type": "image", "image": "imgs/0.png"}} '
            "(relative to the data file), or hold the row's images in an images column, one per entry."
        )
    return f"Row {row}: the image {written} ({path}) {problem}; fix the path (relative to the data file) or replace the file."


def _has_text(content) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(c.get("type") == "text" and str(c.get("text") or "").strip() for c in content)


def preview(data_cfg: dict, processor, n: int = 5, length_rows: int = 5000, max_length: int = 512) -> dict:
    """core.recipe.data.preview_dataset for image conversations: each shown row also has `images` (the files'
    paths, for thumbnails) and `image_tokens`; the lengths count every image as the processor's rule gives."""
    from core.recipe.data import load_rows

    ds = load_rows(data_cfg)
    fmt = ImageChat(data_cfg)
    rows, lengths = [], []
    for i in range(min(max(n, length_rows), len(ds))):
        row = ds[i]
        msgs = fmt.messages(row)
        if msgs is None:
            continue
        paths = [ref for _, ref, _ in fmt.refs(row, msgs)]
        readable = all(p is not None and image_problem(p) is None for p in paths)
        total, image_tokens, _ = token_count(msgs, processor, paths) if readable else (0, 0, 0)
        if readable:
            lengths.append(total)
        if i < n:
            segs = _chat_segments(msgs, processor)
            rows.append(
                {
                    "row": i + 1,
                    "prompt": "".join(s for s, trainable in segs if not trainable),
                    "completion": "".join(s for s, trainable in segs if trainable),
                    "n_tokens": total,
                    "n_trained": None,
                    "images": [image_column.shown(p) for p in paths],
                    "image_tokens": image_tokens,
                }
            )
    from core.hub.rows import is_sample

    return {
        "format": "chat",
        "rows": rows,
        "lengths": lengths,
        "max_length": max_length,
        "truncated": sum(k > max_length for k in lengths),
        "total_rows": len(ds),
        "sample": is_sample(ds),
        "images": True,
    }


def run_preview(cfg: dict, tokenizer, model_config, n: int = 5, length_rows: int = 5000) -> dict:
    """The Train page's preview of an SFT run's data: its image conversations for a VLM (`preview`: image paths
    for thumbnails, lengths with the image tokens), else core.recipe.data.preview_dataset."""
    from core.recipe.data import preview_dataset

    max_length = cfg["training"]["max_length"]
    if is_vlm(model_config):
        processor = processor_for(cfg["model"], tokenizer, cfg["data"].get("max_pixels"))
        return preview(cfg["data"], processor, n=n, length_rows=length_rows, max_length=max_length)
    return preview_dataset(cfg["data"], tokenizer, n=n, length_rows=length_rows, max_length=max_length)
