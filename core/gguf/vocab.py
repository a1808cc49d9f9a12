"""Tokenizer -> GGUF metadata (`tokenizer.ggml.*`), in the spellings llama.cpp reads.

Three tokenizer styles are recognised from the source's `tokenizer.json` (transformers builds one from a
`tokenizer.model` when only that is present):

* SentencePiece-style BPE (Llama 1/2, Mistral): `tokenizer.ggml.model = "llama"`, tokens spelled with `▁`,
  `<0xXX>` byte tokens, scores that order the merges (llama.cpp merges the best-scored pair first).
* Byte-level BPE (Llama 3, Qwen2): `"gpt2"`, tokens in the byte alphabet, merges, and a pre-tokenizer name:
  the one llama.cpp's own converter writes when it knows the tokenizer (core/gguf/pretok.py: the hash of a fixed
  text's token ids), otherwise recognised from the source's split regex.
* Character-level vocabularies like the demo's WordLevel tokenizer: written as `"llama"` with no merges and no
  space prefix. llama.cpp's "gpt2" loader insists on at least one merge, and transformers refuses a merge whose
  result is not in the vocabulary, so a one-character vocabulary can only be expressed this way. llama.cpp's
  SentencePiece path spells a character missing from the vocabulary as byte tokens `<0x00>`..`<0xFF>` and
  aborts the process when it finds none (`std::out_of_range`), so those 256 tokens are appended after the
  model's rows; their embedding (and output) rows are copies of the source's <unk> rows, so the model sees
  exactly what it sees for <unk> in the source (one byte token per UTF-8 byte instead of one <unk> per
  character).

Token types follow llama.cpp's converter: an added token that is special (or looks special: `<|...|>`, ...) is
CONTROL, another added token USER_DEFINED (`get_vocab_base` for BPE, which never writes UNKNOWN); in a
SentencePiece vocabulary read from tokenizer.json every special id is CONTROL, the unk token too, and
`<0xXX>` tokens are BYTE (`LlamaHfVocab`; its tokenizer.model path agrees wherever tokenizer_config.json lists
the special tokens in added_tokens_decoder, as hub Llama / Mistral folders do).
Special ids come from the tokenizer first and config.json second, as gguf-py's SpecialVocab reads them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from core.files import MAX_TOKENIZER_JSON_BYTES, BadFile, load_json_object, read_json_object
from core.gguf.source import BadInput

# Split regexes as they appear in real tokenizer.json files -> llama.cpp's pre-tokenizer names.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def looks_special(token: str) -> bool:
    """llama.cpp's converter (`does_token_look_special`): added tokens it marks CONTROL even when not special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _is_char_level(kind, vocab: dict, added: dict) -> bool:
    return kind == "WordLevel" and all(len(t) == 1 for t, i in vocab.items() if i not in added)


TOKENIZER_FIX = (
    "copy the tokenizer files again from the original model (or save them with tokenizer.save_pretrained)"
)
# what transformers reads besides tokenizer.json: a FIFO or a device in their place would hang it
TOKENIZER_SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def read_tokenizer_json(path: Path) -> dict | None:
    """The model folder's tokenizer.json, None when it has none. Read through core.files' bounded reader (tens of
    MB are normal: MAX_TOKENIZER_JSON_BYTES): a FIFO or a device in its place, a file past the bound, or one that
    is not a JSON object is BadInput, one sentence naming the file."""
    file = path / "tokenizer.json"
    if not os.path.lexists(file):
        return None
    try:
        return load_json_object(file, MAX_TOKENIZER_JSON_BYTES)
    except BadFile as e:
        raise BadInput(f"{file} {e.why}: {TOKENIZER_FIX}.") from None


def byte_rows(path: Path) -> int:
    """Rows the export appends to the embedding for byte tokens (character-level vocabularies), from
    tokenizer.json alone: 256 or 0. BadInput when tokenizer.json is there but cannot be read (read_tokenizer_json)."""
    tj = read_tokenizer_json(path)
    if tj is None:
        return 0
    model = tj.get("model") or {}
    vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
    added = {a["id"] for a in tj.get("added_tokens") or []}
    return len(BYTE_TOKENS) if vocab and _is_char_level(model.get("type"), vocab, added) else 0


