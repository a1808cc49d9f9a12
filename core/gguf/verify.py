"""Check a written GGUF against its source before it is allowed to become --out.

Everything is read back through independent code: tensors through gguf-py's reader and dequantizers with
transformers' own q/k un-permutation (so a wrong permutation in our writer cannot cancel itself out), the
config and tokenizer through transformers' GGUF loaders, and (full mode) the whole model through
`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, compared with the source model on fixed prompts.

quick: tensors (row blocks, bounded memory), config, tokenizer.  full: quick + logits.  The report is a dict.
This module checks the tensors and the config and runs llama.cpp's check; the tokenizer check is
core.gguf.verify_tokenizer's, the logits check core.gguf.verify_logits'.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from core.gguf.source import Source
from core.gguf.tensors import ARCH_ENUM
from core.gguf.verify_logits import check_logits, compare_logits
from core.gguf.verify_tokenizer import check_tokenizer, expected_ids, sample_texts

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
