"""The Train page's reward-functions editor (a method with `reward_functions`: GRPO): several reward functions,
each a preset with its settings or the user's own Python function, and a weight each. It writes the run config's
`rewards` list and TRL's `training.reward_weights` (core.recipe.rewards checks both); a config loaded into it and
read back is the same config (a key the loaded entry gave is written back even at its default value).

The user's own function runs only with its 'Run my reward code' box ticked: a loaded YAML never ticks it (the
Train page clears it on upload, as it does trust_remote_code)."""

from __future__ import annotations

import streamlit as st

from core.recipe import rewards as reward_specs

P = "tr_rw"  # widget keys: tr_rw<id>_<setting>; tr_rw_ids: the entries' ids in order
IDS, NEXT, WEIGHTS_GIVEN, LAST = f"{P}_ids", f"{P}_next", f"{P}_weights_given", "tr_rewards_last"
KIND_LABELS = {
    "match": "Exact / numeric match with an answer column",
    "format": "Format (a regex the completion must match)",
    "length": "Length (a target, or a maximum, in tokens)",
    "python": "My own Python function (a .py file)",
}
# every setting's widget value when an entry starts, per type (what a YAML leaving it out means)
DEFAULTS = {
    "name": "",
    "weight": 1.0,
    "column": reward_specs.DEFAULT_COLUMN,
    "extract": "none",
    "pattern": "",
    "numeric": False,
    "length_kind": "max",
    "tokens": 256,
    "path": "",
    "function": "reward",
    "trust_code": False,
}
# the settings each type writes, beside type and name: always (the type needs them) or when set / given
ALWAYS = {"match": ("column",), "format": ("pattern",), "length": (), "python": ("path", "function")}
OPTIONAL = {"match": ("extract", "pattern", "numeric"), "format": (), "length": (), "python": ("trust_code",)}
DEMO_REWARD = {"type": "match", "column": reward_specs.DEFAULT_COLUMN}  # a fresh GRPO form's first reward


def _key(i: int, setting: str) -> str:
    return f"{P}{i}_{setting}"


def _set_entry(i: int, spec: dict, weight: float) -> None:
    """Put one `rewards` entry into its widgets (before they are drawn)."""
    state = st.session_state
    for setting, value in DEFAULTS.items():
        state[_key(i, setting)] = value
    kind = spec.get("type") if spec.get("type") in reward_specs.TYPES else "match"
    state[_key(i, "type")] = kind
    state[_key(i, "weight")] = float(weight)
    given = set()
    for setting, value in spec.items():
        if setting in DEFAULTS and value is not None:
            state[_key(i, setting)] = value
            given.add(setting)
    if kind == "length":
        length_kind = "target" if spec.get("target") is not None else "max"
        state[_key(i, "length_kind")] = length_kind
        state[_key(i, "tokens")] = int(spec.get(length_kind) or DEFAULTS["tokens"])
    state[_key(i, "given")] = given


def fill(cfg: dict) -> None:
    """Put a config's rewards and their weights into the editor (the demo's exact match when it has none)."""
    state = st.session_state
    for key in [k for k in state if k.startswith(P) or k == LAST]:
        del state[key]
    specs = [s for s in (cfg.get("rewards") or []) if isinstance(s, dict)] or [DEMO_REWARD]
    weights = (cfg.get("training") or {}).get("reward_weights")
    weights = weights if isinstance(weights, list) and len(weights) == len(specs) else [1.0] * len(specs)
    for i, (spec, weight) in enumerate(zip(specs, weights, strict=True)):
        _set_entry(i, spec, weight if isinstance(weight, (int, float)) else 1.0)
    state[IDS], state[NEXT] = list(range(len(specs))), len(specs)
    state[WEIGHTS_GIVEN] = "reward_weights" in (cfg.get("training") or {})


def _value(i: int, setting: str):
    """A setting's widget value; its default when the widget has none (Streamlit forgets the state of a widget
    that a run did not draw: the settings of another type)."""
    value = st.session_state.get(_key(i, setting), DEFAULTS.get(setting))
    return value.strip() if isinstance(value, str) else value


def _spec(i: int) -> tuple[dict, float]:
    """One entry's `rewards` item and weight, as its widgets say."""
    kind, given = _value(i, "type") or "match", st.session_state.get(_key(i, "given"), set())
    spec: dict = {"type": kind}
    if _value(i, "name"):
        spec["name"] = _value(i, "name")
    for setting in ALWAYS[kind]:
        spec[setting] = _value(i, setting)
    for setting in OPTIONAL[kind]:
        if setting in given or _value(i, setting) != DEFAULTS[setting]:
            spec[setting] = _value(i, setting)
    if kind == "length":
        spec[_value(i, "length_kind")] = int(_value(i, "tokens") or 0)
    return spec, float(_value(i, "weight") or 0.0)


def ensure(cfg: dict) -> None:
    """Fill the editor before it is drawn when it holds nothing to draw: the first time a reward method is chosen,
    or back from another method, whose run Streamlit forgot these widgets in (from the rewards last read)."""
    state = st.session_state
    ids = state.get(IDS)
    if ids and all(_key(i, "type") in state for i in ids):
        return
    last = state.get(LAST)
    fill(last if last is not None else cfg)


