"""llama.cpp itself, through llama-cpp-python (an optional dependency): K-quants and a check of the exported file
as llama.cpp loads, tokenizes and runs it.

Every call runs in a child process (`python -m core.gguf.llamacpp`): llama.cpp aborts the whole process on some
inputs (a vocabulary without byte tokens did, on the first newline), and an abort must fail a check, not take
the exporter or the page down with it. The child writes what it saw as JSON (logits as an .npz file); the
parent judges.

    pip install llama-cpp-python==0.3.36    # builds llama.cpp from source: 10-30 minutes on 2 cores

Set LORA_COCKPIT_NO_LLAMA_CPP=1 to behave as if it were not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

DISABLE_ENV = "LORA_COCKPIT_NO_LLAMA_CPP"
# --type -> llama_ftype (llama.h): the K-quant mixes llama-quantize makes
FTYPES = {"q2_k": 10, "q3_k_m": 12, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18}
# llama.cpp log lines worth showing: its warnings, and the fallbacks it takes silently otherwise (its metadata
# dump and model summary, which mention "unknown" fields in passing, are left out)
WARNING = re.compile(
    r"warn|degraded|not control-type|not found|missing|fall(ing )?back|mismatch|error|failed|"
    r"Using chat (bos|eos)_token",
    re.I,
)
NOT_WARNING = re.compile(r"^(llama_model_loader: - kv|Model metadata:|print_info:)")
TIMEOUT_S = 1800


class LlamaCppError(RuntimeError):
    pass


def available() -> bool:
    if os.environ.get(DISABLE_ENV) == "1":
        return False
    return importlib.util.find_spec("llama_cpp") is not None


def why_unavailable() -> str:
    """Why the llama.cpp check does not run here, and how to have it (for a report that says it was skipped)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return f"{DISABLE_ENV}=1 turns it off: unset it to check the file with llama.cpp itself"
    if not available():
        return (
            "llama-cpp-python is not installed: `pip install llama-cpp-python` (it builds llama.cpp, 10-30 minutes) "
            "and export again to have llama.cpp load, tokenize and run the file"
        )
    return "it runs"


def _run(request: dict, timeout: float = TIMEOUT_S) -> tuple[dict | None, int, list[str]]:
    """Run one request in a child; (its JSON reply or None, exit code, llama.cpp's warning lines)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "core.gguf.llamacpp"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired:
        return None, 124, [f"llama.cpp did not finish within {timeout:.0f} s"]  # as timeout(1) reports it
    lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
    warnings = [ln for ln in lines if WARNING.search(ln) and not NOT_WARNING.match(ln)]
    if proc.returncode != 0:
        # the last lines say why (an abort prints `terminate called ...` before SIGABRT)
        warnings += [ln for ln in lines[-3:] if ln not in warnings]
    reply = None
    for line in reversed((proc.stdout or "").splitlines()):
        if line.startswith("{"):
            reply = json.loads(line)
            break
    return reply, proc.returncode, warnings


def quantize(f16: Path, out: Path, out_type: str) -> None:
    """An f16 GGUF -> a K-quant with llama.cpp's own quantizer (the mixes llama-quantize makes)."""
    reply, code, warnings = _run(
        {"cmd": "quantize", "inp": str(f16), "out": str(out), "ftype": FTYPES[out_type]}
    )
    if code != 0 or not reply or reply.get("rc") != 0 or not out.is_file():
        why = (reply or {}).get("rc", f"exit {code}")
        raise LlamaCppError(
            f"llama.cpp's quantizer failed ({why}): {' | '.join(warnings[-2:]) or 'no output'}"
        )


def run_check(
    path: Path,
    texts: list[str],
    prompts: list[list[int]] | None = None,
    logits_out: Path | None = None,
    chat: list[dict] | None = None,
    max_tokens: int = 16,
) -> dict:
    """Load `path` in llama.cpp and report: loaded (bool), exit code, warnings, token ids of `texts` (special
    tokens parsed, no BOS added), logits of `prompts` (saved to `logits_out`, arrays p0, p1, ...), and the greedy
    chat completion of `chat` with the GGUF's own chat template."""
    request = {
        "cmd": "check",
        "path": str(path),
        "texts": texts,
        "prompts": prompts or [],
        "logits_out": str(logits_out) if logits_out else None,
        "chat": chat,
        "max_tokens": max_tokens,
    }
    reply, code, warnings = _run(request)
    out = {"loaded": bool(reply and reply.get("loaded")), "exit_code": code, "warnings": warnings}
    if code < 0 or code in (134, 139):
        out["aborted"] = True
    if reply:
        out.update({k: v for k, v in reply.items() if k != "loaded"})
    return out


# ---- the child -------------------------------------------------------------------------------------------------


def _child(request: dict) -> dict:
    import llama_cpp

    if request["cmd"] == "quantize":
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = int(request["ftype"])
        params.nthread = 0
        rc = llama_cpp.llama_model_quantize(
            request["inp"].encode(), request["out"].encode(), llama_cpp.byref(params)
        )
        return {"rc": int(rc)}

    import numpy as np

    prompts = request.get("prompts") or []
    n_ctx = max([len(p) for p in prompts] + [256]) + 64
    # Tokenizing alone needs only the vocabulary: the weights are not even mapped then.
    vocab_only = not prompts and not request.get("chat")
    llm = llama_cpp.Llama(
        request["path"],
        n_ctx=n_ctx,
        logits_all=True,
        verbose=True,
        n_threads=2,
        seed=0,
        vocab_only=vocab_only,
    )
    reply: dict = {"loaded": True, "n_vocab": llm.n_vocab(), "vocab_only": vocab_only}
    print(json.dumps({"loaded": True}), flush=True)  # a later abort still leaves this line
    reply["tokens"] = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in request["texts"]]
    if prompts and request.get("logits_out"):
        arrays = {}
        for i, ids in enumerate(prompts):
            llm.reset()
            llm.eval(ids)
            arrays[f"p{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
        np.savez(request["logits_out"], **arrays)
    if request.get("chat"):
        llm.reset()
        r = llm.create_chat_completion(
            request["chat"], temperature=0.0, top_k=1, max_tokens=int(request.get("max_tokens", 16)), seed=0
        )
        reply["chat"] = r["choices"][0]["message"]["content"]
    return reply


if __name__ == "__main__":
    result = _child(json.loads(sys.stdin.read()))
    print(json.dumps(result), flush=True)
