"""GGUF files judged by llama.cpp itself (llama-cpp-python), against transformers on the source model.

Exports the demo and synthetic Llama 2 (SentencePiece), Llama 3 (byte-level BPE, llama3 RoPE scaling),
Mistral (GQA, head_dim != hidden/heads) and Qwen2 (qkv biases, tied embeddings, padded vocabulary) models —
the test suite's tiny models with real tokenizer types (tests/test_gguf.py; imported, not copied) — at f16,
q8_0, q4_0 and q4_k_m, loads each in llama.cpp (a child process per file: an abort is a result, not the end of
the run) and prints, per file: whether it loads, llama.cpp's warnings, token ids equal to the HF tokenizer's on
12 varied strings (special tokens parsed on both sides), max |delta logit| and top-1 agreement against
transformers, and whether the greedy chat completion equals transformers' greedy answer. The headline last.

Goals: every file loads and never aborts; token ids equal on every string for byte-level BPE tokenizers and
for the demo; f16 top-1 agreement 100%.

Needs llama-cpp-python (optional; `pip install llama-cpp-python==0.3.36` builds llama.cpp from source,
10-30 minutes on 2 cores).

    python benchmarks/gguf_llamacpp.py                 # all families and types (a few minutes on 2 cores)
    python benchmarks/gguf_llamacpp.py --families demo --types f16
    python benchmarks/gguf_llamacpp.py --quick         # the demo at f16 (what the suite runs)

`--quick` shows the script still runs: the demo at f16; without llama-cpp-python, everything up to llama.cpp
(the models, transformers' side, the export). Headline printed, exit 0 even on a goal miss, non-zero on an error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

FAMILIES = ("demo", "llama2", "llama3", "mistral", "qwen2")
TYPES = ("f16", "q8_0", "q4_0", "q4_k_m")
CHAT = [{"role": "user", "content": "The quick brown fox"}]
NEW_TOKENS = 12  # greedy answer length, both sides


def strings(tok) -> list[str]:
    specials = [t for t in (tok.bos_token, tok.eos_token) if t] or ["<|im_end|>"]
    return [
        "Hello world! How are you today?",
        "a\nb",
        "tab\there\tand\tthere",
        "runs   of    spaces     and  \n\n  newlines",
        "  leading and trailing  ",
        "café naïve Ærø façade Grüße",
        "emoji 🙂🚀🦙 and ✅",
        "digits 1 22 333 4444 55555 3.14159 1,000,000",
        "日本語のテキスト 中文字符",
        "Привет, мир! Ελληνικά",
        f"special {specials[0]} tokens {specials[-1]} inside",
        "def f(x):\n    return x * 2  # code\n",
    ]


def build(root: Path, families=FAMILIES) -> dict[str, Path]:
    """The test suite's tiny models, with the features each family is known for (`families` of them)."""
    from test_gguf import (
        CHATML_TEMPLATE,
        LLAMA2_TEMPLATE,
        LLAMA3_TEMPLATE,
        MISTRAL_TEMPLATE,
        byte_bpe_tokenizer,
        save_model,
        spm_tokenizer,
    )

    from core.demo.toy import build_tiny_model
    from core.gguf.vocab import LLAMA3_SPLIT, QWEN2_SPLIT

    l3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    qw = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    llama3_tok = byte_bpe_tokenizer(LLAMA3_SPLIT, l3, "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE)
    qwen_tok = byte_bpe_tokenizer(QWEN2_SPLIT, qw, None, "<|im_end|>", CHATML_TEMPLATE)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    makers = {
        "demo": lambda: build_tiny_model(root / "demo", "llama", initializer_range=0.1),
        "llama2": lambda: save_model(
            root / "llama2", "llama", spm_tokenizer(root / "llama2", LLAMA2_TEMPLATE)
        ),
        "llama3": lambda: save_model(root / "llama3", "llama", llama3_tok, rope_parameters=rope),
        "mistral": lambda: save_model(
            root / "mistral", "mistral", spm_tokenizer(root / "mistral", MISTRAL_TEMPLATE), head_dim=32
        ),
        "qwen2": lambda: save_model(
            root / "qwen2",
            "qwen2",
            qwen_tok,
            vocab_size=len(qwen_tok) + 7,
            tie_word_embeddings=True,
            bos_token_id=qwen_tok.convert_tokens_to_ids("<|endoftext|>"),
        ),
    }
    return {family: makers[family]() for family in families}


def hf_side(model_dir: Path):
    """transformers on the source: the strings and their expected ids, prompts and their logits, the greedy chat
    answer."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.gguf.verify_logits import PROMPTS
    from core.gguf.verify_tokenizer import expected_ids
    from core.gguf.vocab import byte_rows, load_source_tokenizer

    tok = load_source_tokenizer(model_dir)
    texts = strings(tok)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    n_src = model.config.vocab_size
    byte_base = n_src if byte_rows(model_dir) else None
    want_ids = [expected_ids(tok, t, byte_base) for t in texts]
    prompts = [tok(p)["input_ids"][:64] for p in PROMPTS]
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([p])).logits[0].float() for p in prompts]
    answer = None
    if tok.chat_template:
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(
                **ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id
            )
        answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts, want_ids, prompts, logits, answer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--tmp", default=None, help="folder for the temporary files (default: system temp)")
    ap.add_argument("--quick", action="store_true", help="the demo at f16 (goal not judged)")
    args = ap.parse_args()

    import numpy as np
    import torch

    from core.gguf import export_gguf, llamacpp
    from core.gguf.verify_logits import compare_logits

    have = llamacpp.available()
    if not have and not args.quick:
        print("llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36 (builds llama.cpp)")
        return 2
    if args.quick:
        args.families, args.types = "demo", "f16"
    families = [f for f in args.families.split(",") if f]
    types = [t for t in args.types.split(",") if t]
    rows, exported = [], 0
    with tempfile.TemporaryDirectory(prefix="gguf-llamacpp-", dir=args.tmp) as td:
        root = Path(td)
        models = build(root, families)
        for fam in families:
            texts, want_ids, prompts, hf_logits, hf_answer = hf_side(models[fam])
            for typ in types:
                out = root / f"{fam}-{typ}.gguf"
                result = export_gguf(models[fam], out, typ, "none", modelfile=False, progress_file=False)
                exported += 1
                if not have:  # --quick without llama.cpp: everything up to it
                    print(f"{fam}-{typ} ({result.vocab['style']}): exported, {out.stat().st_size:,} bytes")
                    continue
                npz = root / f"{fam}-{typ}.npz"
                chat = CHAT if hf_answer is not None else None
                r = llamacpp.run_check(out, texts, prompts, npz, chat=chat, max_tokens=NEW_TOKENS)
                row = {"family": fam, "type": typ, "style": result.vocab["style"], "loads": r["loaded"]}
                row["aborted"] = bool(r.get("aborted")) or r["exit_code"] != 0
                row["warnings"] = r["warnings"]
                toks = r.get("tokens") or []
                row["tokens_equal"] = sum(a == b for a, b in zip(want_ids, toks, strict=False))
                row["strings"] = len(texts)
                row["token_diffs"] = [
                    (t, w[:12], g[:12]) for t, w, g in zip(texts, want_ids, toks, strict=False) if w != g
                ]
                if npz.is_file():
                    with np.load(npz) as z:
                        got = [torch.from_numpy(z[f"p{i}"]) for i in range(len(prompts))]
                    lg = compare_logits(torch.cat(hf_logits), torch.cat(got), typ)
                    row.update(delta=lg["max_abs_delta"], top1=lg["argmax_agreement"])
                row["chat_hf"], row["chat_llama"] = hf_answer, r.get("chat")
                got = r.get("chat")
                row["chat_equal"] = hf_answer is None or hf_answer == got
                # SentencePiece: transformers' decoder drops the answer's leading "▁" space, llama.cpp keeps it
                row["chat_space"] = bool(got and hf_answer is not None and got == " " + hf_answer)
                rows.append(row)
                report(row)
    if not have:
        print(
            f"gguf_llamacpp: {exported} file(s) exported, none loaded: llama-cpp-python is not available here "
            f"({GOAL}; --quick: not judged)"
        )
        return 0
    return headline(rows, args.quick)


def report(row: dict) -> None:
    print(f"\n{row['family']}-{row['type']} ({row['style']})")
    print(f"  loads: {row['loads']}{'  ABORTED / FAILED' if row['aborted'] else ''}")
    for w in row["warnings"][:6]:
        print(f"  llama.cpp: {w[:150]}")
    print(f"  token ids equal to HF: {row['tokens_equal']}/{row['strings']}")
    for text, w, g in row["token_diffs"][:3]:
        print(f"    {text[:40]!r}: HF {w} llama.cpp {g}")
    if "delta" in row:
        print(f"  logits vs transformers: max |delta| {row['delta']:.3g}, top-1 agreement {row['top1']:.1%}")
    if row["chat_hf"] is not None:
        same = "equal" if row["chat_equal"] else "DIFFERENT"
        if row["chat_space"]:
            same = "equal but for the leading space llama.cpp's SentencePiece decoding keeps"
        print(f"  greedy chat: {same}: HF {row['chat_hf']!r} llama.cpp {row['chat_llama']!r}")


GOAL = "goal: every file loads, token ids equal for byte-level BPE and the demo, f16 top-1 100%"


def headline(rows: list[dict], quick: bool = False) -> int:
    strict = [r for r in rows if "byte-level" in r["style"] or r["family"] == "demo"]
    f16 = [r for r in rows if r["type"] == "f16" and "top1" in r]
    loads = sum(r["loads"] and not r["aborted"] for r in rows)
    tok_ok = sum(r["tokens_equal"] == r["strings"] for r in strict)
    f16_ok = sum(r["top1"] == 1.0 for r in f16)
    chats = sum(r["chat_equal"] or r["chat_space"] for r in rows)
    chats16 = sum(r["chat_equal"] or r["chat_space"] for r in rows if r["type"] == "f16")
    n16 = sum(r["type"] == "f16" for r in rows)
    ok = loads == len(rows) and tok_ok == len(strict) and f16_ok == len(f16)
    print(
        f"\ngguf_llamacpp: {loads}/{len(rows)} files load without aborting; token ids equal on every string for "
        f"{tok_ok}/{len(strict)} byte-level BPE and demo files (all files: "
        f"{sum(r['tokens_equal'] for r in rows)}/{sum(r['strings'] for r in rows)} strings); f16 top-1 100% on "
        f"{f16_ok}/{len(f16)}; greedy chat equal on {chats}/{len(rows)} (f16: {chats16}/{n16}) "
        f"({GOAL}{'; --quick: not judged' if quick else ''}) {'goals met' if ok else 'GOALS MISSED'}"
    )
    return 0 if ok or quick else 1


if __name__ == "__main__":
    sys.exit(main())