@dataclass
class VocabInfo:
    model: str  # tokenizer.ggml.model: "llama" or "gpt2"
    style: str  # for people: what was recognised
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    add_space_prefix: bool | None = None
    special: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad -> id
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    notes: list[str] = field(default_factory=list)
    # Byte tokens appended after the model's rows (character-level vocabularies): their count, and the source
    # row (<unk>) whose embedding / output weights they copy.
    extra_rows: int = 0
    extra_row_source: int | None = None

    def summary(self) -> dict:
        return {
            "ggml_model": self.model,
            "style": self.style,
            "pre_tokenizer": self.pre,
            "tokens": len(self.tokens),
            "merges": len(self.merges or []),
            "special_ids": self.special,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "chat_template": bool(self.chat_template),
            "byte_tokens_added": self.extra_rows,
            "notes": self.notes,
        }


def load_source_tokenizer(path: Path):
    from transformers import AutoTokenizer

    read_tokenizer_json(path)  # before transformers reads it: never a FIFO, a huge or a damaged file
    for name in TOKENIZER_SIDE_FILES:
        file = path / name
        if os.path.lexists(file) and not file.is_file():
            raise BadInput(f"{file} is not a regular file: {TOKENIZER_FIX}.")
    names = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        raise BadInput(
            f"{path} has no tokenizer files (tokenizer.json or tokenizer.model); a GGUF needs one."
        )
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # any loader failure is a property of the input folder
        raise BadInput(f"The tokenizer in {path} cannot be loaded ({type(e).__name__}: {e}).") from None


def _has(node, type_name: str) -> bool:
    return type_name in json.dumps(node or {})


def _split_regex(pre) -> str | None:
    if not pre:
        return None
    if pre.get("type") == "Split":
        return (pre.get("pattern") or {}).get("Regex")
    for p in pre.get("pretokenizers") or []:
        found = _split_regex(p)
        if found:
            return found
    return None


def _byte_level_pre(pre) -> tuple[str, str | None]:
    regex = _split_regex(pre)
    if regex is not None:
        if regex in KNOWN_SPLITS:
            return KNOWN_SPLITS[regex], None
        return (
            "default",
            "The pre-tokenizer regex is not one llama.cpp knows; it will split text its default way.",
        )
    if _has(pre, '"use_regex": true'):
        return "gpt-2", None
    return "default", None


