"""Modelfile templates (issue #23 item 2): rendered as Ollama renders them, with Go's text/template
(tests/gotemplate/render.go), equal to the model's own Jinja chat template on user-only, system + user,
three-turn and system + three-turn conversations, for Llama 2, Mistral v0.1 and v0.3, Llama 3, ChatML/Qwen
(with Qwen's default system prompt) and the demo; templates that cannot be translated faithfully are not
written, and the export says why.

The Go tests need `go` (Debian: golang-go); without it they skip and the Python mirror of the same
templates is still checked."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_gguf import (
    CHATML_TEMPLATE,
    LLAMA2_TEMPLATE,
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    MISTRAL_V01_TEMPLATE,
)

from core.demo.toy import CHAT_TEMPLATE as DEMO_TEMPLATE
from core.gguf.modelfile import jinja_render, render_like_ollama, render_modelfile, translate

REPO = Path(__file__).resolve().parent.parent
RENDERER = REPO / "tests" / "gotemplate" / "render.go"

QWEN25_TEMPLATE = (  # Qwen2.5 Instruct without its tools branch: another default system prompt
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_PLAIN = (  # ChatML without a default system prompt (OpenHermes and friends)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# name -> (Jinja template, bos_token, eos_token, add_bos_token in the GGUF, the family expected)
FAMILIES = {
    "llama2": (LLAMA2_TEMPLATE, "<s>", "</s>", True, "llama2"),
    "mistral-v0.1": (MISTRAL_V01_TEMPLATE, "<s>", "</s>", True, "mistral"),
    "mistral-v0.3": (MISTRAL_TEMPLATE, "<s>", "</s>", True, "mistral"),
    "llama3": (LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", True, "llama3"),
    "qwen2": (CHATML_TEMPLATE, None, "<|im_end|>", False, "chatml"),
    "qwen2.5": (QWEN25_TEMPLATE, None, "<|im_end|>", False, "chatml"),
    "chatml": (CHATML_PLAIN, None, "<|im_end|>", False, "chatml"),
    "demo": (DEMO_TEMPLATE, "<s>", "</s>", False, "demo"),
}
SYSTEM = {"role": "system", "content": "You answer in French.\nBe brief."}
CONVERSATIONS = {
    "user only": [{"role": "user", "content": "Où est la gare ? 🚉"}],
    "system + user": [SYSTEM, {"role": "user", "content": "Hello!"}],
    "three turns": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one,\nplease."},
    ],
    "system + three turns": [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Bleu."},
        {"role": "user", "content": "Encore."},
    ],
}


def _expected(name: str, conv: list[dict]) -> str | None:
    """The Jinja rendering minus the BOS llama.cpp adds itself; None when the template rejects `conv`."""
    template, bos, eos, add_bos, _ = FAMILIES[name]
    try:
        text = jinja_render(template, conv, bos, eos)
    except Exception:
        return None
    if add_bos and bos:
        assert text.startswith(bos), text
        text = text[len(bos) :]
    return text


def go_render(cases: list[tuple[str, list[dict]]]) -> list[str]:
    """Render (Go template, messages) pairs with tests/gotemplate/render.go: one `go run` for all of them."""
    payload = [{"template": t, "messages": m} for t, m in cases]
    p = subprocess.run(
        ["go", "run", str(RENDERER)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for r in out:
        assert "error" not in r, r["error"]
    return [r["output"] for r in out]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_translates_faithfully(name):
    template, bos, eos, add_bos, family = FAMILIES[name]
    tr = translate(template, bos, eos, add_bos)
    assert tr.faithful and tr.problem is None and tr.family == family, tr
    for conv in CONVERSATIONS.values():
        want = _expected(name, conv)
        if want is not None:
            assert render_like_ollama(tr.family, tr.params, conv) == want


@pytest.mark.skipif(shutil.which("go") is None, reason="needs Go (Debian: apt-get install golang-go)")
def test_go_rendering_equals_the_jinja_template():
    """The templates as Ollama executes them, with Go's text/template, on every family and conversation."""
    cases, keys = [], []
    for name, (template, bos, eos, add_bos, _) in FAMILIES.items():
        tr = translate(template, bos, eos, add_bos)
        for conv_name, conv in CONVERSATIONS.items():
            if _expected(name, conv) is not None:
                cases.append((tr.template, conv))
                keys.append((name, conv_name))
    got = go_render(cases)
    wrong = {k: (g, _expected(k[0], CONVERSATIONS[k[1]])) for k, g in zip(keys, got, strict=True)}
    wrong = {k: v for k, v in wrong.items() if v[0] != v[1]}
    assert not wrong, wrong
    # what issue #23 found wrong, now right
    out = dict(zip(keys, got, strict=True))
    assert "<<SYS>>\nYou answer in French." in out[("llama2", "system + user")]  # kept, not dropped
    assert "Blue. </s><s>[INST] Another" in out[("llama2", "three turns")]  # as HF: space, </s>, <s>
    assert out[("mistral-v0.1", "user only")] == "[INST] Où est la gare ? 🚉 [/INST]"
    assert out[("mistral-v0.3", "user only")] == "[INST] Où est la gare ? 🚉[/INST]"
    assert (
        "You answer in French.\nBe brief.\n\nEncore.[/INST]" in out[("mistral-v0.3", "system + three turns")]
    )
    assert out[("qwen2", "user only")].startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>"
    )
    assert out[("qwen2.5", "user only")].startswith("<|im_start|>system\nYou are Qwen, created by Alibaba")
    assert out[("qwen2", "system + user")].count("<|im_start|>system") == 1
    assert "system" not in out[("chatml", "user only")]


