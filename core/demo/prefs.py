"""Preference pairs for the demo model (DPO): the same "Uppercase: <word>" prompts, a new preferred style.

The demo's SFT run teaches "Uppercase: hello" -> "HELLO". The pairs here prefer "HELLO!" (capitals and an
exclamation mark, a style the SFT data never shows) over "HELLO" (what the SFT model already answers), so a DPO
run has a preference to learn that SFT did not give it, and `preference_accuracy` shows it: 0 for the SFT model
(and the base), 1 once DPO has moved it; `chosen_accuracy` checks that the model now answers "HELLO!" greedily.
Measured on the held-out pairs (SFT'd demo model merged, then DPO with LoRA r8 all-linear, beta 0.1, batch 16,
max_length 32, 40 steps): learning rate 1e-3 or 2e-3 gives preference and chosen accuracy 0 -> 1.0; 5e-3
gives preference accuracy 1.0 but chosen accuracy 0.06 (both answers pushed down). The base model knows "!"
from its "Shout" pretraining skill and the character tokenizer has '!' in its vocabulary, so the style is
representable and learnable in a few steps.

Rows are in the standard format (prompt / chosen / rejected strings, core.recipe.prefdata). The prompt is the
demo chat template already rendered ("<|user|>Uppercase: hello</s><|assistant|>"), so DPO sees exactly the
tokens SFT trained on; DPOTrainer appends EOS to each answer. Held-out words occur neither in the training pairs
nor in the SFT data.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from core.demo.task import SEED, TASK, _word, task_rows
from core.demo.toy import build_tokenizer
from core.files import atomic_write_text
from core.recipe.config import validate_config
from core.recipe.prefdata import pair_token_ids

TRAIN_PAIRS = 512
HELDOUT_PAIRS = 64
PREF_SEED = SEED + 13
TRAIN_FILE = "prefs_train.jsonl"
HELDOUT_FILE = "prefs_heldout.jsonl"


def chosen_style(word: str) -> str:
    """The preferred answer: the word in capitals with an exclamation mark."""
    return word.upper() + "!"


def _prompt(tokenizer, word: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{TASK}: {word}"}], tokenize=False, add_generation_prompt=True
    )


def pref_rows(tokenizer=None, seed: int = PREF_SEED) -> tuple[list[dict], list[dict]]:
    """(train pairs, held-out pairs) as {prompt, chosen, rejected} strings; held-out words are in neither the
    training pairs nor the SFT task data. `tokenizer`: the demo's (core.demo.toy.build_tokenizer by default)."""
    if tokenizer is None:
        tokenizer = build_tokenizer()
    train_sft, heldout_sft = task_rows()
    seen = {r["messages"][0]["content"].split(": ", 1)[1] for r in train_sft}
    seen |= {r["question"].split(": ", 1)[1] for r in heldout_sft}
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < TRAIN_PAIRS + HELDOUT_PAIRS:
        w = _word(rng)
        if w not in seen:
            seen.add(w)
            words.append(w)

    def pair(w: str) -> dict:
        return {"prompt": _prompt(tokenizer, w), "chosen": chosen_style(w), "rejected": w.upper()}

    return [pair(w) for w in words[:TRAIN_PAIRS]], [pair(w) for w in words[TRAIN_PAIRS:]]


def write_pref_data(out_dir: str | os.PathLike, tokenizer=None) -> tuple[Path, Path]:
    """Write the demo's preference pairs (standard format, JSON Lines) into `out_dir`; returns (train, held-out)
    paths. Deterministic: the same bytes on every call."""
    out = Path(out_dir)
    train, heldout = pref_rows(tokenizer)
    paths = []
    for name, rows in ((TRAIN_FILE, train), (HELDOUT_FILE, heldout)):
        paths.append(atomic_write_text(out / name, "".join(json.dumps(r) + "\n" for r in rows)))
    return paths[0], paths[1]


FEEDBACK_FILE = "feedback_train.jsonl"


