"""Data loading and formatting with the real char tokenizer and real `datasets` files of every kind."""

import json
from pathlib import Path

import pytest

from core.demo.toy import build_tokenizer
from core.recipe.data import (
    IGNORE_INDEX,
    Collator,
    DataError,
    detect_format,
    load_rows,
    preview_dataset,
    tokenize_row,
)

ALPACA = [
    {"instruction": "Reverse the word", "input": "abc", "output": "cba"},
    {"instruction": "Say hi", "input": "", "output": "hi"},
    {"instruction": "Count to three", "input": "", "output": "1 2 3"},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained_text(enc, tok):
    return tok.decode(
        [t for t, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab != IGNORE_INDEX]
    )


def test_alpaca_masks_the_prompt(tok):
    enc = tokenize_row(ALPACA[0], "alpaca", tok, 512)
    assert trained_text(enc, tok) == "cba</s>"
    masked = tok.decode(
        [t for t, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab == IGNORE_INDEX]
    )
    assert "Reverse the word" in masked and "abc" in masked and "cba" not in masked
    assert enc["input_ids"][0] == tok.bos_token_id
    # Without masking every token is a label.
    unmasked = tokenize_row(ALPACA[0], "alpaca", tok, 512, mask_prompt=False)
    assert unmasked["labels"][1:] == unmasked["input_ids"][1:]


def test_chat_trains_only_assistant_turns(tok):
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "See you"},
        ]
    }
    enc = tokenize_row(row, "chat", tok, 512)
    assert trained_text(enc, tok) == "Hi there</s>See you</s>"
    full = tok.apply_chat_template(row["messages"], tokenize=False)
    assert tok.decode(enc["input_ids"]) == full  # the whole conversation is there, in order


def test_text_trains_everything_and_truncation_keeps_true_length(tok):
    enc = tokenize_row({"text": "x" * 40}, "text", tok, 16)
    assert len(enc["input_ids"]) == 16 and enc["length"] == 42  # BOS + 40 chars + EOS
    assert all(lab != IGNORE_INDEX for lab in enc["labels"][1:])


def test_every_file_kind_loads_the_same_rows(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ALPACA)
    paths = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", ALPACA),
        "json": tmp_path / "d.json",
        "csv": tmp_path / "d.csv",
        "parquet": tmp_path / "d.parquet",
        "disk": tmp_path / "disk",
    }
    paths["json"].write_text(json.dumps(ALPACA))
    ds.to_csv(str(paths["csv"]))
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["disk"]))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    for kind, path in paths.items():
        rows = load_rows({"path": str(path)})
        assert [r["output"] for r in rows] == ["cba", "hi", "1 2 3"], kind
    assert len(load_rows({"path": str(tmp_path / "dict"), "split": "test"})) == 1
    with pytest.raises(DataError, match="data.split 'validation' is not in"):
        load_rows({"path": str(tmp_path / "dict"), "split": "validation"})


def test_column_mapping_and_format_detection(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "answer": "4"}])
    with pytest.raises(DataError, match="Cannot tell the data format"):
        detect_format(load_rows({"path": str(path)}).column_names)
    rows = load_rows({"path": str(path), "columns": {"instruction": "question", "output": "answer"}})
    assert detect_format(rows.column_names) == "alpaca"
    assert rows[0]["output"] == "4"


def test_bad_paths_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows({"path": str(tmp_path / "nope.jsonl")})
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(DataError, match="use .json, .jsonl, .csv or .parquet"):
        load_rows({"path": str(tmp_path / "d.txt")})
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="not a datasets save_to_disk folder"):
        load_rows({"path": str(tmp_path / "folder")})


@pytest.mark.parametrize("kind", ["fifo", "device", "empty", "blank"])
def test_a_data_path_that_is_no_file_of_rows_is_one_sentence_not_a_hang(tmp_path, kind):
    """A FIFO would block the reader for ever, /dev/zero would feed it without end, an empty file gave
    "StopIteration": each is one sentence, at once (in a child process, so that a hang fails the test)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "train.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("" if kind == "empty" else "\n\n  \n")  # blank lines: datasets said "no data!"
    code = (
        "import sys\nfrom core.recipe.data import DataError, load_rows\n"
        f"try:\n    load_rows({{'path': {str(path)!r}}})\nexcept DataError as e:\n    print(e)\n    sys.exit(2)"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    expected = "is empty" if kind in ("empty", "blank") else "is not a regular file"
    assert done.stdout.startswith(f"data.path: {path} {expected}"), done.stdout


def test_a_broken_csv_names_the_parsers_reason(tmp_path):
    """datasets wraps the CSV parser's error in "An error occurred while generating the dataset": the reason
    under it is what the user can act on."""
    path = tmp_path / "train.csv"
    path.write_text('instruction,output\n"an unterminated quote,x\ny,z\n')
    with pytest.raises(DataError, match="EOF inside string"):
        load_rows({"path": str(path)})


def test_preview_shows_formatted_rows_and_lengths(tmp_path, tok):
    rows = ALPACA + [{"instruction": "Long " * 20, "input": "", "output": "ok"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    pv = preview_dataset({"path": str(path)}, tok, n=2, max_length=80)
    assert pv["format"] == "alpaca" and pv["total_rows"] == 4
    assert [r["row"] for r in pv["rows"]] == [1, 2]
    assert pv["rows"][0]["completion"] == "cba</s>" and "Reverse the word" in pv["rows"][0]["prompt"]
    assert pv["rows"][0]["n_trained"] == 4  # c, b, a, </s>
    assert len(pv["lengths"]) == 4 and pv["truncated"] == 1  # only the long row passes 80 tokens
    assert pv["lengths"][3] > 80 >= max(pv["lengths"][:3])


def test_collator_pads_and_counts_tokens():
    col = Collator(pad_token_id=0)
    batch = col([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (col.tokens_seen, col.samples_seen) == (4, 2)
    col([{"input_ids": [1, 2], "labels": [1, 2], "is_eval": 1}])  # eval batches are not training throughput
    assert col.tokens_seen == 4


def test_a_data_file_that_is_not_utf8_names_its_file_and_line(tmp_path):
    """Issue #21 item 13: a Latin-1 file loaded 'fine' and failed later with a bare UnicodeDecodeError."""
    from core.recipe.data import DataError, check_utf8, load_rows

    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    csv = tmp_path / "pairs.csv"
    csv.write_bytes(b"prompt,chosen,rejected\nhi,yo,no\nhi,caf\xe9,no\n")
    for path, line in ((jsonl, 2), (csv, 3)):
        with pytest.raises(DataError, match=rf"line {line} of {path} is not UTF-8 text \(byte 0xe9\)"):
            load_rows({"path": str(path)})
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "café ☕ naïve"}\n' * 50, encoding="utf-8")
    check_utf8(good, block=7)  # multi-byte characters across every block boundary: still UTF-8
    assert len(load_rows({"path": str(good)})) == 50
