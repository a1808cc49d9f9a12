"""The answer evaluation of a vision-language run: held-out image conversations asked of the base and the tuned
model (greedy answers, scored against the reference like core.eval.run's text rows) and the reference answer's
teacher-forced loss, each row with its images through the model's processor (core.recipe.vision).

The held-out rows are the trainer's own (core.recipe.vision.datasets draws them with data.eval_split and
training.seed), or every row of a data file of image conversations. Rows go one at a time: each has its own
images, and an evaluation set is small.
"""

from __future__ import annotations

import json

from core.eval import scores
from core.eval.heldout import CLI_DATA, DataInput, EvalError, heldout_config
from core.files import quiet_datasets
from core.generate import model_device, sides
from core.recipe import image_column, vision
from core.recipe.data import IGNORE_INDEX, DataError, load_rows


def rows(cfg: dict, data: str | None = None, asked: DataInput = CLI_DATA) -> list[dict]:
    """[{"row", "messages", "images"}]: the run's held-out rows, or every row of `data`."""
    c = heldout_config(cfg, data, asked)
    try:
        ds = load_rows(c["data"])
        fmt = vision.ImageChat(c["data"])
        bad = next((i + 1 for i, r in enumerate(ds) if fmt.messages(r) is None), None)
        if bad is not None:
            raise EvalError(f"Row {bad} of {c['data']['path']} is not an image conversation (messages).")
        with quiet_datasets():
            train, held = vision.datasets(c, ds)
    except DataError as exc:
        raise EvalError(str(exc).replace("data.path", asked.name if data else "data.path", 1)) from None
    chosen = train if data else held
    if chosen is None:
        raise EvalError(
            f"The run's data has too few rows to hold any out: evaluate on a data file ({asked.give})."
        )
    return [_row(i + 1, r, fmt.base) for i, r in enumerate(chosen)]


def _row(number: int, r: dict, base) -> dict:
    """A held-out row with what its image entries show (`shown`: files, or a column's undecoded images) and
    how the table names them (`images`: the files' paths; a column image, by its place)."""
    messages = json.loads(r["messages"])
    shown = image_column.placed(messages, image_column.values(r.get("images")), base)
    names = [
        s if isinstance(s, str) else f"image {k + 1} of the row's images column" for k, s in enumerate(shown)
    ]
    return {"row": number, "messages": r["messages"], "images": names, "shown": shown}


def _split(messages: list[dict]) -> tuple[list[dict], str] | None:
    """(the conversation before the last answer, that answer as text), or None without an answer."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return None
    content = messages[last]["content"]
    text = content if isinstance(content, str) else "".join(c.get("text", "") for c in content)
    return messages[:last], text


def _user(context: list[dict]) -> str:
    for m in reversed(context):
        if m["role"] == "user":
            c = m["content"]
            return (
                c if isinstance(c, str) else " ".join(e.get("text", "") for e in c if e.get("type") == "text")
            )
    return ""


def answer_rows(held: list[dict], model, tuned, processor, max_new_tokens: int | None, report) -> list[dict]:
    """The per-row table core.eval.run stores: prompt, reference, images, both answers, scores, answer losses."""
    import torch

    cases = []
    for r in held:
        messages = json.loads(r["messages"])
        split = _split(messages)
        if split is None or not split[1].strip():
            continue
        cases.append((r, messages, *split))
    if not cases:
        return []
    longest = max(len(processor.tokenizer(a, add_special_tokens=False)["input_ids"]) for *_, a in cases)
    new_tokens = max_new_tokens or longest + 8
    out = [
        {"row": r["row"], "prompt": _user(ctx), "reference": answer, "images": r["images"]}
        for r, _, ctx, answer in cases
    ]
    for side, m, ctx in sides(model, tuned):
        device = model_device(m)
        was_training = m.training
        m.eval()
        with ctx, torch.no_grad():
            for k, ((r, messages, context, _), row) in enumerate(zip(cases, out, strict=True)):
                shown = r.get("shown")
                asked = None if shown is None else shown[: vision.ImageChat.placeholders(context)]
                said = _greedy(m, processor, context, new_tokens, device, asked)
                loss, n = _answer_loss(m, processor, messages, device, shown)
                row[f"{side}_answer"], row[f"{side}_loss_sum"], row["n_answer_tokens"] = said, loss, n
                for key, value in scores.score(said, row["reference"]).items():
                    row[f"{side}_{key}"] = value
                report(phase=f"{side} answers", done=k + 1, total=len(cases))
        m.train(was_training)
    for row in out:
        row["change"] = scores.change(row)
    return out


def _inputs(processor, text: str, paths: list, device) -> dict:
    images = [vision.open_image(p) for p in paths] or None
    enc = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items()}


def _greedy(model, processor, context: list[dict], max_new_tokens: int, device, shown=None) -> str:
    text = processor.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
    inputs = _inputs(processor, text, vision.ImageChat.images(context) if shown is None else shown, device)
    tok = processor.tokenizer
    gen = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return tok.decode(gen[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def _answer_loss(model, processor, messages: list[dict], device, shown=None) -> tuple[float, int]:
    """(summed NLL of the last answer's trained tokens, their count): the labels the trainer trains on, the
    earlier answers of a longer conversation left out."""
    import torch

    row = vision.encode(messages, processor, images=shown)
    labels = row.pop("labels")
    row.pop("length")
    trained = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
    start = trained[-1]
    while start - 1 in trained:  # the last run of trained tokens: the last answer
        start -= 1
    target = torch.full_like(labels, IGNORE_INDEX)
    target[start : trained[-1] + 1] = labels[start : trained[-1] + 1]
    inputs = {k: (v.unsqueeze(0) if k in vision.SEQUENCE_KEYS else v).to(device) for k, v in row.items()}
    logits = model(**inputs).logits[0].float()
    logps = torch.log_softmax(logits[:-1], dim=-1)
    shifted = target[1:].to(device)
    mask = shifted != IGNORE_INDEX
    picked = logps.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return float(-(picked * mask).sum()), int(mask.sum())
