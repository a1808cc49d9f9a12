"""Demo assets: a tiny Llama-style model and an instruction dataset it visibly learns on a CPU in a minute.

Nothing is downloaded. `build_demo(out)` makes, deterministically (fixed seeds):

  base/          a 2-layer Llama (hidden 128) with the char tokenizer of core.demo.toy, briefly pretrained (full
                 fine-tuning, a few hundred steps) on two chat skills: "Repeat: hello" -> "hello" and
                 "Shout: hello" -> "HELLO!". A randomly initialised base learns little through LoRA alone; this
                 one can copy and upper-case, so LoRA has something to build on.
  train.jsonl    the LoRA task in chat format (messages): "Uppercase: hello" -> "HELLO", an instruction the base
                 never saw. Before training the base repeats or shouts (0% exact answers); after the default
                 demo run it answers the held-out words correctly.
  heldout.jsonl  words that are not in train.jsonl, as {"question", "answer"}: the before/after accuracy.
  demo.json      what was built (seeds, steps, the base's accuracy on its pretraining skills).

`demo_config(workspace)` is the dashboard's default run config over these assets.

CLI: python -m core.demo [--out DIR] [--run] [--adapter RUN_DIR/adapter]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

from core import rundir
from core.demo.prefs import ensure_pref_data
from core.demo.task import (
    PRETRAIN_STEPS,
    SEED,
    TASK,
    VERSION,
    WORD_LEN,
    _messages,
    _pretrain_row,
    _word,
    task_rows,
)
from core.demo.toy import build_tokenizer, tiny_config
from core.files import atomic_write_text
from core.fmt import command
from core.recipe.config import dump_config, validate_config
from core.recipe.data import IGNORE_INDEX, Collator
from core.train.run import run_training
from core.workspace import default_workspace


class DemoError(RuntimeError):
    """The demo assets are missing or broken; the message says how to rebuild them."""


class NotADemoFolder(DemoError):
    """--out names a folder that holds something else (bad input: nothing was built)."""


def demo_dir(workspace: str | os.PathLike) -> Path:
    return Path(workspace) / "demo"


def encode_chat_pairs(tokenizer, pairs: list[tuple[str, str]]) -> list[dict]:
    """Tokenize one-turn chats like core.recipe.data does for the chat format (answer trained, prompt masked), but
    fast: the template is rendered once around two markers and the rows are tokenized in one batch call."""

    q_mark, a_mark = "\x01", "\x02"
    rendered = tokenizer.apply_chat_template(_messages(q_mark, a_mark), tokenize=False)
    prefix, rest = rendered.split(q_mark)
    middle, suffix = rest.split(a_mark)
    prompts = tokenizer([prefix + q + middle for q, _ in pairs], add_special_tokens=False)["input_ids"]
    answers = tokenizer([a + suffix for _, a in pairs], add_special_tokens=False)["input_ids"]
    return [
        {"input_ids": p + a, "labels": [IGNORE_INDEX] * len(p) + a}
        for p, a in zip(prompts, answers, strict=True)
    ]


def _batch(rows: list[dict], tokenizer):

    pairs = [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in rows]
    return Collator(tokenizer.pad_token_id)(encode_chat_pairs(tokenizer, pairs))


def pretrain_base(out: Path, steps: int = PRETRAIN_STEPS, seed: int = SEED, log=print) -> dict:
    """Build the tiny base and pretrain it on Repeat/Shout (plain torch loop, fixed seeds); returns accuracies."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = tiny_config(
        "llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = AutoModelForCausalLM.from_config(config)
    rng = random.Random(seed + 1)
    # A model this small only loses time to thread hand-offs, and one thread is reproducible.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        skills = _pretrain_loop(model, tokenizer, rng, steps, seed, log)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return skills


