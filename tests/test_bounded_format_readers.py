"""One bounded reader per format (core.files): the JSON files the GGUF export, the merge and the planner read
from a model or an adapter folder -- tokenizer.json, a progress file, base_fingerprint.json, config.json -- go
through it, so a FIFO in their place never hangs, a huge one is never read, and a damaged one is one sentence
that names the file and says how to fix it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.files import MAX_TOKENIZER_JSON_BYTES

REPO = Path(__file__).resolve().parent.parent


def _model(tmp_path: Path, tiny_llama: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    return model


def _spoil(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "truncated":
        path.write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a"')
    else:  # huge: a sparse file past the bound, never read
        with open(path, "wb") as f:
            f.truncate(MAX_TOKENIZER_JSON_BYTES + 1)


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    "kind, says",
    [
        ("fifo", "is not a regular file"),
        ("truncated", "is not valid JSON"),
        ("huge", f"at most {MAX_TOKENIZER_JSON_BYTES:,} expected"),
    ],
)
def test_a_gguf_export_refuses_a_bad_tokenizer_json_in_one_sentence_without_hanging(
    tmp_path, tiny_llama, kind, says
):
    """A FIFO named tokenizer.json once hung the export (and its size estimate) for ever; a damaged one was read
    whole or blamed on the loader."""
    model = _model(tmp_path, tiny_llama)
    _spoil(model / "tokenizer.json", kind)
    out = tmp_path / "x.gguf"
    try:
        proc = _run("-m", "core.gguf", "--model", str(model), "--out", str(out))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the GGUF export hangs on a {kind} tokenizer.json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    line = proc.stderr.strip()
    assert str(model / "tokenizer.json") in line and says in line, line
    assert "copy the tokenizer files again" in line and len(line.splitlines()) == 1, line
    assert not out.exists()


def test_the_gguf_size_estimate_refuses_a_fifo_tokenizer_json_without_hanging(tmp_path, tiny_llama):
    model = _model(tmp_path, tiny_llama)
    _spoil(model / "tokenizer.json", "fifo")
    code = (
        "import sys; from core.gguf import BadInput, estimate_size\n"
        "try:\n    estimate_size(sys.argv[1])\nexcept BadInput as e:\n    print(e)\n"
    )
    try:
        proc = _run("-c", code, str(model), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("estimate_size hangs on a FIFO named tokenizer.json")
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "tokenizer.json is not a regular file" in proc.stdout, proc.stdout


def test_a_fifo_in_place_of_the_progress_file_reads_as_no_progress(tmp_path):
    out = tmp_path / "x.gguf"
    os.mkfifo(tmp_path / "x.gguf.progress.json")
    code = f"from core.gguf import read_progress; print(read_progress({str(out)!r}))"
    try:
        proc = _run("-c", code, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("read_progress hangs on a FIFO")
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr[-1500:]


@pytest.mark.parametrize("kind, says", [("fifo", "is not a regular file"), ("huge", "at most")])
def test_a_base_fingerprint_json_that_is_no_file_is_a_merge_error_naming_it(tmp_path, kind, says):
    """A FIFO named base_fingerprint.json once read as "no record" (the merge then said nothing of it); a huge one
    was read whole."""
    from core.merge.errors import MergeError
    from core.merge.fingerprint import FINGERPRINT_FILE, read_recorded_base

    path = tmp_path / FINGERPRINT_FILE
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(64 << 20)
    with pytest.raises(MergeError) as e:
        read_recorded_base(tmp_path)
    assert f"{path} cannot be read" in str(e.value) and says in str(e.value), str(e.value)
