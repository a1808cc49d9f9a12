"""GGUF vocabulary metadata as llama.cpp reads it and as its own converter (convert_hf_to_gguf.py, gguf-py's
SpecialVocab) writes it (issue #23 items 1, 3, 4; issue #25 item 2). Fast: no model is exported except where
the file itself is the subject."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
from test_gguf import (  # noqa: F401 - `families` is a fixture, used by name
    CHATML_TEMPLATE,
    byte_bpe_tokenizer,
    families,
    spm_tokenizer,
)

from core.gguf import export_gguf
from core.gguf.pretok import CHECK_TEXT, KNOWN, check_hash
from core.gguf.vocab import LLAMA3_SPLIT, QWEN2_SPLIT, read_vocab

T = gguf.TokenType
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _folder(tmp_path: Path, tok, **config) -> Path:
    """A folder with the tokenizer and a config.json (what read_vocab reads besides the tokenizer)."""
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": len(tok), **config}))
    return tmp_path


def _field(path: Path, key: str):
    f = gguf.GGUFReader(str(path)).get_field(key)
    return None if f is None else f.contents()


# ---- item 1: the demo's character vocabulary gets byte tokens ------------------------------------------------


def llama_cpp_byte_to_token(tokens: list[str], byte: int) -> int:
    """llama.cpp's `llama_vocab::byte_to_token` for a SentencePiece ("llama") vocabulary: `<0xXX>`, else the
    byte as a one-character token, else `token_to_id.at()` throws std::out_of_range and the process aborts."""
    ids = {t: i for i, t in enumerate(tokens)}
    for text in (f"<0x{byte:02X}>", chr(byte)):
        if text in ids:
            return ids[text]
    raise LookupError(f"llama.cpp aborts: no token for byte 0x{byte:02X}")


def test_demo_gguf_spells_every_byte_and_gives_byte_tokens_unk_weights(families, tmp_path):  # noqa: F811
    import numpy as np
    from safetensors import safe_open

    out = tmp_path / "demo.gguf"
    export_gguf(families["demo"], out, "f16", "none", modelfile=False)
    r = gguf.GGUFReader(str(out))
    tokens = r.get_field("tokenizer.ggml.tokens").contents()
    types = r.get_field("tokenizer.ggml.token_type").contents()
    # "\n", "\t", "é", any byte at all: llama.cpp's SentencePiece byte fallback finds a token
    for b in range(256):
        llama_cpp_byte_to_token(tokens, b)
    n_src = json.loads((families["demo"] / "config.json").read_text())["vocab_size"]
    assert tokens[n_src:] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[n_src:]) == {T.BYTE}
    assert r.get_field("llama.vocab_size").contents() == len(tokens) == n_src + 256
    # the byte tokens' rows are the source's <unk> rows (embedding and head): the model sees what it saw
    emb = {t.name: t for t in r.tensors}["token_embd.weight"]
    got = np.asarray(emb.data, dtype=np.float32).reshape(len(tokens), -1)
    with safe_open(str(families["demo"] / "model.safetensors"), "np") as f:
        src = f.get_tensor("model.embed_tokens.weight")
    unk = 3
    assert np.allclose(got[:n_src], src, atol=1e-3) and np.allclose(got[n_src:], src[unk], atol=1e-3)


def test_demo_vocab_types_and_estimate(families):  # noqa: F811
    from core.gguf import estimate_size
    from core.gguf.export import ALIGN

    v = read_vocab(families["demo"], 102)
    assert v.extra_rows == 256 and v.extra_row_source == 3
    assert v.tokens[101] == "\u2581"  # space, in the ▁ spelling llama.cpp's sentencepiece path looks up
    # the size estimate counts the appended rows: exact for the tensor bytes
    est = estimate_size(families["demo"], "f16")
    emb_bytes = (102 + 256) * 64 * 2
    assert est["by_type"]["F16"] >= 2 * ((emb_bytes + ALIGN - 1) // ALIGN * ALIGN)  # embedding and head


# ---- issue #25 item 2: token types as llama.cpp's converter writes them -------------------------------------


def converter_bpe_types(tok, vocab_size: int) -> list[int]:
    """llama.cpp's `get_vocab_base` (byte-level BPE): added tokens that are special or look special are CONTROL,
    other added tokens USER_DEFINED, the rest NORMAL, missing ids UNUSED. Never UNKNOWN."""
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    out = []
    for i in range(vocab_size):
        if i not in reverse:
            out.append(T.UNUSED)
        elif reverse[i] in added:
            special = decoder[i].special or (reverse[i].startswith("<|") and reverse[i].endswith("|>"))
            out.append(T.CONTROL if special else T.USER_DEFINED)
        else:
            out.append(T.NORMAL)
    return out


def converter_spm_types(model_file: Path, config: dict, vocab_size: int) -> list[int]:
    """llama.cpp's `_create_vocab_sentencepiece` (a folder with tokenizer.model): types from the model (unknown,
    control, unused, byte), then every entry of tokenizer_config.json's added_tokens_decoder: special (or
    looking special) -> CONTROL, else USER_DEFINED."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    out = [T.UNUSED] * vocab_size
    for i in range(sp.vocab_size()):
        out[i] = T.NORMAL
        if sp.IsUnknown(i):
            out[i] = T.UNKNOWN
        elif sp.IsControl(i):
            out[i] = T.CONTROL
        elif sp.IsUnused(i):
            out[i] = T.UNUSED
        elif sp.IsByte(i):
            out[i] = T.BYTE
    for i, d in config.get("added_tokens_decoder", {}).items():
        looks = d["content"].startswith("<|") and d["content"].endswith("|>")
        out[int(i)] = T.CONTROL if d.get("special") or looks else T.USER_DEFINED
    return out


