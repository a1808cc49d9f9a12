"""SFT (trl.SFTTrainer): instruction, chat or plain-text rows, pre-tokenized with the prompt masked out of the
loss (core.recipe.data)."""

from __future__ import annotations

from core.recipe import vision, vision_checks
from core.recipe.data import (
    FORMAT_COLUMNS,
    IGNORE_INDEX,
    Collator,
    DataError,
    detect_format,
    last_answer_span,
    load_rows,
    missing_columns,
    prepare_datasets,
    sample_prompts,
    tokenize_row,
)
from core.recipe.findings import (
    Finding,
    format_rows,
    is_blank,
    load_tokenizer_and_config,
    max_length_findings,
    model_limits,
    token_findings,
)
from core.recipe.methods.base import Chart, Method, PlanTraits, fill_to


class SFT(Method):
    def config_class(self):
        from trl import SFTConfig

        return SFTConfig

    def trainer_class(self):
        from trl import SFTTrainer

        return SFTTrainer

    def datasets(self, cfg: dict, tokenizer):
        # image conversations: messages + image paths, processed batch by batch (core.recipe.vision)
        if vision.is_processor(tokenizer):
            return vision.datasets(cfg, load_rows(cfg["data"]))
        train, evaluation = prepare_datasets(cfg, tokenizer)
        # pre-tokenized with the prompt masked (labels -100): SFTTrainer uses input_ids/labels as they are
        return train.remove_columns("length"), (
            evaluation.remove_columns("length") if evaluation is not None else None
        )

    def preflight(self, cfg: dict, tokenizer=None, model_config=None, in_trainer: bool = False) -> list:
        return sft_findings(cfg, tokenizer, model_config)

    def check_columns(self, data_cfg: dict) -> str | None:
        try:
            ds = load_rows(data_cfg)
            fmt = detect_format(ds.column_names, data_cfg.get("format", "auto"))
        except DataError as exc:
            return str(exc)
        missing = missing_columns(ds.column_names, fmt)
        if missing:
            return (
                f"data.path: format {fmt} needs the column(s) {', '.join(missing)}, but the data has "
                f"{', '.join(ds.column_names)}. Map yours with data.columns or choose another format."
            )
        return None

    def smoke_collator(self, pad_token_id: int, max_length: int):
        return SmokeCollator(pad_token_id, max_length)

    def sample_prompts(self, data_cfg: dict, n: int = 3) -> list[str]:
        return sample_prompts(data_cfg, n)

    def sample_rows(self, rows, tokenizer, n: int) -> list[dict]:
        """Tokenized rows (input_ids, labels): the prompt is what comes before the last answer."""
        if "labels" not in rows.column_names:  # image conversations: no samples yet (they need the images)
            return []
        out = []
        for row in rows.select(range(min(n, len(rows)))):
            span = last_answer_span(row["labels"])
            if span is None:
                continue
            if span[0] == 0:  # plain text, nothing masked: its first half asks, the rest is the reference
                span = (max(1, span[1] // 2), span[1])
            ids = row["input_ids"]
            out.append(
                {
                    "prompt": tokenizer.decode(ids[: span[0]], skip_special_tokens=True),
                    "prompt_ids": list(ids[: span[0]]),
                    "reference": tokenizer.decode(ids[span[0] : span[1]], skip_special_tokens=True).strip(),
                }
            )
        return out


class SmokeCollator(Collator):
    """Fills every batch up to training.max_length: the smoke step then has the longest rows a run can meet, the
    sequence length the planner's estimate is made for (a batch of one short row would measure far less).

    The filler is attended to (attention_mask 1) but not trained on (labels -100): a row that really is
    max_length long has no padding mask either, and a mask would switch sdpa to a slower path that keeps
    more. The smoke step's weights are never saved, so what it attends to does not matter."""

    def __init__(self, pad_token_id: int, max_length: int):
        super().__init__(pad_token_id)
        self.max_length = max_length

    def __call__(self, features: list[dict]) -> dict:
        batch = super().__call__(features)  # counts the real tokens, as in a run
        fill = {"input_ids": self.pad_token_id, "attention_mask": 1, "labels": IGNORE_INDEX}
        return fill_to(batch, self.max_length, fill)


def empty_rows(ds, fmt: str) -> list[int]:
    bad = []
    for i, row in enumerate(ds):
        if fmt == "chat":
            msgs = row.get("messages") or []
            blank = (
                not isinstance(msgs, list)
                or not msgs
                or not all(isinstance(m, dict) for m in msgs)  # a message that is not {role, content}
                or any(is_blank(m.get("content")) for m in msgs)
                or not any(m.get("role") == "assistant" for m in msgs)
            )
        else:
            blank = any(is_blank(row.get(c)) for c in FORMAT_COLUMNS[fmt])
        if blank:
            bad.append(i + 1)
    return bad


def sft_findings(cfg: dict, tokenizer=None, model_config=None) -> list[Finding]:
    """Every finding for an SFT run config; an empty list means the data is ready."""
    data = cfg["data"]
    try:
        ds = load_rows(data)
    except DataError as exc:
        return [Finding("error", "data", str(exc), "")]  # the data error says how to fix it
    if len(ds) == 0:
        return [
            Finding("error", "data", f"{data['path']} has no rows.", "Give a dataset with at least one row.")
        ]
    try:
        fmt = detect_format(ds.column_names, data["format"])
    except DataError as exc:
        return [Finding("error", "columns", str(exc), "Rename columns with data.columns or set data.format.")]
    missing = missing_columns(ds.column_names, fmt)
    if missing:
        return [
            Finding(
                "error",
                "columns",
                f"Format {fmt} needs the column(s) {', '.join(missing)}; the data has {', '.join(ds.column_names)}.",
                f"Map your columns in data.columns, e.g. {{{missing[0]}: <your column>}}, or set data.format.",
                rows=list(range(1, len(ds) + 1)),
            )
        ]
    if tokenizer is None or model_config is None:
        tok, conf = load_tokenizer_and_config(cfg["model"])
        tokenizer, model_config = tokenizer or tok, model_config or conf
    findings: list[Finding] = vision_checks.ignored_image_keys(cfg, model_config)
    if vision.is_vlm(model_config):
        if fmt != "chat":
            return [
                Finding(
                    "error",
                    "format",
                    f"{cfg['model']['path']} is a vision-language model, which trains on image conversations "
                    f"(messages), but the data is in {fmt} format.",
                    "Give rows with `messages` (docs/data.md: image conversations), or a text model.",
                )
            ]
        try:
            processor = vision.processor_for(cfg["model"], tokenizer, cfg["data"].get("max_pixels"))
        except DataError as exc:
            return [Finding("error", "processor", str(exc), "")]
        return vision_checks.findings(cfg, ds, processor)
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        findings.append(
            Finding(
                "error",
                "chat_template",
                f"The data is in chat format (messages) but the tokenizer of {cfg['model']['path']} has no chat "
                "template, so conversations cannot be rendered.",
                "Use an instruct/chat model's tokenizer, set tokenizer.chat_template, or convert rows to text.",
            )
        )
        return findings

    empty = empty_rows(ds, fmt)
    if empty:
        findings.append(
            Finding(
                "error",
                "empty_rows",
                f"{len(empty)} row(s) are empty or whitespace only (or have no assistant turn): rows "
                f"{format_rows(empty)}.",
                "Remove or fill those rows.",
                rows=empty,
            )
        )

    vocab, max_pos = model_limits(model_config)
    max_length = cfg["training"]["max_length"]
    findings += max_length_findings(max_length, max_pos)

    over_vocab, over_pos, truncated, nothing_to_learn = [], [], [], []
    for i, row in enumerate(ds):
        try:
            enc = tokenize_row(row, fmt, tokenizer, 10**9, data["mask_prompt"])  # untruncated
        except DataError as exc:
            findings.append(Finding("error", "format", f"Row {i + 1}: {exc}.", "Fix or remove the row."))
            continue
        n = enc["length"]
        if vocab and any(t >= vocab or t < 0 for t in enc["input_ids"]):
            over_vocab.append(i + 1)
        if max_pos and n > max_pos:
            over_pos.append(i + 1)
        if n > max_length:
            truncated.append(i + 1)
        if (i + 1) not in empty and all(label == IGNORE_INDEX for label in enc["labels"][:max_length]):
            nothing_to_learn.append(i + 1)

    findings += token_findings(over_vocab, vocab, len(tokenizer), over_pos, max_pos, max_length)
    if truncated:
        pct = 100.0 * len(truncated) / len(ds)
        findings.append(
            Finding(
                "warning",
                "truncation",
                f"{len(truncated)} of {len(ds)} rows ({pct:.1f}%) would be truncated at training.max_length "
                f"{max_length}: rows {format_rows(truncated)}.",
                "Raise training.max_length (memory grows with it) or shorten those rows.",
                rows=truncated,
            )
        )
    if nothing_to_learn:
        findings.append(
            Finding(
                "warning",
                "no_labels",
                f"{len(nothing_to_learn)} row(s) have no answer tokens left within training.max_length {max_length} "
                f"(the prompt fills it): rows {format_rows(nothing_to_learn)}. They are skipped.",
                "Raise training.max_length or shorten those prompts.",
                rows=nothing_to_learn,
            )
        )
    return findings


METHOD = SFT(
    name="sft",
    label="SFT",
    trainer_name="trl.SFTTrainer",
    formats=("alpaca", "chat", "text"),
    columns=("instruction", "input", "output", "messages", "text", "images"),  # images: a VLM's image column
    summary="instructions or chat: the model learns to give the answers in the data",
    choice="SFT (instructions / chat)",
    traits=PlanTraits(rows_per_example=1, reference=False, flat_batches=True, head_outputs=0),
    # trl 1.16 SFTTrainer logs a mixture-of-experts model's load-balancing loss (outputs.aux_loss) whenever its
    # config has a router_aux_loss_coef other than 0 (it is added to the loss with that weight)
    metrics=("mean_token_accuracy", "entropy", "aux_loss"),
    charts=(
        Chart(
            "aux_loss",
            "Router load-balancing loss (mixture of experts)",
            "aux loss",
            (("aux_loss", "train"),),
            (("eval_aux_loss", "eval"),),
            caption=(("aux_loss", "aux loss", ".4f"),),
            optional=True,
        ),
    ),
)
