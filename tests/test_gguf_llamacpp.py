"""The exported files in llama.cpp itself (issue #23): they load and never abort, tokenize as the source does,
give the source's logits, and K-quants go through llama.cpp's own quantizer. Needs llama-cpp-python (an
optional dependency that builds llama.cpp from source); without it these tests skip, except the summary line
the Merge & Export page shows, which is checked on a recorded report."""

from __future__ import annotations

import importlib.util

import gguf
import pytest
from test_gguf import families  # noqa: F401 - a fixture, used by name

from core.gguf import export_gguf, summary_lines

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="needs llama-cpp-python (pip install llama-cpp-python==0.3.36; builds llama.cpp, 10-30 min)",
)


@needs_llama_cpp
def test_demo_file_tokenizes_newline_tab_and_accents_in_llama_cpp(families, tmp_path):  # noqa: F811
    from core.gguf import llamacpp
    from core.gguf.verify_tokenizer import expected_ids
    from core.gguf.vocab import load_source_tokenizer

    out = tmp_path / "demo.gguf"
    export_gguf(families["demo"], out, "f16", "none", modelfile=False)
    texts = ["a\nb", "tab\there", "café 🙂", "Uppercase: hello\n"]
    r = llamacpp.run_check(out, texts, chat=[{"role": "user", "content": "Uppercase: hello\n"}])
    assert r["loaded"] and r["exit_code"] == 0 and not r.get("aborted"), r
    tok = load_source_tokenizer(families["demo"])
    assert r["tokens"] == [expected_ids(tok, t, 102) for t in texts]
    assert r["tokens"][0] == [tok.convert_tokens_to_ids("a"), 102 + 0x0A, tok.convert_tokens_to_ids("b")]
    assert isinstance(r.get("chat"), str)  # the chat completion that used to kill the process


@needs_llama_cpp
def test_a_file_without_byte_tokens_aborts_and_the_check_says_so(families, tmp_path, monkeypatch):  # noqa: F811
    """The defect itself: the demo's old vocabulary (no byte tokens) aborts llama.cpp on a newline; the check
    runs in a child, so it reports the abort instead of dying with it."""
    from core.gguf import llamacpp, vocab

    monkeypatch.setattr(vocab, "BYTE_TOKENS", [])
    out = tmp_path / "old-demo.gguf"
    export_gguf(families["demo"], out, "f16", "none", modelfile=False)
    r = llamacpp.run_check(out, ["a\nb"])
    assert r["exit_code"] != 0 and r.get("aborted"), r


@needs_llama_cpp
@pytest.mark.parametrize("family", ["llama3", "qwen2", "demo", "llama2"])
def test_full_verification_includes_llama_cpp(families, tmp_path, family):  # noqa: F811
    result = export_gguf(families[family], tmp_path / f"{family}.gguf", "f16", "full")
    lc = result.report["llama_cpp"]
    assert lc["ok"] and lc["loads"] and lc["exit_code"] == 0, lc
    if family != "llama2":  # byte-level BPE and the demo: every sample tokenized exactly as the source does
        assert lc["tokens_equal"] == lc["samples"], lc["token_mismatches"]
    assert lc["logits"]["argmax_agreement_beyond_ties"] == 1.0
    assert any(line.startswith("llama.cpp: loads") for line in summary_lines(result))


@needs_llama_cpp
@pytest.mark.parametrize("out_type", ["q4_k_m", "q6_k"])
def test_k_quants_through_llama_cpp_python(families, tmp_path, monkeypatch, out_type):  # noqa: F811
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no llama-quantize: llama-cpp-python's quantizer does it
    out = tmp_path / f"l3-{out_type}.gguf"
    result = export_gguf(families["llama3"], out, out_type, "quick")
    assert out.is_file() and result.report["ok"], result.report
    want = {"q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K}[out_type]
    assert gguf.GGUFReader(str(out)).get_field("general.file_type").contents() == want


def test_summary_shows_the_llama_cpp_verdict():
    """What the Merge & Export page shows (it prints summary_lines), from a recorded report."""
    d = {
        "out": "/x/m.gguf",
        "out_type": "f16",
        "size": 1024**2,
        "seconds": 1.0,
        "vocab": {"style": "byte-level BPE", "tokens": 10, "special_ids": {}},
        "modelfile": None,
        "report": {
            "mode": "quick",
            "tensors": {"checked": 1, "worst": {"name": "t", "rel_rms": 0.0, "limit": 1e-3}},
            "tokenizer": {"matched": 9, "judged": 9, "notes": []},
            "llama_cpp": {
                "loads": True,
                "exit_code": 0,
                "ok": False,
                "samples": 9,
                "tokens_equal": 8,
                "warnings": ["load: missing pre-tokenizer type, using: 'default'"],
                "reason": "it tokenizes 1 of 9 sample(s) differently from the source",
            },
        },
    }
    lines = summary_lines(d)
    line = next(x for x in lines if x.startswith("llama.cpp:"))
    assert "8/9 samples" in line and "FAILS" in line and "missing pre-tokenizer" in line
    d["report"]["llama_cpp"] = {
        "loads": True,
        "exit_code": 134,
        "aborted": True,
        "reason": "llama.cpp aborts",
    }
    assert "llama.cpp: FAILS: llama.cpp aborts" in summary_lines(d)
