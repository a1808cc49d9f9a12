"""Shared fixtures: tiny real models built locally (no hub), offline mode, few threads (CI has 2 cores)."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    import torch

    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama-style model with GQA and the char tokenizer, fp32, one safetensors file."""
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory) -> Path:
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_tied"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt2"), "gpt2")


@pytest.fixture()
def workspace(tmp_path, monkeypatch) -> Path:
    """A fresh workspace folder, also exported for subprocesses and the Streamlit app."""
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.setenv("LORA_COCKPIT_WORKSPACE", str(ws))
    return ws