LLAMA31_LIKE = (  # a system header with a date line in every prompt: no faithful translation here
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Cutting Knowledge Date: December 2023\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_V7_LIKE = (  # the system prompt in its own [SYSTEM_PROMPT] block, outside any [INST]
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + '[/INST]' }}{% elif message['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT] ' + message['content'] + '[/SYSTEM_PROMPT]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "template,bos,family",
    [
        (LLAMA31_LIKE, "<|begin_of_text|>", "llama3"),
        (MISTRAL_V7_LIKE, "<s>", "inst"),
        ("{{ messages }}", None, None),
    ],
)
def test_unfaithful_templates_are_not_written(template, bos, family):
    tr = translate(template, bos, "</s>", add_bos=bool(bos))
    assert not tr.faithful and tr.problem, tr
    text, tr2 = render_modelfile("m.gguf", template, 131072, "</s>", bos, bool(bos))
    assert 'TEMPLATE """' not in text and "# NO TEMPLATE:" in text and "by hand" in text
    assert 'PARAMETER stop "</s>"' in text and "num_ctx 4096" in text
    if family == "llama3":
        assert "cannot be translated faithfully" in tr.problem and "Cutting Knowledge" in tr.problem


# Where Mistral's own later template for v0.1 (and v0.2) puts a system prompt: the first [INST], a blank line after
# it. Ollama's rendering of the v0.1 template, which refuses system messages, must keep it there (#38 item 7).
V01_WITH_SYSTEM = {
    "system + user": "[INST] You answer in French.\nBe brief.\n\nHello! [/INST]",
    "system + three turns": "[INST] You answer in French.\nBe brief.\n\nName a colour. [/INST]Bleu.</s> "
    "[INST] Encore. [/INST]",
}


def test_a_system_prompt_the_mistral_v01_template_refuses_goes_in_the_first_inst():
    """The v0.1 template raises on a system message; Ollama rendered the translation without it, silently."""
    tr = translate(MISTRAL_V01_TEMPLATE, "<s>", "</s>", True)
    assert tr.faithful, tr
    for name, want in V01_WITH_SYSTEM.items():
        assert render_like_ollama(tr.family, tr.params, CONVERSATIONS[name]) == want
    if shutil.which("go"):  # as Ollama executes it
        cases = [(tr.template, CONVERSATIONS[name]) for name in V01_WITH_SYSTEM]
        assert go_render(cases) == list(V01_WITH_SYSTEM.values())


def test_template_that_rejects_system_messages_says_where_the_system_prompt_goes():
    text, tr = render_modelfile("m.gguf", MISTRAL_V01_TEMPLATE, 32768, "</s>", "<s>", True)
    assert tr.faithful and 'TEMPLATE """' in text
    note = next(line for line in text.splitlines() if line.startswith("# Note:"))
    assert "rejects system messages" in note and "first [INST]" in note and "drops" not in note
    assert text.count('PARAMETER stop "</s>"') == 1 and 'PARAMETER stop "[INST]"' in text


def test_no_chat_template_is_a_completion_model():
    text, tr = render_modelfile("m.gguf", None, 2048, None)
    assert tr.template is None and "plain completion model" in text and "NO TEMPLATE" not in text


def _export_with_template(tmp_path, chat_template):
    from core.demo.toy import build_tiny_model
    from core.gguf import export_gguf
    from core.gguf.vocab import load_source_tokenizer

    model = build_tiny_model(tmp_path / "m", "llama")
    tok = load_source_tokenizer(model)
    tok.chat_template = chat_template
    tok.save_pretrained(str(model))
    return export_gguf(model, tmp_path / "m.gguf", "f16", "none")


def test_export_reports_a_template_it_could_not_translate(tmp_path):
    """The export's result and summary carry the reason, so the Merge & Export page can show it."""
    from core.gguf import summary_lines

    result = _export_with_template(tmp_path, MISTRAL_V7_LIKE)
    assert result.template_family is None
    assert result.template_problem and "cannot be translated faithfully" in result.template_problem
    lines = summary_lines(result.to_dict())
    assert any(line.startswith("Modelfile has no TEMPLATE:") for line in lines), lines
    assert 'TEMPLATE """' not in result.modelfile.read_text()


def test_export_says_where_a_refused_system_prompt_goes(tmp_path):
    """#38 item 7: what the Modelfile's comment said about system prompts, the export itself says too (the CLI
    prints these lines, the Merge & Export page shows them): not only a comment nobody opens."""
    from core.gguf import summary_lines

    result = _export_with_template(tmp_path, MISTRAL_V01_TEMPLATE)
    assert result.template_family == "mistral" and not result.template_problem
    lines = summary_lines(result.to_dict())
    notes = [line for line in lines if line.startswith("Modelfile note:")]
    assert len(notes) == 1 and "system" in notes[0] and "first [INST]" in notes[0], lines
