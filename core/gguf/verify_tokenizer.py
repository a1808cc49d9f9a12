"""The GGUF's tokenizer checked against the source's: transformers' GGUF tokenizer loader (made to honour
`add_space_prefix = false`, which it ignores) on fixed sample texts, with the special tokens and a chat-template
rendering. Where the export appended byte tokens to a character-level vocabulary, each <unk> of the source is
judged as llama.cpp spells it: one byte token per UTF-8 byte (expected_ids).
"""

from __future__ import annotations

from pathlib import Path

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