def write_feedback_data(out_dir: str | os.PathLike, tokenizer=None) -> Path:
    """The demo's training pairs as KTO's unpaired feedback (prompt, completion, label): each pair's chosen answer
    rated good, its rejected one bad, in a fixed shuffled order so every batch sees both kinds (KTOTrainer samples
    sequentially and takes each row's KL completion from its neighbours). Deterministic, like the pairs."""
    train, _ = pref_rows(tokenizer)
    rows = [
        {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
        for p in train
        for side in ("chosen", "rejected")
    ]
    random.Random(PREF_SEED + 1).shuffle(rows)
    return atomic_write_text(Path(out_dir) / FEEDBACK_FILE, "".join(json.dumps(r) + "\n" for r in rows))


def read_pairs(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def pair_logps(
    model, tokenizer, pairs: list[dict], batch_size: int = 64, max_length: int | None = None
) -> list[tuple[float, float]]:
    """(log p(chosen | prompt), log p(rejected | prompt)) per pair: the summed log-probabilities of the answer
    tokens, tokenized as DPOTrainer does (core.recipe.prefdata.pair_token_ids: EOS appended to text answers), cut
    at `max_length` like its collator. Plain torch, batched with right padding, no gradients."""
    import torch

    seqs: list[tuple[list[int], int]] = []  # (prompt + answer ids, prompt length)
    for pair in pairs:
        p, c, r = pair_token_ids(pair, tokenizer)
        for answer in (c, r):
            ids = p + answer
            seqs.append((ids[:max_length] if max_length else ids, len(p)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    sums: list[float] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(seqs), batch_size):
                batch = seqs[start : start + batch_size]
                width = max(len(ids) for ids, _ in batch)
                input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
                attention = torch.zeros((len(batch), width), dtype=torch.long)
                answer = torch.zeros((len(batch), width), dtype=torch.bool)
                for i, (ids, n_prompt) in enumerate(batch):
                    input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                    attention[i, : len(ids)] = 1
                    answer[i, n_prompt : len(ids)] = True
                input_ids, attention, answer = input_ids.to(device), attention.to(device), answer.to(device)
                logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
                # the token at position t is predicted by the logits at t - 1
                logps = torch.log_softmax(logits[:, :-1], dim=-1)
                token_logps = logps.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                sums += (token_logps * answer[:, 1:]).sum(-1).tolist()
    finally:
        model.train(was_training)
    return list(zip(sums[0::2], sums[1::2], strict=True))


def preference_accuracy(
    model, tokenizer, pairs: list[dict], batch_size: int = 64, max_length: int | None = None
) -> float:
    """The fraction of pairs whose chosen answer the model finds more likely than the rejected one: summed
    log-probability of the answer tokens given the prompt (EOS included), strictly greater (a tie counts as
    wrong). A plain likelihood comparison, not DPO's reward margin (which is relative to the reference model).
    0.0 for no pairs."""
    if not pairs:
        return 0.0
    scores = pair_logps(model, tokenizer, pairs, batch_size, max_length)
    return sum(c > r for c, r in scores) / len(scores)


def chosen_accuracy(model, tokenizer, pairs: list[dict], max_new_tokens: int = 8) -> float:
    """The fraction of pairs whose greedy answer to the prompt is exactly the chosen answer (stripped, special
    tokens dropped). preference_accuracy can reach 1.0 while generation degrades (a DPO learning rate too high
    pushes both answers down); this says whether the model now *says* the preferred answer."""
    import torch

    if not pairs:
        return 0.0
    prompts = [pair_token_ids(p, tokenizer)[0] for p in pairs]
    by_len: dict[int, list[int]] = {}  # same-length prompts batch without padding
    for i, ids in enumerate(prompts):
        by_len.setdefault(len(ids), []).append(i)
    correct = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for n, idx in by_len.items():
                out = model.generate(
                    torch.tensor([prompts[i] for i in idx]),
                    attention_mask=torch.ones((len(idx), n), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
                for row, i in enumerate(idx):
                    answer = tokenizer.decode(out[row, n:], skip_special_tokens=True).strip()
                    correct += answer == str(_answer_text(pairs[i]["chosen"])).strip()
    finally:
        model.train(was_training)
    return correct / len(pairs)


def _answer_text(answer) -> str:
    return "".join(m["content"] for m in answer) if isinstance(answer, list) else answer


# ---- the preference demos: DPO and KTO on top of the demo's SFT run -----------------------------------------


def ensure_pref_data(out: str | os.PathLike) -> tuple[Path, Path]:
    """The demo's preference pairs for DPO (core.demo.prefs), written when missing (a demo built before DPO)."""
    out = Path(out)
    train, heldout = out / TRAIN_FILE, out / HELDOUT_FILE
    if train.is_file() and heldout.is_file():
        return train, heldout
    return write_pref_data(out)


def dpo_demo_config(out: str | os.PathLike, model: str | os.PathLike) -> dict:
    """The demo's DPO run on top of `model` (the demo base, or the SFT run merged into it): prefer "HELLO!" over
    "HELLO" (core.demo.prefs). A fresh LoRA adapter; the reference is `model` itself (the adapter off)."""
    out = Path(out).resolve()
    train, _ = ensure_pref_data(out)
    return validate_config(
        {
            "method": "dpo",
            "model": {"path": str(Path(model).resolve()), "dtype": "auto"},
            "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
            "data": {"path": str(train), "format": "standard", "eval_split": 0.05},
            "training": {
                "max_length": 32,
                "per_device_train_batch_size": 16,
                "gradient_accumulation_steps": 1,
                "gradient_checkpointing": False,
                "max_steps": 40,
                "learning_rate": 1e-3,  # 5e-3 pushes both answers down (core.demo.prefs)
                "lr_scheduler_type": "cosine",
                "warmup_steps": 0.1,
                "beta": 0.1,
                "logging_steps": 5,
                "eval_steps": 10,
                "save_steps": 20,
                "save_total_limit": 2,
                "seed": 42,
            },
        }
    )


def kto_demo_config(out: str | os.PathLike, model: str | os.PathLike) -> dict:
    """The demo's KTO run on top of `model`: the same preference as the DPO demo, learnt from rated answers
    ("HELLO!" good, "HELLO" bad; core.demo.prefs.write_feedback_data), each row on its own."""
    out = Path(out).resolve()
    cfg = dpo_demo_config(out, model)
    cfg["method"] = "kto"
    cfg["data"] = {**cfg["data"], "path": str(write_feedback_data(out)), "format": "standard"}
    return validate_config(cfg)


# The demo's preference runs, by method: what the Train page's "Use the demo's ..." button loads
PREFERENCE_DEMOS = {"dpo": dpo_demo_config, "kto": kto_demo_config}


def preference_base(folder: str | os.PathLike) -> Path:
    """The model a preference demo trains on: the newest SFT-merged demo model (`core.demo --run-dpo/--run-kto`
    merges the SFT run into the base first, as preference training is usually done), else the demo base."""
    folder = Path(folder)
    merged = [p for p in folder.glob("sft-merged*") if (p / "config.json").is_file()]
    return max(merged, key=lambda p: p.stat().st_mtime) if merged else folder / "base"
