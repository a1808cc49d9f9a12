"""Check a written GGUF against its source before it is allowed to become --out.

Everything is read back through independent code: tensors through gguf-py's reader and dequantizers with
transformers' own q/k un-permutation (so a wrong permutation in our writer cannot cancel itself out), the
config and tokenizer through transformers' GGUF loaders, and (full mode) the whole model through
`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, compared with the source model on fixed prompts.

quick: tensors (row blocks, bounded memory), config, tokenizer.  full: quick + logits.  The report is a dict.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import numpy as np

from core.gguf.source import Source
from core.gguf.tensors import ARCH_ENUM

MB = 1024**2
BLOCK_BYTES = 16 * MB

# Relative RMS error allowed per GGUF tensor type, against the source tensor. Rounding alone gives
# f16 <= 2^-11 and bf16 <= 2^-9 per element; the quant figures are ~2x what gaussian weights give.
TENSOR_RMS_LIMITS = {
    "F32": 1e-6,
    "F16": 1e-3,
    "BF16": 4e-3,
    "Q8_0": 0.02,
    "Q6_K": 0.03,
    "Q5_0": 0.08,
    "Q5_K": 0.08,
    "Q4_0": 0.15,
    "Q4_K": 0.15,
    "Q3_K": 0.3,
    "Q2_K": 0.5,
}
# Logit checks per --type. f16/bf16: every argmax must agree unless the source itself has a near-tie (the two
# tokens' source logits closer than the tolerance), and max |delta logit| <= rtol * max |source logit| + atol.
# Quantized: fractions of positions; thresholds chosen for 4-8 bit rounding of the weights.
LOGIT_LIMITS = {
    "f16": {"rtol": 1e-2, "atol": 1e-3, "argmax": 1.0},
    "bf16": {"rtol": 5e-2, "atol": 1e-3, "argmax": 1.0},
    "q8_0": {"argmax": 0.95, "top5": 0.90},
    "q6_k": {"argmax": 0.95, "top5": 0.90},
    "q5_0": {"argmax": 0.85, "top5": 0.75},
    "q5_k_m": {"argmax": 0.85, "top5": 0.75},
    "q5_k_s": {"argmax": 0.85, "top5": 0.75},
    "q4_0": {"argmax": 0.80, "top5": 0.70},
    "q4_k_m": {"argmax": 0.80, "top5": 0.70},
    "q4_k_s": {"argmax": 0.80, "top5": 0.70},
    "q3_k_m": {"argmax": 0.65, "top5": 0.55},
    "q2_k": {"argmax": 0.5, "top5": 0.4},
}
SAMPLE_TEXTS = (
    "Hello world! How are you today?",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def add(a, b):\n    return a + b  # sum of two numbers\n",
    "Bonjour, ça va ? Grüße aus München. ¿Qué tal, señor?",
    "日本語のテキストと中文字符。",
    "Привет, мир! Ελληνικά γράμματα. مرحبا بالعالم",
    "emoji 🙂🚀 and   several   spaces\tand tabs",
    " leading space and trailing space ",
)
PROMPTS = (
    "The capital of France is",
    "Hello! How are you today? I am fine, thank you.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)


def _reverse_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    # transformers' own inverse of llama.cpp's permutation, not ours: an error in either shows up here.
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(rows, n_head, n_head)


def check_tensors(gguf_path: Path, src: Source, sample: bool, extra_row_source: int | None = None) -> dict:
    """Dequantize GGUF tensors block by block and compare them with the source (relative RMS error).

    Rows a GGUF tensor has beyond the source's (the embedding and head rows of appended byte tokens) are
    compared with the source row they copy, `extra_row_source`."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(gguf_path))
    name_map = gguf.get_tensor_name_map(ARCH_ENUM[src.arch], src.n_layers)
    by_name = {t.name: t for t in reader.tensors}
    pairs = []
    for key, st in src.tensors.items():
        stem, _, suffix = key.rpartition(".")
        mapped = name_map.get_name(stem)
        if mapped is None or (key == "lm_head.weight" and src.tied):
            continue
        pairs.append((f"{mapped}.{suffix}", st))
    missing = [n for n, _ in pairs if n not in by_name]
    if sample:
        last = src.n_layers - 1
        keep = (
            "token_embd.",
            "output.",
            "output_norm.",
            "blk.0.",
            f"blk.{last}.attn_q",
            f"blk.{last}.attn_k",
        )
        pairs = [(n, st) for n, st in pairs if n.startswith(keep)]
    worst = {"name": None, "rel_rms": 0.0, "limit": None}
    failures = []
    for name, st in pairs:
        t = by_name.get(name)
        if t is None:
            continue
        qname = t.tensor_type.name
        limit = TENSOR_RMS_LIMITS.get(qname, 0.5)
        rows = st.shape[0]
        cols = math.prod(st.shape[1:]) if len(st.shape) > 1 else 1
        gguf_rows = int(t.n_elements) // cols
        if gguf_rows != rows and (gguf_rows < rows or extra_row_source is None):
            failures.append({"name": name, "type": qname, "rel_rms": math.inf, "limit": limit})
            continue
        heads = 0
        if src.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = src.n_head if "attn_q" in name else src.n_kv_head
        unit = rows // heads if heads else 1
        step = max(unit, (BLOCK_BYTES // (4 * cols)) // unit * unit)
        err2 = ref2 = 0.0
        row_bytes = int(t.n_bytes) // gguf_rows
        plain = {"F32": np.float32, "F16": np.float16}.get(qname, np.uint8)
        # Plain reads, not the reader's memory map: mapped pages would stay in RSS for the whole check.
        with safe_open(str(st.file), framework="pt") as f, open(gguf_path, "rb") as fh:
            sl = f.get_slice(st.key)
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                ref = sl[start:stop].float().numpy().reshape(stop - start, -1)
                raw = os.pread(
                    fh.fileno(), (stop - start) * row_bytes, int(t.data_offset) + start * row_bytes
                )
                data = np.frombuffer(raw, dtype=np.uint8).reshape(stop - start, row_bytes).view(plain)
                got = gguf.dequantize(data, t.tensor_type).reshape(stop - start, -1)
                del raw, data
                if heads:
                    got = _reverse_permute(got, (stop - start) // unit)
                err2 += float(np.square(got.astype(np.float64) - ref).sum())
                ref2 += float(np.square(ref.astype(np.float64)).sum())
            if gguf_rows > rows:
                n = gguf_rows - rows
                ref = sl[extra_row_source : extra_row_source + 1].float().numpy().reshape(1, -1)
                raw = os.pread(fh.fileno(), n * row_bytes, int(t.data_offset) + rows * row_bytes)
                data = np.frombuffer(raw, dtype=np.uint8).reshape(n, row_bytes).view(plain)
                got = gguf.dequantize(data, t.tensor_type).reshape(n, -1)
                err2 += float(np.square(got.astype(np.float64) - ref).sum())
                ref2 += n * float(np.square(ref.astype(np.float64)).sum())
        rel = math.sqrt(err2 / ref2) if ref2 > 0 else math.sqrt(err2)
        if rel > worst["rel_rms"] or worst["name"] is None:
            worst = {"name": name, "rel_rms": rel, "limit": limit}
        if not rel <= limit:
            failures.append({"name": name, "type": qname, "rel_rms": rel, "limit": limit})
    expected = {n for n, _ in pairs}
    return {
        "ok": not failures and not missing,
        "gguf_tensors": len(reader.tensors),
        "checked": len(expected),
        "worst": worst,
        "failures": failures[:10],
        "missing": missing[:10],
    }


def check_config(tmp_dir: Path, gguf_name: str, src: Source, n_vocab: int | None = None) -> dict:
    """`n_vocab`: the GGUF's vocabulary (the source's rows plus appended byte tokens)."""
    from transformers import AutoConfig

    got = AutoConfig.from_pretrained(str(tmp_dir), gguf_file=gguf_name)
    c = src.config
    want = {
        "model_type": {"llama": "llama", "qwen2": "qwen2"}[src.arch],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": src.n_kv_head,
        "vocab_size": n_vocab or c["vocab_size"],
        "tie_word_embeddings": src.tied,
    }
    mismatches = [
        {"field": k, "source": v, "gguf": getattr(got, k, None)}
        for k, v in want.items()
        if getattr(got, k, None) != v
    ]
    eps = getattr(got, "rms_norm_eps", None)
    if eps is None or not math.isclose(eps, c.get("rms_norm_eps", 1e-6), rel_tol=1e-6):
        mismatches.append({"field": "rms_norm_eps", "source": c.get("rms_norm_eps"), "gguf": eps})
    theta = (getattr(got, "rope_parameters", None) or {}).get("rope_theta", getattr(got, "rope_theta", None))
    if theta is None or not math.isclose(
        float(theta), float(src.rope_parameters["rope_theta"]), rel_tol=1e-6
    ):
        mismatches.append({"field": "rope_theta", "source": src.rope_parameters["rope_theta"], "gguf": theta})
    return {"ok": not mismatches, "mismatches": mismatches}


def load_gguf_tokenizer(tmp_dir: Path, gguf_name: str, notes: list[str]):
    """transformers' GGUF tokenizer, made to honour `add_space_prefix = false`, which its loader ignores."""
    import gguf
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_dir), gguf_file=gguf_name)
    reader = gguf.GGUFReader(str(tmp_dir / gguf_name))
    field = reader.get_field(gguf.Keys.Tokenizer.ADD_PREFIX)
    if field is not None and not bool(field.contents()):
        pre = tok.backend_tokenizer.pre_tokenizer
        if pre is not None and "Metaspace" in type(pre).__name__:
            tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
                prepend_scheme="never", split=False
            )
            notes.append(
                "tokenizer.ggml.add_space_prefix is false; transformers' GGUF loader ignores that key (llama.cpp "
                "reads it), so the check applies it to the loaded tokenizer."
            )
    return tok