def read_vocab(path: Path, vocab_size: int, tokenizer=None) -> VocabInfo:
    tok = tokenizer or load_source_tokenizer(path)
    tj = json.loads(tok.backend_tokenizer.to_str())
    model = tj["model"]
    kind = model.get("type")
    vocab: dict[str, int] = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {}
    added = {a["id"]: a for a in tj.get("added_tokens") or []}
    for i, a in added.items():
        vocab[a["content"]] = i
    n = max(vocab.values()) + 1
    if n > vocab_size:
        raise BadInput(f"The tokenizer has {n} tokens but the model's embedding has only {vocab_size} rows.")
    by_id = {i: t for t, i in vocab.items()}
    raw_merges = model.get("merges") or []
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw_merges]

    pre, normalizer, decoder = tj.get("pre_tokenizer"), tj.get("normalizer"), tj.get("decoder")
    notes: list[str] = []
    if kind == "BPE" and (model.get("byte_fallback") or _has(pre, "Metaspace") or _has(normalizer, "\u2581")):
        ggml_model, style = "llama", "SentencePiece BPE"
        prepend = '"prepend_scheme": "never"' not in json.dumps(pre or {})
        add_space_prefix = prepend and (_has(pre, "Metaspace") or _has(normalizer, "Prepend"))
        respell = {}
    elif kind == "BPE" and (_has(pre, "ByteLevel") or _has(decoder, "ByteLevel")):
        ggml_model, style = "gpt2", "byte-level BPE"
        add_space_prefix = None
        respell = {}
    elif _is_char_level(kind, vocab, added):
        ggml_model, style = "llama", "character-level"
        add_space_prefix = False
        respell = {" ": "\u2581"}  # llama.cpp's sentencepiece path always escapes spaces as ▁
        if tok.unk_token_id is None:
            raise BadInput(
                "This character-level tokenizer has no unk token; llama.cpp needs byte tokens for characters "
                "outside the vocabulary, and the export gives them the <unk> embedding."
            )
        notes.append(
            "Characters outside the vocabulary are <unk> in the source; llama.cpp spells them as byte tokens "
            "(<0x00>..<0xFF>, one per UTF-8 byte), which the GGUF adds with <unk>'s weights."
        )
    else:
        raise BadInput(
            f"Tokenizer model {kind} ({type(tok).__name__}) cannot be written to GGUF by this exporter."
        )

    unk_id = tok.unk_token_id
    special_ids = set(tok.all_special_ids)
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if i in added:
            # llama.cpp's converter: every added token that is special or looks special is CONTROL (also the
            # unk token: an added special token's type overrides SentencePiece's UNKNOWN); other added tokens
            # are USER_DEFINED, and SentencePiece ones are written with real spaces.
            if added[i]["special"] or looks_special(t):
                types.append(gguf.TokenType.CONTROL)
            else:
                types.append(gguf.TokenType.USER_DEFINED)
                if ggml_model == "llama":
                    respell = {**respell, t: t.replace("\u2581", " ")}
        elif ggml_model == "llama" and i in special_ids:
            types.append(gguf.TokenType.CONTROL)  # LlamaHfVocab: every special id, the unk token too
        elif ggml_model == "llama" and BYTE_TOKEN.fullmatch(t):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(respell.get(t, t))
    if style == "character-level":
        tokens += BYTE_TOKENS
        types += [gguf.TokenType.BYTE] * len(BYTE_TOKENS)
    if len(set(tokens)) != len(tokens):
        raise BadInput("The tokenizer spells two ids the same way, which a GGUF vocabulary cannot hold.")

    info = VocabInfo(model=ggml_model, style=style, tokens=tokens, types=[int(t) for t in types], notes=notes)
    info.add_space_prefix = add_space_prefix
    if style == "character-level":
        info.extra_rows, info.extra_row_source = len(BYTE_TOKENS), int(unk_id)
    if ggml_model == "llama":
        # The merge order is the tokenizer's: rank r gets score -r, so the best merge scores highest, which is
        # how llama.cpp and transformers' GGUF loader both read sentencepiece scores.
        rank: dict[str, float] = {}
        for r, m in enumerate(merges):
            rank.setdefault(m.replace(" ", "", 1), -float(r))
        info.scores = [
            (rank.get(t, -float(len(merges) + i)) if ty == gguf.TokenType.NORMAL else 0.0)
            for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        ]
    else:
        if not merges:
            raise BadInput(
                "This byte-level BPE tokenizer has no merges; llama.cpp cannot load such a vocabulary."
            )
        info.merges = merges
        from core.gguf.pretok import known_pre

        info.pre = known_pre(tok)
        if info.pre is None:  # a tokenizer llama.cpp's converter does not know: recognise its split regex
            info.pre, note = _byte_level_pre(pre)
            if note:
                notes.append(note)
        info.style += f" ({info.pre} pre-tokenizer)"

    config = _read_config(path)
    for name in ("bos", "eos", "unk", "pad"):
        # gguf-py's SpecialVocab: the tokenizer's token first, else config.json's `<name>_token_id` (Qwen2 has no
        # bos_token but its config names <|endoftext|>, which llama.cpp's converter writes as the BOS id).
        i = getattr(tok, f"{name}_token_id", None)
        if i is None:
            i = config.get(f"{name}_token_id")
            if i is None and isinstance(config.get("text_config"), dict):
                i = config["text_config"].get(f"{name}_token_id")
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens):
            info.special[name] = int(i)
    probe_plain = tok("a", add_special_tokens=False)["input_ids"]
    probe = tok("a")["input_ids"]
    bos, eos = info.special.get("bos"), info.special.get("eos")
    info.add_bos = bos is not None and len(probe) > len(probe_plain) and probe[0] == bos
    info.add_eos = eos is not None and len(probe) > len(probe_plain) and probe[-1] == eos
    template = getattr(tok, "chat_template", None)
    info.chat_template = template if isinstance(template, str) else None
    return info


def _read_config(path: Path) -> dict:
    return read_json_object(Path(path) / "config.json") or {}  # bounded, never a FIFO; open_source said why


def write_vocab(w: gguf.GGUFWriter, info: VocabInfo) -> None:
    w.add_tokenizer_model(info.model)
    if info.pre:
        w.add_tokenizer_pre(info.pre)
    w.add_token_list(info.tokens)
    w.add_token_types(info.types)
    if info.scores is not None:
        w.add_token_scores(info.scores)
    if info.merges:
        w.add_token_merges(info.merges)
    if info.add_space_prefix is not None:
        w.add_add_space_prefix(info.add_space_prefix)
    setters = {
        "bos": w.add_bos_token_id,
        "eos": w.add_eos_token_id,
        "unk": w.add_unk_token_id,
        "pad": w.add_pad_token_id,
    }
    for name, i in info.special.items():
        setters[name](i)
    w.add_add_bos_token(info.add_bos)
    w.add_add_eos_token(info.add_eos)
    if info.chat_template:
        w.add_chat_template(info.chat_template)
