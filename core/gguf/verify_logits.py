"""The GGUF's logits checked against the source model's on fixed prompts (full verification): both loaded in
fp32 through transformers, one model in memory at a time, and judged per --type by LOGIT_LIMITS (compare_logits,
also used for llama.cpp's own logits).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from core.gguf.source import Source

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
PROMPTS = (
    "The capital of France is",
    "Hello! How are you today? I am fine, thank you.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)


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