def sample_texts(tokenizer) -> list[str]:
    texts = list(SAMPLE_TEXTS)
    specials = [t for t in tokenizer.all_special_tokens if t]
    if specials:
        texts.append("before " + " mid ".join(specials) + " after")
    if getattr(tokenizer, "chat_template", None):
        try:
            chat = [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Hello, how can I help?"},
            ]
            texts.append(tokenizer.apply_chat_template(chat, tokenize=False))
        except Exception:  # a template that needs other roles or tools: the plain samples still run
            pass
    return texts


def expected_ids(source_tok, text: str, byte_base: int | None) -> list[int]:
    """The source's ids for `text`, as the GGUF should give them: where the GGUF has byte tokens the source
    lacks (`byte_base`: the id of <0x00>), each <unk> becomes the byte tokens of the text it stands for, which
    is how llama.cpp's SentencePiece path spells a character outside the vocabulary."""
    enc = source_tok(text, add_special_tokens=False, return_offsets_mapping=byte_base is not None)
    ids = enc["input_ids"]
    unk = source_tok.unk_token_id
    if byte_base is None or unk is None or unk not in ids:
        return ids
    out: list[int] = []
    for i, (a, b) in zip(ids, enc["offset_mapping"], strict=True):
        if i == unk and b > a and text[a:b] != source_tok.unk_token:  # not the literal <unk> token
            out += [byte_base + x for x in text[a:b].encode("utf-8")]
        else:
            out.append(i)
    return out