def read(raw: dict) -> None:
    """Write the editor's rewards and weights into `raw` (the form's run config)."""
    if st.session_state.get(IDS) is None:
        fill(raw)
    entries = [_spec(i) for i in st.session_state[IDS]]
    raw["rewards"] = [spec for spec, _ in entries]
    weights = [w for _, w in entries]
    training = raw.setdefault("training", {})
    if st.session_state.get(WEIGHTS_GIVEN) or any(w != 1.0 for w in weights):
        training["reward_weights"] = weights
    else:
        training.pop("reward_weights", None)  # TRL's default: every reward weighs 1
    st.session_state[LAST] = {"rewards": raw["rewards"], "training": dict(training)}


def _add(kind: str) -> None:
    i = st.session_state.get(NEXT, 0)
    _set_entry(i, {"type": kind}, 1.0)
    st.session_state[IDS] = [*st.session_state.get(IDS, []), i]
    st.session_state[NEXT] = i + 1


def _remove(i: int) -> None:
    st.session_state[IDS] = [x for x in st.session_state.get(IDS, []) if x != i]


def draw(errors_slot=None) -> None:
    """The editor: one bordered box per reward function, and a row to add another."""
    st.markdown("##### Rewards")
    st.caption(
        "Each completion is scored by every function below; the group's completions that score above their mean "
        "are made more likely. Presets score 0 to 1; the weights are training.reward_weights."
    )
    ids = st.session_state.get(IDS) or []
    for n, i in enumerate(ids):
        with st.container(border=True):
            _draw_entry(i, n, len(ids))
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    kind = c1.selectbox(
        "Another reward function", list(KIND_LABELS), format_func=KIND_LABELS.get, key=f"{P}_new"
    )
    c2.button("Add", key=f"{P}_add", icon=":material/add:", on_click=_add, args=(kind,))


def _draw_entry(i: int, n: int, count: int) -> None:
    c = st.columns([3, 2, 1, 1], vertical_alignment="bottom")
    kind = c[0].selectbox(
        f"Reward {n + 1}", list(KIND_LABELS), format_func=KIND_LABELS.get, key=_key(i, "type")
    )
    c[1].text_input(
        "Name (as logged: rewards/<name>/mean)",
        key=_key(i, "name"),
        placeholder=reward_specs.name_of({"type": kind}, 0, [{"type": kind}]),
        help=f"rewards[{n}].name: blank names it after its type",
    )
    c[2].number_input("Weight", key=_key(i, "weight"), step=0.5, help="training.reward_weights")
    c[3].button("Remove", key=_key(i, "remove"), on_click=_remove, args=(i,), disabled=count == 1)
    if kind == "match":
        c = st.columns([2, 2, 2, 1], vertical_alignment="bottom")
        c[0].text_input(
            "Answer column", key=_key(i, "column"), help=f"rewards[{n}].column: the rows' answers"
        )
        c[1].selectbox(
            "Answer in the completion",
            reward_specs.EXTRACTIONS,
            key=_key(i, "extract"),
            help=f"rewards[{n}].extract: the whole completion (none), its last number, an <answer> tag, "
            "\\boxed{}, or the regex's first group",
        )
        regex = st.session_state.get(_key(i, "extract")) == "regex"
        c[2].text_input("Regex (extract: regex)", key=_key(i, "pattern"), disabled=not regex)
        c[3].checkbox("Numeric", key=_key(i, "numeric"), help=f"rewards[{n}].numeric: 72.0 matches 72")
    elif kind == "format":
        st.text_input(
            "Regex the whole completion must match",
            key=_key(i, "pattern"),
            help=f"rewards[{n}].pattern, e.g. (?s)<think>.*</think>\\s*<answer>.*</answer>",
        )
    elif kind == "length":
        c = st.columns(2)
        c[0].radio(
            "Score",
            ("max", "target"),
            key=_key(i, "length_kind"),
            horizontal=True,
            format_func={"max": "1 up to a maximum", "target": "closeness to a target"}.get,
        )
        c[1].number_input("Tokens", key=_key(i, "tokens"), min_value=1, step=16)
    else:
        c = st.columns([3, 1])
        c[0].text_input("Python file", key=_key(i, "path"), help=f"rewards[{n}].path")
        c[1].text_input("Function", key=_key(i, "function"), help=f"rewards[{n}].function")
        st.checkbox(
            "Run my reward code",
            key=_key(i, "trust_code"),
            help=f"rewards[{n}].trust_code: the file runs in the trainer process with your rights; tick it only "
            "for code you trust. A loaded YAML never ticks it for you.",
        )


def untrusted() -> bool:
    """Whether one of the editor's rewards is the user's own code with its box unticked."""
    return any(
        _value(i, "type") == "python" and not _value(i, "trust_code") for i in st.session_state.get(IDS) or []
    )


def clear_trust(cfg: dict) -> bool:
    """Untick every reward's trust_code in a config about to fill the form (an uploaded YAML); True if one was."""
    asked = False
    for spec in cfg.get("rewards") or []:
        if isinstance(spec, dict) and spec.get("trust_code"):
            spec["trust_code"], asked = False, True
    return asked