def _pretrain_loop(model, tokenizer, rng: random.Random, steps: int, seed: int, log) -> dict:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / steps)
    )
    model.train()
    t0 = time.time()
    for step in range(steps):
        loss = model(**_batch([_pretrain_row(rng) for _ in range(32)], tokenizer)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            log(
                f"pretraining the demo base: step {step + 1}/{steps}, loss {loss.item():.4f} ({time.time() - t0:.0f} s)"
            )
    model.eval()
    check = random.Random(seed + 2)
    repeat = [(f"Repeat: {w}", w) for w in (_word(check, mixed=True) for _ in range(50))]
    shout = [(f"Shout: {w}", w.upper() + "!") for w in (_word(check) for _ in range(50))]
    return {"repeat": accuracy(model, tokenizer, repeat), "shout": accuracy(model, tokenizer, shout)}


def accuracy(model, tokenizer, pairs: list[tuple[str, str]]) -> float:
    """Exact-match accuracy of greedy answers to (question, answer) pairs."""
    import torch

    if not pairs:
        return 0.0
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q, _ in pairs
    ]
    correct = 0
    by_len: dict[int, list[int]] = {}  # same-length prompts batch without padding
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    with torch.no_grad():
        for n, idx in by_len.items():
            out = model.generate(
                torch.tensor([encoded[i] for i in idx]),
                attention_mask=torch.ones((len(idx), n), dtype=torch.long),
                max_new_tokens=WORD_LEN + 3,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            for row, i in enumerate(idx):
                answer = tokenizer.decode(out[row, n:], skip_special_tokens=True).strip()
                correct += answer == pairs[i][1]
    return correct / len(pairs)


def build_demo(
    out: str | os.PathLike, pretrain_steps: int = PRETRAIN_STEPS, force: bool = False, log=print
) -> Path:
    """Build the demo assets into `out` (reused when already built with the same settings)."""
    out = Path(out)
    manifest = read_manifest(out)
    if (
        manifest
        and not force
        and manifest.get("version") == VERSION
        and manifest.get("pretrain_steps") == pretrain_steps
    ):
        return out
    if out.exists() and any(out.iterdir()) and manifest is None:
        raise NotADemoFolder(
            f"{out} exists and is not a demo folder: choose an empty or new folder for --out."
        )
    tmp = out.parent / f".{out.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    skills = pretrain_base(tmp / "base", steps=pretrain_steps, log=log)
    train, heldout = task_rows()
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train), encoding="utf-8")
    (tmp / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout), encoding="utf-8")
    ensure_pref_data(tmp)
    info = {
        "version": VERSION,
        "seed": SEED,
        "pretrain_steps": pretrain_steps,
        "base_skills": skills,
        "task": f"{TASK}: <{WORD_LEN} letters> -> the word in capitals",
        "train_rows": len(train),
        "heldout_rows": len(heldout),
    }
    atomic_write_text(tmp / "demo.json", json.dumps(info, indent=1))
    if out.exists():  # only ever a previous demo build (checked above)
        shutil.rmtree(out)
    os.replace(tmp, out)
    log(f"demo assets in {out}: base skills {skills}")
    return out


RUN_CONFIG = "run.yaml"


def write_run_config(out: str | os.PathLike) -> Path:
    """The demo run's config beside its assets (`python -m core.train OUT/run.yaml`): written by every build, the
    CLI's and the Train page's."""
    from core.recipe.config import dump_config

    return dump_config(demo_config(out=out), Path(out) / RUN_CONFIG)


def read_manifest(out: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(out) / "demo.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def demo_ready(workspace: str | os.PathLike) -> bool:
    return read_manifest(demo_dir(workspace)) is not None


def demo_config(workspace: str | os.PathLike | None = None, out: str | os.PathLike | None = None) -> dict:
    """The dashboard's default run config: LoRA on the demo base, ~1 minute on a CPU. Paths are absolute."""
    folder = Path(out) if out else demo_dir(workspace or default_workspace())
    folder = folder.resolve()
    return validate_config(
        {
            "model": {"path": str(folder / "base"), "dtype": "auto"},
            "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
            "data": {
                "path": str(folder / "train.jsonl"),
                "format": "chat",
                "eval_split": 0.05,
            },
            "training": {
                "max_length": 32,
                "per_device_train_batch_size": 16,
                "gradient_checkpointing": False,  # 32-token rows: nothing worth recomputing, and faster
                "gradient_accumulation_steps": 1,
                "max_steps": 150,
                "learning_rate": 3e-3,
                "lr_scheduler_type": "cosine",
                "warmup_steps": 0.1,
                "logging_steps": 5,
                "logging_first_step": True,  # a first point on the loss chart as soon as the first step is done
                "eval_steps": 25,
                "save_steps": 50,
                "save_total_limit": 2,
                "seed": 42,
            },
        }
    )


def heldout_accuracy(out: str | os.PathLike, adapter: str | os.PathLike | None = None) -> float:
    """Held-out exact-match accuracy of the demo base, or of base + the LoRA adapter at `adapter`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if read_manifest(out) is None:
        raise DemoError(f"{out} has no demo assets: build them with `{command('demo')} --out {out}`.")
    tokenizer = AutoTokenizer.from_pretrained(out / "base")
    model = AutoModelForCausalLM.from_pretrained(out / "base")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    rows = [
        json.loads(line) for line in (out / "heldout.jsonl").read_text(encoding="utf-8").splitlines() if line
    ]
    return accuracy(model, tokenizer, [(r["question"], r["answer"]) for r in rows])


def train_demo_run(out: Path, name: str, cfg: dict) -> Path:
    """Train `cfg` in a new run folder out/<name>[-n] (an earlier run is never reused or overwritten)."""

    run_dir, n = out / name, 2
    while run_dir.exists():
        run_dir, n = out / f"{name}-{n}", n + 1
    run_dir.mkdir()
    cfg_path = dump_config(cfg, run_dir / rundir.CONFIG)
    t0 = time.time()
    summary = run_training(cfg_path, run_dir)
    print(f"demo {cfg['method']} run {summary['state']} in {time.time() - t0:.0f} s: {run_dir}", flush=True)
    if summary["state"] != "finished":
        raise DemoError(
            f"the demo {cfg['method']} run ended {summary['state']}: see {run_dir / 'stderr.log'}"
        )
    return run_dir