def check_tokenizer(tmp_dir: Path, gguf_name: str, source_tok, byte_base: int | None = None) -> dict:
    """The GGUF's tokenizer (as transformers reads it) against the source on sample texts. `byte_base`: the id
    of the byte token <0x00> when the export appended byte tokens to a character-level vocabulary; texts with
    characters outside it are then judged against the source's ids with each <unk> spelled in bytes."""
    notes: list[str] = []
    try:
        gtok = load_gguf_tokenizer(tmp_dir, gguf_name, notes)
    except Exception as e:
        return {
            "ok": False,
            "error": f"transformers cannot build a tokenizer from the GGUF: {e}",
            "notes": notes,
        }
    matched, mismatches, spelled = 0, [], 0
    texts = sample_texts(source_tok)
    for text in texts:
        want = expected_ids(source_tok, text, byte_base)
        got = gtok(text, add_special_tokens=False)["input_ids"]
        if byte_base is not None and any(i >= byte_base for i in want):
            spelled += 1
        if want == got:
            matched += 1
        else:
            mismatches.append({"text": text, "source": want[:40], "gguf": got[:40]})
    want = source_tok("Hello")["input_ids"]
    got = gtok("Hello")["input_ids"]
    specials_ok = want == got
    if not specials_ok:
        mismatches.append({"text": "Hello (with special tokens added)", "source": want, "gguf": got})
    if spelled:
        notes.append(
            f"{spelled} sample(s) have characters outside the source's vocabulary (<unk> there): judged as "
            "llama.cpp spells them, one byte token per UTF-8 byte."
        )
    return {
        "ok": not mismatches,
        "samples": len(texts),
        "judged": len(texts),
        "matched": matched,
        "add_special_tokens_agree": specials_ok,
        "not_judged": [],
        "unk_spelled_as_bytes": spelled,
        "mismatches": mismatches[:5],
        "notes": notes,
    }


def _prompt_ids(tok, vocab_size: int) -> list[list[int]]:
    import torch

    texts = list(PROMPTS)
    if getattr(tok, "chat_template", None):
        with contextlib.suppress(Exception):
            texts.append(
                tok.apply_chat_template([{"role": "user", "content": "Write a haiku."}], tokenize=False)
                + "Morning"
            )
    out = []
    for t in texts:
        ids = [i for i in tok(t)["input_ids"] if i < vocab_size][:64]
        if ids:
            out.append(torch.tensor([ids]))
    return out


