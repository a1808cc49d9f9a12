"""The demo's task and its words: "Uppercase: hello" -> "HELLO", with held-out words it never trains on. Shared by
the SFT assets (core.demo.build) and the preference data (core.demo.prefs)."""

from __future__ import annotations

import random
import string

VERSION = 1
WORD_LEN = 5  # fixed length: answers line up with questions, which a 2-layer model learns in ~100 steps
TRAIN_ROWS = 2000
HELDOUT_ROWS = 100
PRETRAIN_STEPS = 300
SEED = 1234
TASK = "Uppercase"


def _word(rng: random.Random, mixed: bool = False) -> str:
    w = "".join(rng.choice(string.ascii_lowercase) for _ in range(WORD_LEN))
    return "".join(c.upper() if mixed and rng.random() < 0.5 else c for c in w)


def _messages(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _pretrain_row(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        w = _word(rng, mixed=True)
        return {"messages": _messages(f"Repeat: {w}", w)}
    w = _word(rng)
    return {"messages": _messages(f"Shout: {w}", w.upper() + "!")}


def task_rows(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(train rows in chat format, held-out {"question", "answer"}); held-out words never occur in train."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < TRAIN_ROWS + HELDOUT_ROWS:
        w = _word(rng)
        if w not in seen:
            seen.add(w)
            words.append(w)
    train = [{"messages": _messages(f"{TASK}: {w}", w.upper())} for w in words[:TRAIN_ROWS]]
    heldout = [{"question": f"{TASK}: {w}", "answer": w.upper()} for w in words[TRAIN_ROWS:]]
    return train, heldout
