"""Does the adapter belong to this base? The fingerprint of the base weights recorded beside it (when the
trainer recorded one), its recorded base (`base_model_name_or_path`), and its vocabulary.

An adapter merged into the wrong base often fits tensor for tensor (same hidden size, more layers, another
vocabulary; or another fine-tune of the same model, with the very same config.json) and the verification passes,
because it compares against base+adapter on that same wrong base. These checks catch it before anything is
written. Each returns what differs, as a sentence without the remedy: the
caller refuses with it (adding how to fix it) or, when forced (--force), merges and keeps it as a note.
"""

from __future__ import annotations

from pathlib import Path

from core.files import read_json_object
from core.merge.adapter import Adapter
from core.merge.errors import MergeError
from core.merge.fingerprint import FINGERPRINT_FILE, fingerprint_of, locate_base, read_recorded_base
from core.merge.model_files import load_tokenizer
from core.merge.shards import BaseCheckpoint

# Fields that tell two models apart, each with the names other architectures use for it (GPT-2: n_embd, n_layer).
SIGNATURE = (
    ("model_type",),
    ("hidden_size", "n_embd", "d_model"),
    ("num_hidden_layers", "n_layer", "num_layers"),
    ("vocab_size",),
)


def signature(config: dict) -> dict:
    """{field: value} of the identifying fields present in a config.json (a multimodal model's text_config too)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    out = {}
    for names in SIGNATURE:
        for source in (config, text):
            value = next((source[n] for n in names if n in source), None)
            if value is not None:
                out[names[0]] = value
                break
    return out


def recorded_base_config(recorded: str, adapter_dir: Path) -> Path | None:
    """config.json of the base the adapter names: a local folder (relative ones as training saw them: from the
    current folder or the repo, where the cockpit trains), else a Hugging Face hub id already in the local cache."""
    folder = locate_base(recorded)
    return folder / "config.json" if folder is not None else None


def check_recorded_base(
    adapter: Adapter, base: BaseCheckpoint, base_config: dict
) -> tuple[str | None, list[str]]:
    """(mismatch, notes): a mismatch when the base the adapter was trained on is known here and differs from
    `base` (its weights, by the fingerprint recorded beside the adapter; else its config.json); notes when
    something could not be compared."""
    same, said = check_base_weights(adapter.dir, base)
    if same:
        return None, []  # the very weights it was trained on: nothing else to compare
    mismatch, note = check_recorded_config(adapter, base.dir, base_config)
    if same is False:
        return mismatch or said, []  # config.json's differences name fields: the more telling sentence
    return mismatch, [n for n in (said, note) if n]


def check_base_weights(adapter_dir: Path, base: BaseCheckpoint) -> tuple[bool | None, str | None]:
    """(same, sentence): whether `base` holds the weights the adapter was trained on, by the fingerprint the
    trainer recorded beside it (core.merge.fingerprint). same is None when that cannot be told, and the sentence
    a note saying why; False with the mismatch sentence; True with None."""
    try:
        recorded = read_recorded_base(adapter_dir)
    except MergeError as e:
        return None, f"{e}: the base's weights were not compared with the ones the adapter was trained on."
    if recorded is None:
        return None, (
            f"The adapter records no fingerprint of the base weights it was trained on (no {FINGERPRINT_FILE} in "
            f"{adapter_dir}: trained elsewhere or by an older version), so only config.json was compared: make "
            f"sure {base.dir} is the model it was trained on."
        )
    try:
        ours = fingerprint_of(base)
    except (MergeError, OSError) as e:
        return None, f"The weights of {base.dir} could not be fingerprinted ({e}): not compared."
    differs = recorded.fingerprint.differs_from(ours)
    if differs is None:
        return True, None
    return False, (
        f"The adapter was trained on {recorded.base} ({FINGERPRINT_FILE} in the adapter folder), but the base "
        f"given, {base.dir}, holds other weights ({differs})"
    )


def check_recorded_config(
    adapter: Adapter, base_dir: Path, base_config: dict
) -> tuple[str | None, str | None]:
    """(mismatch, note): a mismatch when the base named in adapter_config.json (base_model_name_or_path) is
    found here and its config.json differs from `base_config`; a note when it cannot be compared."""
    recorded = adapter.config.get("base_model_name_or_path")
    if not isinstance(recorded, str) or not recorded.strip():
        return None, (
            f"The adapter does not record its base model (no base_model_name_or_path in {adapter.dir}): make sure "
            f"{base_dir} is the model it was trained on."
        )
    cfg_path = recorded_base_config(recorded, adapter.dir)
    if cfg_path is None:
        return None, (
            f"The adapter was trained on {recorded!r}, which is neither a local folder nor in the Hugging Face cache "
            f"here, so {base_dir} could not be compared with it: make sure it is that model."
        )
    if cfg_path.parent.resolve() == base_dir.resolve():
        return None, None
    theirs = read_json_object(cfg_path)  # bounded, never a FIFO
    if theirs is None:
        return (
            None,
            f"The config.json of the adapter's recorded base {recorded!r} does not load: not compared.",
        )
    ours, theirs = signature(base_config), signature(theirs)
    diffs = [f"{k} {theirs[k]} vs {ours[k]}" for k in theirs if k in ours and theirs[k] != ours[k]]
    if not diffs:
        return None, None  # the same model moved or copied elsewhere
    return (
        f"The adapter was trained on {recorded} (base_model_name_or_path in adapter_config.json), but the base "
        f"given, {base_dir}, is a different model ({', '.join(diffs)})"
    ), None


def check_vocabulary(adapter_dir: Path, base_dir: Path, embedding_rows: int | None) -> str | None:
    """A mismatch when the tokenizer saved with the adapter (the one it was trained with, and the one the export
    ships) does not fit the base: more tokens than the merged model has embedding rows, or the base's tokens
    under other ids. Only adapters that carry a tokenizer are checked; one that does not load is left to the
    verification, which reports it."""
    if not (adapter_dir / "tokenizer_config.json").is_file():
        return None
    try:
        tok = load_tokenizer(adapter_dir)
    except Exception:
        return None
    n = len(tok)
    if embedding_rows and n > embedding_rows:
        return (
            f"The adapter's tokenizer in {adapter_dir} has {n} tokens but the merged model would have only "
            f"{embedding_rows} embedding rows (trained on another base, or tokens were added without saving the "
            "resized embeddings with modules_to_save embed_tokens and lm_head)"
        )
    if not (base_dir / "tokenizer_config.json").is_file():
        return None
    try:
        base_vocab = load_tokenizer(base_dir).get_vocab()
    except Exception:
        return None
    vocab = tok.get_vocab()
    moved = [(t, i) for t, i in base_vocab.items() if vocab.get(t) != i]
    if not moved:
        return None
    token, base_id = min(moved, key=lambda ti: ti[1])
    where = f"id {vocab[token]} in the adapter's" if token in vocab else "missing from the adapter's"
    return (
        f"The adapter's tokenizer in {adapter_dir} numbers tokens differently from the base's in {base_dir} "
        f"({len(moved)} of {len(base_vocab)} differ; {token!r} is id {base_id} in the base's, {where}), so it "
        "was trained on another vocabulary"
    )
