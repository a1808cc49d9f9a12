"""core.files' one reader per format (safetensors header, JSON object) on hostile input: a FIFO with no writer, a
header length of terabytes, a file cut short, binary garbage, a header that lies about its data. Each is BadFile
(or NotRegularFile) with the words the callers put after the path, never a hang, a MemoryError or a trace."""

import json
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import save_file

from core.files import (
    BadFile,
    NotRegularFile,
    load_json_object,
    read_json_object,
    read_safetensors_header,
)


def st_file(path, header: dict, data: bytes = b"") -> str:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


@pytest.fixture()
def real(tmp_path):
    """A safetensors file written by the safetensors library itself."""
    path = tmp_path / "real.safetensors"
    save_file(
        {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
        path,
    )
    return path


def test_a_real_file_reads_back_as_the_library_wrote_it(real):
    from safetensors import safe_open

    h = read_safetensors_header(real)
    with safe_open(str(real), "pt") as f:
        assert set(h.tensors) == set(f.keys()) == {"w", "b"}
    assert h.tensors["w"]["shape"] == [3, 4] and h.tensors["b"]["dtype"] == "BF16"
    assert h.size == real.stat().st_size == h.data_end  # whole: the last tensor ends at the file's end
    raw = real.read_bytes()
    start, end = h.tensors["w"]["data_offsets"]
    assert torch.frombuffer(
        bytearray(raw[h.data_start + start : h.data_start + end]), dtype=torch.float32
    ).tolist() == list(range(12))


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    done = {}

    def read():
        for reader in (read_safetensors_header, load_json_object):
            try:
                reader(fifo)
            except (NotRegularFile, BadFile) as exc:
                done[reader.__name__] = str(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a reader blocked on a FIFO with no writer"
    assert "not a regular file" in done["read_safetensors_header"]
    assert done["load_json_object"] == "is not a regular file"
    assert read_json_object(fifo) is None


@pytest.mark.parametrize(
    "content, what, truncated, detail",
    [
        (b"", "is truncated", True, "0 bytes, shorter than its 8-byte header length"),
        (b"\x01\x02", "is truncated", True, "2 bytes, shorter than its 8-byte header length"),
        (
            (10**12).to_bytes(8, "little") + b"{}",
            "is not a valid safetensors file",
            False,
            "header length of 1,000,000,000,000",
        ),
        ((2**64 - 1).to_bytes(8, "little"), "is not a valid safetensors file", False, "header length"),
        (
            (500).to_bytes(8, "little") + b'{"w": {',
            "is truncated",
            True,
            "its header length says 500 bytes, 7 follow",
        ),
        (b"\xff" * 64, "is not a valid safetensors file", False, "header length"),
        (
            (16).to_bytes(8, "little") + b"\xff\xfe\x00garbage!" + b"\x00" * 32,
            "is not a valid safetensors file",
            False,
            "its header is not JSON",
        ),
        ((2).to_bytes(8, "little") + b"[]", "is not a valid safetensors file", False, "not a JSON object"),
    ],
)
def test_garbage_and_cut_headers_say_what_is_wrong(tmp_path, content, what, truncated, detail):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    with pytest.raises(BadFile) as err:
        read_safetensors_header(path)
    assert err.value.what == what and err.value.truncated is truncated
    assert detail in err.value.detail, err.value.detail


ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    "entry, data, says",
    [
        ({**ENTRY, "data_offsets": [0, 10**12], "shape": [250_000_000_000]}, b"\x00" * 16, "is truncated"),
        ({**ENTRY, "shape": [10**6, 10**6]}, b"\x00" * 16, "does not match its 16 data bytes"),
        ({**ENTRY, "data_offsets": [-4, 12]}, b"\x00" * 16, "does not describe tensors: entry 'w'"),
        ({**ENTRY, "data_offsets": [16, 0]}, b"\x00" * 16, "does not describe tensors"),
        ({**ENTRY, "shape": [True, 4]}, b"\x00" * 16, "does not describe tensors"),
        ({**ENTRY, "shape": [1] * 65}, b"\x00" * 16, "does not describe tensors"),
        ({"dtype": 3, "shape": [4], "data_offsets": [0, 16]}, b"\x00" * 16, "does not describe tensors"),
        ([1, 2, 3], b"", "does not describe tensors"),
        (ENTRY, b"\x00" * 10, "its tensors need 16 bytes of data, 10 follow"),
    ],
)
def test_a_header_that_lies_about_its_data_is_refused(tmp_path, entry, data, says):
    path = st_file(tmp_path / "lie.safetensors", {"__metadata__": {"format": "pt"}, "w": entry}, data)
    with pytest.raises(BadFile) as err:
        read_safetensors_header(path)
    assert says in err.value.why, err.value.why


def test_a_data_cut_real_file_is_truncated(real):
    real.write_bytes(real.read_bytes()[:-3])
    with pytest.raises(BadFile) as err:
        read_safetensors_header(real)
    assert err.value.truncated and err.value.what == "is truncated"


@pytest.mark.parametrize(
    "text, why",
    [
        (b'{"model_type": "llama", ', "is not valid JSON (Expecting"),
        (b"\xff\xfe\x00\x01binary", "is not valid JSON"),
        (b"[1, 2]", "does not hold a JSON object (it holds a list)"),
        (b"null", "does not hold a JSON object (it holds null)"),
        (b"7", "does not hold a JSON object (it holds a number)"),
        (b"[" * 200_000 + b"]" * 200_000, "is nested too deeply to be read"),
        (
            b'{"steps": 1' + b"0" * 400 + b"}",
            "is not valid JSON",
        ),  # beyond float range: every later float() raises
    ],
)
def test_json_objects_say_what_is_wrong_and_the_tolerant_reader_says_none(tmp_path, text, why):
    path = tmp_path / "config.json"
    path.write_bytes(text)
    with pytest.raises(BadFile) as err:
        load_json_object(path)
    assert err.value.why.startswith(why), err.value.why
    assert read_json_object(path) is None


def test_a_json_file_over_its_limit_is_not_read(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(BadFile) as err:
        load_json_object(path, limit=1000)
    assert err.value.why.startswith("is 2,") and "at most 1,000 expected" in err.value.why
    assert load_json_object(path)["pad"] == "x" * 2000
    with pytest.raises(BadFile, match="cannot be read"):
        load_json_object(tmp_path / "missing.json")