def converter_llama_hf_types(tok, vocab_size: int) -> list[int]:
    """llama.cpp's `LlamaHfVocab` (a SentencePiece-style tokenizer.json without tokenizer.model): `<0xXX>` BYTE,
    every special id CONTROL, added tokens that are not special USER_DEFINED, the rest NORMAL."""
    import re

    reverse = {i: t for t, i in tok.get_vocab().items()}
    specials = set(tok.all_special_ids)
    added = tok.get_added_vocab()
    out = []
    for i in range(vocab_size):
        t = reverse[i]
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
            out.append(T.BYTE)
        elif i in specials:
            out.append(T.CONTROL)
        elif t in added:
            out.append(T.USER_DEFINED)
        else:
            out.append(T.NORMAL)
    return out


def test_bpe_unk_that_is_an_added_special_token_is_control(tmp_path):
    tok = byte_bpe_tokenizer(QWEN2_SPLIT, QWEN_SPECIALS, None, "<|im_end|>", CHATML_TEMPLATE)
    tok.unk_token = "<|endoftext|>"  # as some Qwen2-style tokenizers set it
    folder = _folder(tmp_path, tok)
    v = read_vocab(folder, len(tok), tok)
    unk = tok.convert_tokens_to_ids("<|endoftext|>")
    assert v.model == "gpt2" and v.special["unk"] == unk
    assert v.types[unk] == T.CONTROL
    assert T.UNKNOWN not in v.types  # a BPE vocabulary has no UNKNOWN token in llama.cpp's converter
    assert v.types == converter_bpe_types(tok, len(tok))


def test_bpe_added_tokens_follow_the_converter_rule(tmp_path):
    """Added tokens that are not special: USER_DEFINED, unless they look special (`<|...|>`) -> CONTROL."""
    from tokenizers import AddedToken

    tok = byte_bpe_tokenizer(LLAMA3_SPLIT, ["<|begin_of_text|>", "<|eot_id|>"], None, "<|eot_id|>", "")
    tok.add_tokens([AddedToken("<|tool|>", special=False), AddedToken("mytoken", special=False)])
    folder = _folder(tmp_path, tok)
    v = read_vocab(folder, len(tok), tok)
    assert v.types[tok.convert_tokens_to_ids("<|tool|>")] == T.CONTROL
    assert v.types[tok.convert_tokens_to_ids("mytoken")] == T.USER_DEFINED
    assert v.types == converter_bpe_types(tok, len(tok))