def _logits(model, prompts):
    import torch

    with torch.no_grad():
        return [model(input_ids=p).logits[0].float() for p in prompts]


def check_logits(
    tmp_dir: Path, gguf_name: str, src: Source, source_tok, out_type: str, keep: dict | None = None
) -> dict:
    """Source model vs the GGUF as transformers dequantizes it, one model in memory at a time. `keep` receives
    the prompts and the source's logits, for the llama.cpp check."""
    import gc

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    notes = []
    prompts = _prompt_ids(source_tok, int(src.config["vocab_size"]))
    model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32)
    want = _logits(model, prompts)
    if keep is not None:
        keep.update(prompts=[p[0].tolist() for p in prompts], logits=want)
    del model
    gc.collect()
    kwargs = {}
    rp = src.rope_parameters
    if rp.get("rope_type") in ("linear", "llama3"):
        # transformers' GGUF loader does not read llama.cpp's rope-scaling keys or rope_freqs; give it the
        # source's scaling so the comparison tests the weights rather than that gap.
        cfg = AutoConfig.from_pretrained(str(tmp_dir), gguf_file=gguf_name)
        cfg.rope_parameters = dict(rp)
        kwargs["config"] = cfg
        notes.append(
            f"RoPE scaling {rp['rope_type']!r} applied from the source config (not read from the GGUF)."
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_dir), gguf_file=gguf_name, dtype=torch.float32, **kwargs
    )
    got = _logits(model, prompts)
    del model
    gc.collect()

    report = compare_logits(torch.cat(want), torch.cat(got), out_type)
    report["notes"] = notes + report["notes"]
    return report


def compare_logits(a, b, out_type: str) -> dict:
    """Source logits `a` vs a GGUF reader's `b` (positions x vocab tensors), judged by LOGIT_LIMITS[out_type]."""
    # Rows the GGUF appends (byte tokens) have no source logit; the comparison is over the source's vocabulary.
    b = b[:, : a.shape[-1]]
    notes: list[str] = []
    limits = LOGIT_LIMITS.get(out_type, {"argmax": 0.5, "top5": 0.4})
    delta = (a - b).abs().max().item()
    top_src, top_gguf = a.argmax(-1), b.argmax(-1)
    raw_agree = (top_src == top_gguf).float().mean().item()
    k = min(5, a.shape[-1])
    ta, tb = a.topk(k, -1).indices, b.topk(k, -1).indices
    overlap = float(
        np.mean([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(ta, tb, strict=True)])
    )
    report = {
        "positions": int(a.shape[0]),
        "max_abs_delta": delta,
        "source_max_abs_logit": a.abs().max().item(),
        "argmax_agreement": raw_agree,
        "top5_overlap": overlap,
        "limits": limits,
        "notes": notes,
    }
    if "rtol" in limits:
        tol = limits["rtol"] * report["source_max_abs_logit"] + limits["atol"]
        # A disagreement only counts when the GGUF's pick is worse than the source's best by more than the
        # rounding tolerance; otherwise the source itself cannot tell the two tokens apart.
        chosen = a.gather(-1, top_gguf[:, None])[:, 0]
        real = (a.max(-1).values - chosen) > tol
        agree = 1.0 - real.float().mean().item()
        report.update(tolerance=tol, argmax_agreement_beyond_ties=agree)
        report["ok"] = delta <= tol and agree >= limits["argmax"]
        if not report["ok"]:
            report["reason"] = (
                f"max |delta logit| {delta:.3g} (tolerance {tol:.3g}), argmax agreement {agree:.1%} outside near-ties"
            )
    else:
        report["ok"] = raw_agree >= limits["argmax"] and overlap >= limits["top5"]
        if not report["ok"]:
            report["reason"] = (
                f"argmax agreement {raw_agree:.1%} (need {limits['argmax']:.0%}), "
                f"top-5 overlap {overlap:.1%} (need {limits['top5']:.0%})"
            )
    return report


