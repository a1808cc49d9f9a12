"""GGUF export (core/gguf): tiny local models of each family with their real tokenizer types, exported and
verified through transformers' GGUF loaders; a broken tensor mapping is caught; bad input and killed exports
leave nothing at --out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.gguf import BadInput, ExportError, estimate_size, export_gguf, read_progress

REPO = Path(__file__).resolve().parent.parent

CORPUS = [
    "Hello world! How are you today? I am fine, thank you very much.",
    "The quick brown fox jumps over the lazy dog. 0123456789 42 3.14",
    "def add(a, b):\n    return a + b  # sum of two numbers\n",
    "for i in range(10):\n    print(i * i)\n",
    "Bonjour, ça va ? Grüße aus München. ¿Qué tal, señor?",
    "Привет, мир! Ελληνικά γράμματα. مرحبا بالعالم 日本語のテキスト 中文字符",
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "emoji 🙂🚀 and   several   spaces\tand tabs",
]
PROMPTS_FOR_FIT = (
    "The capital of France is Paris.",
    "Hello! How are you today? I am fine, thank you.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
)
# Chat templates as the model families ship them (same behaviour; written out here, nothing downloaded).
# Llama 2 chat: the system prompt inside the first [INST], a BOS before every question, stripped text.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# Mistral 7B Instruct v0.1 as first published: `[INST] X [/INST]`, user and assistant roles only.
MISTRAL_V01_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Mistral 7B Instruct v0.3: `[INST] X[/INST]`, the system prompt in the last question, trimmed answers.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
# Llama 3 Instruct.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Qwen2 Instruct: ChatML with a default system prompt when the conversation has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def spm_tokenizer(out: Path, template: str):
    """A real SentencePiece BPE model (byte fallback, like Llama 2 / Mistral), trained on a few lines."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    work = out.parent / (out.name + "-spm")
    work.mkdir()
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(work / "tokenizer"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (work / "tokenizer.model").replace(work / "x")  # keep the trainer's name free
    folder = work / "tok"
    folder.mkdir()
    (work / "x").replace(folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = template
    return tok


def byte_bpe_tokenizer(split: str, specials: list[str], bos: str | None, eos: str, template: str):
    """A byte-level BPE (like Llama 3 / Qwen2) trained with `tokenizers`, with that family's split regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=None)
    fast.chat_template = template
    return fast


def save_model(out: Path, arch: str, tok, **overrides) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from core.demo.toy import tiny_config

    ids = {k: overrides.pop(f"{k}_token_id", getattr(tok, f"{k}_token_id")) for k in ("bos", "eos", "pad")}
    cfg = tiny_config(
        arch,
        vocab_size=overrides.pop("vocab_size", len(tok)),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        initializer_range=0.1,  # wider logits than the default 0.02, so argmax comparisons mean something
        **overrides,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)  # non-zero qkv biases, so a wrong bias mapping would show
    fit(model, tok)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def fit(model, tok, steps: int = 60) -> None:
    """A few seconds of training on the corpus: a random tiny model's next-token distributions are nearly
    flat, so quantization flips near-ties everywhere; a fitted one is decisive, like a real model."""
    import torch

    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in CORPUS + list(PROMPTS_FOR_FIT)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):
        ids = torch.tensor([rows[step % len(rows)]])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict[str, Path]:
    from core.demo.toy import build_tiny_model
    from core.gguf.vocab import LLAMA3_SPLIT, QWEN2_SPLIT

    root = tmp_path_factory.mktemp("gguf_families")
    l3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    qw = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    llama3_tok = byte_bpe_tokenizer(LLAMA3_SPLIT, l3, "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE)
    qwen_tok = byte_bpe_tokenizer(QWEN2_SPLIT, qw, None, "<|im_end|>", CHATML_TEMPLATE)
    return {
        "llama2": save_model(root / "llama2", "llama", spm_tokenizer(root / "llama2", LLAMA2_TEMPLATE)),
        "mistral": save_model(root / "mistral", "mistral", spm_tokenizer(root / "mistral", MISTRAL_TEMPLATE)),
        "llama3": save_model(root / "llama3", "llama", llama3_tok),
        # Qwen2 as shipped: tied embeddings, qkv biases, an embedding padded past the tokenizer's size, no
        # bos_token in the tokenizer but config.json's bos_token_id naming <|endoftext|>
        "qwen2": save_model(
            root / "qwen2",
            "qwen2",
            qwen_tok,
            vocab_size=len(qwen_tok) + 7,
            tie_word_embeddings=True,
            bos_token_id=qwen_tok.convert_tokens_to_ids("<|endoftext|>"),
        ),
        "demo": build_tiny_model(root / "demo", "llama", initializer_range=0.1),
    }


CASES = [(f, t) for f in ("llama2", "mistral", "llama3", "qwen2", "demo") for t in ("f16", "q8_0")]
CASES += [("llama3", "q4_0"), ("qwen2", "q5_0"), ("demo", "bf16")]


@pytest.mark.parametrize("family,out_type", CASES)
def test_export_verifies(families, tmp_path, family, out_type):
    out = tmp_path / f"{family}-{out_type}.gguf"
    events = []
    result = export_gguf(families[family], out, out_type, "full", on_progress=events.append)
    r = result.report
    assert out.is_file() and r["ok"], r
    assert r["tensors"]["ok"] and r["config"]["ok"] and r["logits"]["ok"]
    tk = r["tokenizer"]
    assert tk["ok"] and tk["matched"] == tk["judged"] and tk["add_special_tokens_agree"], tk
    assert tk["judged"] == tk["samples"]  # multilingual, code, specials and chat all judged (the demo too)
    if family == "demo":
        # newline, tab, accents, CJK, emoji: <unk> in the source, byte tokens in the GGUF, judged as such
        assert tk["unk_spelled_as_bytes"] >= 4, tk
    lg = r["logits"]
    if out_type in ("f16", "bf16"):
        assert lg["argmax_agreement_beyond_ties"] == 1.0 and lg["max_abs_delta"] <= lg["tolerance"]
    else:
        assert lg["argmax_agreement"] >= lg["limits"]["argmax"] and lg["top5_overlap"] >= lg["limits"]["top5"]
    # progress: one event per tensor at least, ending in "done" with every tensor written
    assert events[-1]["phase"] == "done" and events[-1]["tensors_done"] == events[-1]["tensors_total"]
    assert read_progress(out)["phase"] == "done"
    # the size estimate is exact for the tensor data
    est = estimate_size(families[family], out_type)
    assert est["tensor_bytes"] <= result.size <= est["tensor_bytes"] + est["metadata_bytes_approx"]
    assert result.modelfile is not None and result.modelfile.is_file()
    assert f"FROM ./{out.name}" in result.modelfile.read_text()


def test_gguf_layout_matches_llama_cpp(families, tmp_path):
    """Names, types and llama.cpp's keys, read with gguf-py: what llama.cpp itself will look up."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    out = tmp_path / "l3.gguf"
    export_gguf(families["llama3"], out, "q8_0", "none", modelfile=False)
    r = gguf.GGUFReader(str(out))
    t = {x.name: x for x in r.tensors}
    assert t["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert "output.weight" in t and "rope_freqs.weight" not in t
    assert r.get_field("general.architecture").contents() == "llama"
    assert r.get_field("tokenizer.ggml.model").contents() == "gpt2"
    assert r.get_field("tokenizer.ggml.pre").contents() == "llama-bpe"
    assert r.get_field("llama.rope.dimension_count").contents() == 16
    assert r.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert r.get_field("tokenizer.ggml.add_bos_token").contents() is True
    # q is permuted into llama.cpp's rotary layout: rows of a head are interleaved halves
    with safe_open(str(families["llama3"] / "model.safetensors"), "np") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    got = gguf.dequantize(t["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    hd = q.shape[0] // 4
    assert np.allclose(got[1], q[hd // 2], atol=0.02) and np.allclose(got[2], q[1], atol=0.02)


def test_qwen2_tied_and_padded(families, tmp_path):
    import gguf

    out = tmp_path / "q.gguf"
    export_gguf(families["qwen2"], out, "f16", "none", modelfile=False)
    r = gguf.GGUFReader(str(out))
    names = {x.name for x in r.tensors}
    assert "output.weight" not in names and "blk.0.attn_q.bias" in names
    assert r.get_field("general.architecture").contents() == "qwen2"
    assert r.get_field("tokenizer.ggml.pre").contents() == "qwen2"
    tokens = r.get_field("tokenizer.ggml.tokens").contents()
    assert (
        tokens[-1].startswith("[PAD")
        and len(tokens) == json.loads((families["qwen2"] / "config.json").read_text())["vocab_size"]
    )


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_wrong_qk_mapping_is_caught(families, tmp_path, mode):
    out = tmp_path / "broken.gguf"
    with pytest.raises(ExportError) as e:
        export_gguf(families["llama2"], out, "f16", mode, skip_qk_permute=True)
    assert not out.exists() and "attn_q" in str(e.value)
    assert not list(tmp_path.glob(".*.partial"))  # the temporary file is gone too
    if mode == "full":
        assert not e.value.report["logits"]["ok"]
    assert read_progress(out)["phase"] == "failed"


@pytest.mark.slow  # an export in its own process
def test_wrong_mapping_via_cli_exits_1(families, tmp_path):
    out = tmp_path / "broken.gguf"
    env = dict(os.environ, LORA_COCKPIT_TEST_GGUF_SKIP_QK_PERMUTE="1")
    p = _cli(["--model", str(families["demo"]), "--out", str(out), "--verify", "quick"], env)
    assert p.returncode == 1 and not out.exists()
    assert "Verification failed" in p.stderr and "Traceback" not in p.stderr


def _cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.gguf", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _main(args: list[str]) -> subprocess.CompletedProcess:
    """core.gguf's main(argv) in this process (tests/cli.py: in_process), for the bad-input checks;
    test_wrong_mapping_via_cli_exits_1 and the kill tests keep the real `python -m core.gguf`."""
    from core.gguf.__main__ import main
    from tests.cli import in_process

    return in_process(main, *args)


def test_bad_inputs_exit_2_with_one_line(families, tmp_gpt2_model, tmp_path, monkeypatch):
    no_cfg = tmp_path / "no_config"
    no_cfg.mkdir()
    existing = tmp_path / "exists.gguf"
    existing.write_bytes(b"keep me")
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    cases = {
        "does not exist": ["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "a.gguf")],
        "config.json": ["--model", str(no_cfg), "--out", str(tmp_path / "b.gguf")],
        "not supported": ["--model", str(tmp_gpt2_model), "--out", str(tmp_path / "c.gguf")],
        "already exists": ["--model", str(families["demo"]), "--out", str(existing)],
        "does not exist.": ["--model", str(families["demo"]), "--out", str(a_file / "d.gguf")],
        "llama-quantize": [
            "--model",
            str(families["demo"]),
            "--out",
            str(tmp_path / "e.gguf"),
            "--type",
            "q4_k_m",
        ],
        "Unknown --type": [
            "--model",
            str(families["demo"]),
            "--out",
            str(tmp_path / "f.gguf"),
            "--type",
            "q3",
        ],
    }
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no K-quantizer at all
    monkeypatch.setenv("LORA_COCKPIT_NO_LLAMA_CPP", "1")
    for phrase, args in cases.items():
        p = _main(args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, (phrase, p.stderr)
        assert len(lines) == 1 and phrase in lines[0] and "Traceback" not in p.stderr, (phrase, p.stderr)
    assert existing.read_bytes() == b"keep me"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["exists.gguf", "no_config", "plain"]


@pytest.fixture(scope="session")
def tmp_gpt2_model(tmp_path_factory) -> Path:
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gpt2"), "gpt2")


@pytest.mark.slow  # exports in their own processes, one killed midway
def test_killed_export_leaves_nothing_and_next_run_cleans_up(families, tmp_path):
    out = tmp_path / "k.gguf"
    env = dict(os.environ, LORA_COCKPIT_TEST_GGUF_PAUSE_AFTER_FIRST_TENSOR="60")
    cmd = [sys.executable, "-m", "core.gguf", "--model", str(families["demo"]), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            p = read_progress(out)
            if p and p.get("tensors_done", 0) >= 1:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the export never reported its first tensor")
        assert list(tmp_path.glob(".k.gguf.*.partial"))  # mid-write: only the hidden temporary exists
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    result = export_gguf(families["demo"], out, "f16", "quick")
    assert out.is_file() and result.report["ok"]
    assert not list(tmp_path.glob(".k.gguf.*.partial"))


@pytest.mark.slow  # an export in its own process, stopped midway
def test_sigterm_removes_the_temporary(families, tmp_path):
    out = tmp_path / "t.gguf"
    env = dict(os.environ, LORA_COCKPIT_TEST_GGUF_PAUSE_AFTER_FIRST_TENSOR="60")
    cmd = [sys.executable, "-m", "core.gguf", "--model", str(families["demo"]), "--out", str(out)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((read_progress(out) or {}).get("tensors_done", 0) >= 1):
        time.sleep(0.1)
    proc.terminate()
    proc.wait(timeout=30)
    assert proc.returncode != 0 and not out.exists()
    assert not list(tmp_path.glob(".t.gguf.*.partial"))


def test_bad_input_api_raises_before_writing(families, tmp_path):
    with pytest.raises(BadInput):
        export_gguf(families["demo"], tmp_path / "x.bin", "f16")
    with pytest.raises(BadInput):
        estimate_size(families["demo"], "q9")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two exports in their own processes
def test_two_exports_to_one_path_leave_the_winners_sidecars(families, tmp_path):
    """Issue #21 item 10: the first export to finish keeps the file (right), but its .verify.json described the
    loser's export and progress.json said failed. The sidecars belong to the export whose file is there."""
    out = tmp_path / "race.gguf"
    slow_env = dict(os.environ, LORA_COCKPIT_TEST_GGUF_PAUSE_AFTER_FIRST_TENSOR="8")
    base = [sys.executable, "-m", "core.gguf", "--model", str(families["demo"]), "--out", str(out)]
    slow = subprocess.Popen(
        [*base, "--verify", "full"],
        cwd=REPO,
        env=slow_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not ((read_progress(out) or {}).get("tensors_done", 0) >= 1):
            assert time.time() < deadline, "the first export never reported its first tensor"
            time.sleep(0.1)
        fast = subprocess.Popen(
            [*base, "--verify", "quick"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        assert fast.wait(timeout=300) == 0, fast.stderr.read()
        _, err = slow.communicate(timeout=300)
    finally:
        if slow.poll() is None:
            slow.kill()
    assert slow.returncode != 0 and "appeared during the export" in err, err[-2000:]
    report = json.loads(out.with_name(out.name + ".verify.json").read_text())
    assert report["ok"] and report["mode"] == "quick"  # the winner's verification, not the loser's
    progress = read_progress(out)
    assert progress["phase"] == "done" and progress["pid"] == fast.pid, progress


def _lie(model: Path, folder: Path, edit) -> Path:
    """A copy of `model` whose single safetensors header says something its data does not hold."""
    import shutil
    import struct

    shutil.copytree(model, folder)
    path = next(folder.glob("*.safetensors"))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    edit(header[key])
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    return folder


LIES = {
    "offsets beyond the file": lambda v: v.update(data_offsets=[0, 10**12]),
    "negative offset": lambda v: v.update(data_offsets=[-5, 100]),
    "shape beyond its data": lambda v: v.update(shape=[10**6, 10**6]),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_safetensors_header_is_one_sentence_and_nothing_is_written(families, tmp_path, lie):
    """safetensors' own checks raised their trace halfway through the export and left its progress file."""
    model = _lie(families["demo"], tmp_path / "model", LIES[lie])
    out = tmp_path / "out"
    out.mkdir()
    p = _main(["--model", str(model), "--out", str(out / "m.gguf")])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(lines) == 1 and "is not a valid safetensors file" in lines[0], p.stderr
    assert list(out.iterdir()) == []
