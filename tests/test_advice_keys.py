"""Every setting that the diagnosis, the health warnings and the troubleshooting page advise is a key the run config accepts,
written under the name and section the config uses (issue: the advice said max_seq_length, the config did not)."""

import ast
import re
from pathlib import Path

import pytest

from core.recipe.config import section_schema
from core.recipe.config_keys import ALIASES, RENAMED, SECTIONS

ROOT = Path(__file__).resolve().parents[1]
ADVICE_SOURCES = ["core/monitor/diagnose.py", "core/monitor/health.py"]
PATH = re.compile(r"\b(model|quantization|lora|data|training)\.([A-Za-z_][A-Za-z0-9_]*)\b(?!\()")
WORD = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def _all_keys() -> dict[str, set[str]]:
    # an SFT run's keys and a DPO run's (its training section is trl.DPOConfig: training.beta, ...)
    return {
        section: set(section_schema(section)) | set(section_schema(section, "dpo")) for section in SECTIONS
    }


def _sentences(path: str) -> list[str]:
    """The string literals of a module that are sentences (advice), not lookup keys or docstrings."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and " " in n.value
        and id(n) not in docstrings
    ]


def _troubleshooting_page() -> list[str]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    start = text.index("<!-- troubleshooting")
    return [text[start : text.index("<!-- end troubleshooting")]]


def _problems(texts: list[str]) -> list[str]:
    keys = _all_keys()
    bare_keys = set().union(*keys.values()) | set(ALIASES) | {key for _, key in RENAMED}
    bare_keys -= {"path"}
    problems = []
    for text in texts:
        for section, key in PATH.findall(text):
            if key not in keys[section]:
                problems.append(f"{section}.{key} (not a key of the {section} section): {text[:90]!r}")
        stripped = re.sub(PATH.pattern + r"(?:\s*[:=]\s*[\w.\-]+)?", "", text)  # a key and its value
        for word in WORD.findall(stripped):
            if word in bare_keys:
                problems.append(
                    f"{word} without its section (write it as the config names it): {text[:90]!r}"
                )
    return problems


@pytest.mark.parametrize("source", ADVICE_SOURCES)
def test_advice_names_config_keys_by_their_path(source):
    assert _problems(_sentences(source)) == []


def test_the_troubleshooting_page_names_config_keys_by_their_path():
    assert _problems(_troubleshooting_page()) == []


def test_the_check_catches_a_key_the_config_does_not_have():
    # the old advice: a TRL 0.x name, and a bare key without its section
    assert _problems(["Lower max_seq_length or enable gradient_checkpointing."])
    assert _problems(["Set training.max_seq_len to 512."])
    assert not _problems(["Lower training.max_length or set training.gradient_checkpointing: true."])
