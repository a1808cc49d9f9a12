"""An Ollama Modelfile for an exported GGUF: the chat template in Ollama's Go-template syntax, checked.

Ollama does not run Jinja. It renders a Go text/template with `.Messages` (every message, system ones
included, consecutive messages of one role joined by a blank line), `.System` (the system messages' text
joined the same way) and, for templates that do not use `.Messages`, `.Prompt` / `.Response`; llama.cpp then
tokenizes the result with special tokens parsed and adds BOS itself when the GGUF says `add_bos_token`.

A template is translated when it is recognised as one of a few families (Llama 3, ChatML/Qwen, the [INST]
family of Llama 2 and Mistral, the demo's `<|role|>`); the variable parts (a default system prompt, where the
system prompt goes, the spacing around [INST], a BOS before later turns) are read off the Jinja template's own
renderings of probe conversations. The translation is then checked: `render_like_ollama` (what the Go template
gives, mirrored in Python; tests/gotemplate/render.go renders the real thing with Go in the tests) must equal
the Jinja rendering, minus the BOS llama.cpp adds, on every probe conversation it renders. A template that fails
the check is not written: the Modelfile says why, and so does the export's result. A conversation the Jinja
template refuses (Mistral v0.1's refuses a system prompt: placed where Mistral's later template puts it) is a
note in the Modelfile and in the export's result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from core.files import atomic_write_text

# Probe conversations: user only, system + user, three turns, system + three turns, and longer text.
_S, _U1, _A1, _U2 = "SYSTEM-TEXT-1", "USER-TEXT-1", "ASSISTANT-TEXT-1", "USER-TEXT-2"
PROBES: list[list[dict]] = [
    [{"role": "user", "content": _U1}],
    [{"role": "system", "content": _S}, {"role": "user", "content": _U1}],
    [
        {"role": "user", "content": _U1},
        {"role": "assistant", "content": _A1},
        {"role": "user", "content": _U2},
    ],
    [
        {"role": "system", "content": _S},
        {"role": "user", "content": _U1},
        {"role": "assistant", "content": _A1},
        {"role": "user", "content": _U2},
    ],
    [
        {"role": "system", "content": "You are a pirate.\nAnswer in one line."},
        {"role": "user", "content": "What is 2 + 2?\nShow your work."},
        {"role": "assistant", "content": "Arr, 2 + 2 = 4."},
        {"role": "user", "content": "And 3 * 3?"},
    ],
]

STOPS = {
    "llama3": ["<|eot_id|>", "<|start_header_id|>"],
    "chatml": ["<|im_end|>", "<|im_start|>"],
    "llama2": ["[INST]"],
    "mistral": ["[INST]"],
    "demo": ["</s>", "<|user|>"],
}


@dataclass
class ChatTranslation:
    """A tokenizer's chat template as Ollama needs it. `template` is None when it was not translated; then
    `problem` says why (a template that is there but could not be translated faithfully, or none at all)."""

    family: str | None
    template: str | None = None
    stops: list[str] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    problem: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def faithful(self) -> bool:
        return self.template is not None


# ---- what Ollama gives -------------------------------------------------------------------------------------------


def collate(messages: list[dict]) -> tuple[str, list[dict]]:
    """Ollama's `collate`: (.System, .Messages)."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"] and m["role"] != "tool":
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    return "\n\n".join(system), out