def check_llama_cpp(
    path: Path, source_tok, out_type: str, byte_base: int | None, vocab=None, keep: dict | None = None
) -> dict:
    """The file as llama.cpp itself reads it (core/gguf/llamacpp.py, in a child process): it loads without
    aborting, tokenizes the sample texts as the source does (special tokens parsed, as transformers parses them;
    required for byte-level BPE and character-level vocabularies, reported for SentencePiece, where llama.cpp
    and transformers are known to differ on some spacing), and, when `keep` holds the source's logits (full
    mode), gives the same logits within LOGIT_LIMITS."""
    import tempfile

    import torch

    from core.gguf import llamacpp

    texts = sample_texts(source_tok)
    prompts = (keep or {}).get("prompts") or []
    with tempfile.TemporaryDirectory(prefix="gguf-llamacpp-") as td:
        npz = Path(td) / "logits.npz"
        r = llamacpp.run_check(path, texts, prompts, npz if prompts else None)
        got_logits = None
        if prompts and npz.is_file():
            with np.load(npz) as z:
                got_logits = [torch.from_numpy(z[f"p{i}"]) for i in range(len(prompts))]
    report: dict = {"loads": r["loaded"], "exit_code": r["exit_code"], "warnings": r["warnings"][:20]}
    if not r["loaded"] or r["exit_code"] != 0:
        what = "aborts" if r.get("aborted") else f"exits with code {r['exit_code']}"
        report.update(ok=False, reason=f"llama.cpp {what} on this file ({' | '.join(r['warnings'][-2:])})")
        return report
    strict = vocab is None or vocab.model == "gpt2" or vocab.style == "character-level"
    mismatches = []
    for text, got in zip(texts, r.get("tokens") or [], strict=False):
        want = expected_ids(source_tok, text, byte_base)
        if got != want:
            mismatches.append({"text": text, "source": want[:40], "llama_cpp": got[:40]})
    report.update(
        samples=len(texts), tokens_equal=len(texts) - len(mismatches), token_mismatches=mismatches[:5]
    )
    reasons = []
    if mismatches and strict:
        reasons.append(
            f"it tokenizes {len(mismatches)} of {len(texts)} sample(s) differently from the source"
        )
    if got_logits is not None:
        lg = compare_logits(torch.cat(keep["logits"]), torch.cat(got_logits), out_type)
        report["logits"] = lg
        if not lg["ok"]:
            reasons.append("its logits differ: " + lg["reason"])
    report["ok"] = not reasons
    report["reason"] = "; ".join(reasons) or None
    return report


def full_check_fits(src: Source) -> bool:
    """Whether two fp32 copies of the model (source, then GGUF) fit comfortably in available RAM."""
    import psutil

    params = sum(math.prod(t.shape) for t in src.tensors.values())
    return 2 * 4 * params + 1024 * MB < 0.7 * psutil.virtual_memory().available


def verify(
    tmp_dir: Path, gguf_name: str, src: Source, source_tok, out_type: str, mode: str, vocab=None
) -> dict:
    """`vocab`: the VocabInfo written (its appended byte tokens are checked as such)."""
    extra = getattr(vocab, "extra_rows", 0)
    n_src = int(src.config["vocab_size"])
    report: dict = {"mode": mode, "type": out_type}
    if mode == "none":
        report["ok"] = True
        return report
    source_row = vocab.extra_row_source if extra else None
    report["tensors"] = check_tensors(
        tmp_dir / gguf_name, src, sample=(mode == "quick"), extra_row_source=source_row
    )
    report["config"] = check_config(tmp_dir, gguf_name, src, n_vocab=n_src + extra)
    report["tokenizer"] = check_tokenizer(tmp_dir, gguf_name, source_tok, byte_base=n_src if extra else None)
    reasons = []
    t = report["tensors"]
    if not t["ok"]:
        if t["missing"]:
            reasons.append(f"tensors missing from the GGUF: {', '.join(t['missing'][:3])}")
        for f in t["failures"][:2]:
            reasons.append(
                f"{f['name']} differs from the source (relative error {f['rel_rms']:.3g} > {f['limit']})"
            )
    if not report["config"]["ok"]:
        fields = ", ".join(m["field"] for m in report["config"]["mismatches"])
        reasons.append(f"the config read back from the GGUF differs in {fields}")
    tk = report["tokenizer"]
    if not tk["ok"]:
        reasons.append(
            tk.get("error") or f"the GGUF tokenizer gives different ids on {len(tk['mismatches'])} sample(s)"
        )
    keep: dict = {}
    if mode == "full":
        report["logits"] = check_logits(tmp_dir, gguf_name, src, source_tok, out_type, keep)
        if not report["logits"]["ok"]:
            reasons.append("logits differ: " + report["logits"]["reason"])
    from core.gguf import llamacpp

    if llamacpp.available():
        lc = report["llama_cpp"] = check_llama_cpp(
            tmp_dir / gguf_name, source_tok, out_type, n_src if extra else None, vocab, keep
        )
        if not lc["ok"]:
            reasons.append("llama.cpp: " + lc["reason"])
    report["ok"] = not reasons
    report["reason"] = "; ".join(reasons) or None
    return report