def test_sentencepiece_types_follow_the_converter_rule(tmp_path):
    """Both of the converter's SentencePiece paths: tokenizer.json only (what transformers 5 saves), and a hub
    folder with tokenizer.model and the special tokens in tokenizer_config.json's added_tokens_decoder."""
    tok = spm_tokenizer(tmp_path / "spm", "")
    folder = _folder(tmp_path / "spm-saved", tok)
    v = read_vocab(folder, len(tok), tok)
    assert v.model == "llama"
    assert v.types[tok.unk_token_id] == T.CONTROL  # the unk token is special: CONTROL in both paths
    assert v.types.count(T.BYTE) == 256
    assert v.types == converter_llama_hf_types(tok, len(tok))
    sp_model = tmp_path / "spm-spm" / "tok" / "tokenizer.model"  # where spm_tokenizer trained it
    hub_config = {
        "added_tokens_decoder": {
            str(i): {"content": tok.convert_ids_to_tokens(i), "special": True} for i in (0, 1, 2)
        }
    }
    assert v.types == converter_spm_types(sp_model, hub_config, len(tok))


# ---- item 3: the BOS id of a tokenizer without a bos_token ---------------------------------------------------


def test_qwen2_bos_comes_from_config_like_the_converter(families, tmp_path):  # noqa: F811
    """gguf-py's SpecialVocab: a tokenizer without bos_token -> config.json's bos_token_id; add_bos stays false.
    Without an id, llama.cpp falls back to token 11 (',') as its chat BOS."""
    out = tmp_path / "q.gguf"
    export_gguf(families["qwen2"], out, "f16", "none", modelfile=False)
    endoftext = json.loads((families["qwen2"] / "config.json").read_text())["bos_token_id"]
    tokens = _field(out, "tokenizer.ggml.tokens")
    assert tokens[endoftext] == "<|endoftext|>"
    assert _field(out, "tokenizer.ggml.bos_token_id") == endoftext
    assert _field(out, "tokenizer.ggml.add_bos_token") is False
    assert _field(out, "tokenizer.ggml.eos_token_id") == tokens.index("<|im_end|>")  # the tokenizer's, first


def test_special_ids_tokenizer_first_then_config(tmp_path):
    tok = byte_bpe_tokenizer(QWEN2_SPLIT, QWEN_SPECIALS, None, "<|im_end|>", CHATML_TEMPLATE)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    folder = _folder(tmp_path, tok, bos_token_id=im_start, eos_token_id=0, pad_token_id=10**6)
    v = read_vocab(folder, len(tok), tok)
    assert v.special["bos"] == im_start  # only config.json names one
    assert v.special["eos"] == tok.convert_tokens_to_ids("<|im_end|>")  # the tokenizer's wins
    assert "pad" not in v.special  # out of range: skipped, as SpecialVocab does


# ---- item 4: the pre-tokenizer name from llama.cpp's hash table ----------------------------------------------


def test_check_text_and_table_are_llama_cpps():
    import hashlib

    # the converter's check text, byte for byte (a changed text would make every digest miss)
    assert hashlib.sha256(CHECK_TEXT.encode()).hexdigest()[:16] == "a36179c1e2b1cfcf"
    assert {"llama-bpe", "qwen2", "smollm", "gpt-2"} <= set(KNOWN.values())


def test_known_tokenizer_is_named_by_hash_not_regex(tmp_path, monkeypatch):
    """A SmolLM2-like tokenizer: its split regex reads as GPT-2's, but llama.cpp's converter knows it by hash
    and writes `smollm`. Our tiny tokenizer is not in llama.cpp's table, so its digest is registered here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from core.gguf import pretok

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["hello world 123 4567", "digits 1 2 3 and spaces"] * 10, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    folder = _folder(tmp_path, tok)
    assert read_vocab(folder, len(tok), tok).pre == "gpt-2"  # unknown digest: the regex rule
    monkeypatch.setitem(pretok.KNOWN, check_hash(tok), "smollm")
    v = read_vocab(folder, len(tok), tok)
    assert v.pre == "smollm" and "smollm" in v.style


VOCAB_DIR = os.environ.get("LLAMA_CPP_VOCAB_DIR")  # llama.cpp's models/ folder (ggml-vocab-*.gguf), optional


@pytest.mark.skipif(not VOCAB_DIR, reason="set LLAMA_CPP_VOCAB_DIR to llama.cpp's models/ folder to run")
@pytest.mark.parametrize("name", ["qwen2", "gpt-2", "starcoder"])
def test_digest_of_real_vocabularies_matches_llama_cpp(name):
    """Real tokenizers, rebuilt by transformers from llama.cpp's own vocabulary files: our digest finds the
    name llama.cpp's converter wrote for them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(VOCAB_DIR, gguf_file=f"ggml-vocab-{name}.gguf")
    assert KNOWN.get(check_hash(tok)) == name