def render_like_ollama(family: str, params: dict, messages: list[dict]) -> str:
    """What `go_template(family, params)` renders for `messages` in Ollama (checked against Go in the tests)."""
    system, msgs = collate(messages)
    if family == "llama3":
        body = "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in msgs
        )
        return body + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    if family == "chatml":
        out = ""
        if params.get("default_system") is not None and (not msgs or msgs[0]["role"] != "system"):
            out += f"<|im_start|>system\n{params['default_system']}<|im_end|>\n"
        out += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        return out + "<|im_start|>assistant\n"
    if family == "demo":
        return "".join(f"<|{m['role']}|>{m['content']}</s>" for m in msgs) + "<|assistant|>"
    p = params  # the [INST] family
    last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    out, first = "", True
    for i, m in enumerate(msgs):
        if m["role"] == "user":
            out += p["user_open"] if first else p["user_open_next"]
            where_ok = first if p["system"] == "first" else i == last
            if p["system"] != "none" and where_ok and system:
                out += p["sys_open"] + system + p["sys_close"]
            out += m["content"] + p["user_close"]
            first = False
        elif m["role"] == "assistant":
            out += p["asst_open"] + m["content"] + p["asst_close"]
    return out


def go_template(family: str, params: dict) -> str:
    """The Go template (Ollama's TEMPLATE) for a family; literal text only outside actions, no trim markers, so
    every parameter is copied exactly."""
    if family == "llama3":
        return (
            "{{ range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
            "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    if family == "chatml":
        out = ""
        if params.get("default_system") is not None:
            out += (
                '{{ if or (not .Messages) (ne (index .Messages 0).Role "system") }}<|im_start|>system\n'
                + params["default_system"]
                + "<|im_end|>\n{{ end }}"
            )
        return (
            out
            + "{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
        )
    if family == "demo":
        return "{{ range .Messages }}<|{{ .Role }}|>{{ .Content }}</s>{{ end }}<|assistant|>"
    p = params
    out = "{{ $first := true }}"
    if p["system"] == "last":
        out += '{{ $last := -1 }}{{ range $i, $m := .Messages }}{{ if eq $m.Role "user" }}{{ $last = $i }}{{ end }}{{ end }}'
    cond = "$first" if p["system"] == "first" else "(eq $i $last)"
    sys = (
        ""
        if p["system"] == "none"
        else f"{{{{ if and {cond} $.System }}}}{p['sys_open']}{{{{ $.System }}}}{p['sys_close']}{{{{ end }}}}"
    )
    out += (
        '{{ range $i, $m := .Messages }}{{ if eq $m.Role "user" }}'
        f"{{{{ if $first }}}}{p['user_open']}{{{{ else }}}}{p['user_open_next']}{{{{ end }}}}"
        f"{sys}{{{{ $m.Content }}}}{p['user_close']}{{{{ $first = false }}}}"
        f'{{{{ else if eq $m.Role "assistant" }}}}{p["asst_open"]}{{{{ $m.Content }}}}{p["asst_close"]}'
        "{{ end }}{{ end }}"
    )
    return out


# ---- what the Jinja template gives -------------------------------------------------------------------------------


def jinja_render(chat_template: str, messages: list[dict], bos: str | None, eos: str | None) -> str:
    """The tokenizer's rendering (transformers' own Jinja environment), with the generation prompt."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=chat_template,
        add_generation_prompt=True,
        bos_token=bos or "",
        eos_token=eos or "",
    )
    return rendered[0]


def template_family(jinja: str | None) -> str | None:
    """The family a Jinja template looks like, from its markers ("inst" for Llama 2 / Mistral [INST])."""
    if not jinja:
        return None
    if "<|start_header_id|>" in jinja and "<|eot_id|>" in jinja:
        return "llama3"
    if "<|im_start|>" in jinja and "<|im_end|>" in jinja:
        return "chatml"
    if "[INST]" in jinja:
        return "inst"
    # The demo template (core/demo/toy.py): `<|{{ role }}|>content</s>` and an `<|assistant|>` prompt.
    if re.search(r"<\|\{\{\s*\w+\[.role.\]\s*\}\}\|>", jinja) and "<|assistant|>" in jinja:
        return "demo"
    return None


class _Untranslatable(Exception):
    pass


def _infer_inst(render, bos: str | None) -> dict:
    """The [INST] family's spelling, read off the Jinja template's renderings of the probes."""
    r1 = render(PROBES[0])
    if _U1 not in r1:
        raise _Untranslatable("its rendering of a user message does not contain the message")
    user_open, user_close = r1.split(_U1, 1)
    r3 = render(PROBES[2])
    head = user_open + _U1 + user_close
    if not r3.startswith(head) or not r3.endswith(_U2 + user_close) or _A1 not in r3:
        raise _Untranslatable("its turns are not spelled the same way in a longer conversation")
    rest = r3[len(head) : -len(_U2 + user_close)]
    asst_open, mid = rest.split(_A1, 1)
    # Between an answer and the next question: the answer's end, then the next question's start (which may
    # carry a BOS of its own, as Llama 2's does).
    asst_close, user_open_next = mid, ""
    if mid.endswith(user_open):
        asst_close, user_open_next = mid[: len(mid) - len(user_open)], user_open
    if bos and asst_close.endswith(bos):  # Llama 2: " </s><s>[INST] ": the <s> opens the next question
        asst_close, user_open_next = asst_close[: -len(bos)], bos + user_open_next
    p = dict(
        user_open=user_open,
        user_close=user_close,
        asst_open=asst_open,
        asst_close=asst_close,
        user_open_next=user_open_next,
        system="none",
        sys_open="",
        sys_close="",
    )
    try:
        r2, r4 = render(PROBES[1]), render(PROBES[3])
    except Exception:
        # It refuses system messages (Mistral v0.1 as first published): left out, Ollama would render the prompt
        # without one, silently. Mistral's own later template for v0.1 and v0.2 puts it first in the first [INST]
        # with a blank line after it, so this one does too (translate says so).
        return {**p, "system": "first", "sys_close": "\n\n"}
    if _S not in r2:
        return p
    if not r2.startswith(user_open) or _U1 not in r2.split(_S, 1)[1]:
        raise _Untranslatable("its system prompt is not part of a user turn")
    p["sys_open"] = r2[len(user_open) : r2.index(_S)]
    p["sys_close"] = r2[r2.index(_S) + len(_S) : r2.index(_U1)]
    p["system"] = "first" if r4.index(_S) < r4.index(_U1) else "last"
    return p


def translate(
    chat_template: str | None, bos: str | None = None, eos: str | None = None, add_bos: bool = False
) -> ChatTranslation:
    """The Ollama TEMPLATE for a tokenizer's Jinja chat template, checked against the Jinja rendering."""
    if not chat_template:
        return ChatTranslation(None, problem="The tokenizer has no chat template.")
    family = template_family(chat_template)
    if family is None:
        return ChatTranslation(
            None,
            problem="The chat template is not one of the known families (Llama 3, ChatML/Qwen, Llama 2 / Mistral "
            "[INST], the demo's <|role|>).",
        )
    lead = bos if add_bos and bos else ""

    def render(messages):
        text = jinja_render(chat_template, messages, bos, eos)
        # llama.cpp adds the BOS itself (add_bos_token): the template must not spell it again.
        return text[len(lead) :] if lead and text.startswith(lead) else text

    try:
        params: dict = {}
        if family == "chatml":
            r1 = render(PROBES[0])
            m = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", r1, re.S)
            params["default_system"] = m.group(1) if m else None
        elif family == "inst":
            params = _infer_inst(render, bos)
            family = "llama2" if "<<SYS>>" in params["sys_open"] else "mistral"
    except _Untranslatable as e:
        return ChatTranslation(
            family, problem=f"The {family} chat template cannot be translated faithfully: {e}."
        )
    except Exception as e:  # the Jinja template fails on a plain conversation
        return ChatTranslation(
            family, problem=f"The chat template fails to render ({type(e).__name__}: {e})."
        )
    texts = [v for v in params.values() if isinstance(v, str)]
    if any("{{" in t or '"""' in t for t in texts):
        return ChatTranslation(family, problem="The chat template's text cannot be quoted in a Go template.")
    t = ChatTranslation(family, stops=list(STOPS[family]), params=params)
    for conv in PROBES:
        try:
            want = jinja_render(chat_template, conv, bos, eos)
        except Exception:  # the Jinja template rejects this conversation (system messages, say)
            t.notes.append(_rejected_note(family, params, conv))
            continue
        got = lead + render_like_ollama(family, params, conv)
        if got != want:
            t.problem = (
                f"The {family} chat template cannot be translated faithfully: for {len(conv)} message(s) the "
                f"model expects {want[-160:]!r} but a translated template would give {got[-160:]!r}."
            )
            return t
    t.notes = sorted(set(t.notes))
    t.template = go_template(family, params)
    return t


def _rejected_note(family: str, params: dict, conv: list[dict]) -> str:
    """What a Modelfile and the export say of a probe conversation the Jinja template refuses to render."""
    if not any(m["role"] == "system" for m in conv):
        return "The chat template rejects a probe conversation."
    if family == "mistral" and params.get("system") == "first":
        return (
            "The chat template rejects system messages; a system prompt goes first in the first [INST], a blank "
            "line after it, where Mistral's later template for this model puts it."
        )
    return "The chat template rejects system messages; Ollama drops them from the prompt."


# ---- the Modelfile -----------------------------------------------------------------------------------------------


def render_modelfile(
    gguf_name: str,
    chat_template: str | None,
    context_length: int,
    eos: str | None,
    bos: str | None = None,
    add_bos: bool = False,
) -> tuple[str, ChatTranslation]:
    """(Modelfile text, the chat template's translation)."""
    tr = translate(chat_template, bos, eos, add_bos)
    lines = [f"# Generated by LoRA Cockpit for {gguf_name}", f"FROM ./{gguf_name}", ""]
    stops = list(tr.stops)
    if tr.faithful:
        lines.append(
            f"# Chat template: the {tr.family} format, translated from the tokenizer's Jinja template and checked "
            "against it on sample conversations (llama.cpp adds the BOS token itself)."
        )
        lines += [f"# Note: {n}" for n in tr.notes]
        lines += [f'TEMPLATE """{tr.template}"""', ""]
    elif chat_template:
        lines += [f"# NO TEMPLATE: {line}" for line in _wrap(tr.problem or "")]
        lines += [
            "# Ollama needs the template in Go-template syntax; write TEMPLATE by hand:",
            "# https://github.com/ollama/ollama/blob/main/docs/template.md",
            "",
        ]
    else:
        lines += ["# The tokenizer has no chat template: this model is used as a plain completion model.", ""]
    if eos and eos not in stops:
        stops.append(eos)
    for s in stops:
        lines.append(f'PARAMETER stop "{s}"')
    lines += [
        "PARAMETER temperature 0.7",
        "PARAMETER top_p 0.9",
        "PARAMETER repeat_penalty 1.1",
        f"PARAMETER num_ctx {min(int(context_length), 4096)}",
        "",
    ]
    return "\n".join(lines), tr


def _wrap(text: str, width: int = 100) -> list[str]:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return out + ([line] if line else [])


def write_modelfile(
    gguf_path: Path,
    chat_template: str | None,
    context_length: int,
    eos: str | None,
    bos: str | None = None,
    add_bos: bool = False,
    staging: Path | None = None,
) -> tuple[Path, str, ChatTranslation]:
    """Write `<stem>.Modelfile` beside `<stem>.gguf` (one rule for the first export and every later one: each GGUF
    has its own); returns (path, command, translation). With `staging` (a folder on the same disk) it is written
    there under the same name, for the caller to rename into place once the GGUF is."""
    text, tr = render_modelfile(gguf_path.name, chat_template, context_length, eos, bos, add_bos)
    path = gguf_path.with_name(gguf_path.stem + ".Modelfile")
    atomic_write_text(staging / path.name if staging else path, text)
    name = re.sub(r"[^a-z0-9._-]+", "-", gguf_path.stem.lower()).strip("-") or "model"
    command = f"ollama create {name} -f {path}"
    return path, command, tr
