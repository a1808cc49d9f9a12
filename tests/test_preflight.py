"""Preflight catches each bad case with row numbers (counted from 1) and a fix, using real tokenizers/configs."""

import json

import pytest
import yaml

from core.demo.toy import build_tokenizer, tiny_config
from core.recipe.config import validate_config
from core.train.preflight import has_errors, main, run_preflight


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_for(data_path, **data):
    return validate_config({"model": {"path": "unused"}, "data": {"path": data_path, **data}})


def by_check(findings, check):
    found = [f for f in findings if f.check == check]
    assert found, f"no {check} finding in {[str(f) for f in findings]}"
    return found[0]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_clean_data_has_no_findings(tmp_path, tok):
    path = jsonl(tmp_path / "ok.jsonl", [{"instruction": "Say hi", "output": "hi"}] * 3)
    assert run_preflight(cfg_for(path, max_length=128), tok, tiny_config()) == []


def test_missing_columns(tmp_path, tok):
    path = jsonl(tmp_path / "d.jsonl", [{"instruction": "Say hi", "answer": "hi"}])
    f = by_check(run_preflight(cfg_for(path, format="alpaca"), tok, tiny_config()), "columns")
    assert f.level == "error" and "output" in f.message and "data.columns" in f.fix


def test_empty_and_whitespace_rows_are_numbered(tmp_path, tok):
    rows = [
        {"instruction": "a", "output": "b"},
        {"instruction": "   ", "output": "b"},
        {"instruction": "a", "output": "b"},
        {"instruction": "a", "output": "\n\t"},
    ]
    f = by_check(run_preflight(cfg_for(jsonl(tmp_path / "d.jsonl", rows)), tok, tiny_config()), "empty_rows")
    assert f.level == "error" and f.rows == [2, 4] and "rows 2, 4" in f.message


def test_chat_rows_without_assistant_or_content(tmp_path, tok):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    no_reply = {"messages": [{"role": "user", "content": "hi"}]}
    blank = {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "yo"}]}
    path = jsonl(tmp_path / "c.jsonl", [good, no_reply, good, blank])
    f = by_check(run_preflight(cfg_for(path), tok, tiny_config()), "empty_rows")
    assert f.rows == [2, 4]


def test_chat_format_without_chat_template(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    findings = run_preflight(cfg_for(path), build_tokenizer(chat_template=False), tiny_config())
    f = by_check(findings, "chat_template")
    assert f.level == "error" and "no chat template" in f.message and has_errors(findings)


def test_token_ids_beyond_the_model_vocab(tmp_path, tok):
    # vocab_size 50 covers the specials, digits, lower case and 'A'..'G'; 'H' and '#' lie beyond it.
    rows = [{"text": "abcdef"}, {"text": "HELLO"}, {"text": "ok"}, {"text": "x#y"}]
    f = by_check(
        run_preflight(cfg_for(jsonl(tmp_path / "t.jsonl", rows)), tok, tiny_config(vocab_size=50)), "vocab"
    )
    assert f.level == "error" and f.rows == [2, 4] and "vocab_size 50" in f.message


def test_position_limit_and_truncation(tmp_path, tok):
    rows = [{"text": "a" * 10}, {"text": "b" * 40}, {"text": "c" * 20}, {"text": "d" * 100}]
    path = jsonl(tmp_path / "t.jsonl", rows)
    model_config = tiny_config(max_position_embeddings=32)
    findings = run_preflight(cfg_for(path, max_length=64), tok, model_config)
    limit = [f for f in findings if f.check == "position_limit"]
    assert any(f.level == "error" and "Set training.max_length to 32" in f.fix for f in limit)
    too_long = next(f for f in limit if f.level == "warning")
    assert too_long.rows == [2, 4]  # 42 and 102 tokens with BOS/EOS, over 32
    trunc = by_check(findings, "truncation")
    assert trunc.rows == [4] and "1 of 4 rows (25.0%)" in trunc.message


def test_cli_exits_non_zero_with_the_findings(tmp_path, tiny_llama, capsys):
    path = jsonl(
        tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "", "output": "b"}]
    )
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({"model": {"path": str(tiny_llama)}, "data": {"path": path}}))
    assert main([str(run_yaml)]) == 2  # a data error is bad input: exit 2
    assert "rows 2" in capsys.readouterr().err
    run_yaml.write_text(
        yaml.safe_dump({"model": {"path": str(tiny_llama)}, "data": {"path": path, "max_len": 9}})
    )
    assert main([str(run_yaml)]) == 2
    assert "data.max_len: unknown key" in capsys.readouterr().err


def test_a_broken_jsonl_line_is_one_sentence_once(tmp_path, tiny_llama):
    """Issue #21 item 20: datasets printed its own "row 41" error and progress bars before our "line 42", and
    --dry-run printed the error twice."""
    import subprocess
    import sys

    from tests.cli import REPO

    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": broken\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {tiny_llama}}}\ndata: {{path: {data}}}\n")
    for args in (["-m", "core.preflight", str(cfg)], ["-m", "core.train", str(cfg), "--dry-run"]):
        out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, (args, out.stderr[-2000:])
        text = out.stdout + out.stderr
        assert text.count("line 2 of") == 1, text
        assert "row 1" not in text and "Generating train split" not in text and "Traceback" not in text, text
