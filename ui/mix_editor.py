"""The Train page's data sources (issue #50 item 4): one Dataset file, or a mix of several (`data.sources`), a row
each with its path, format and weight, and under it its row count, format and first rows (core.recipe.mix_preview).
A source's other keys from a loaded YAML (subset, split, columns, rows, replace) and its data.mix are kept as
they were; removing all but one source goes back to the one Dataset file."""

from __future__ import annotations

import copy

import pandas as pd
import streamlit as st

from core.recipe.config import config_to_yaml
from core.recipe.mix_config import DRAW_KEYS, SOURCE_KEYS

P = "tr_mx"  # widget keys: tr_mx<id>_path / _format / _weight; tr_mx_ids: the sources' ids in order
IDS, NEXT, KEPT, MIX = f"{P}_ids", f"{P}_next", f"{P}_kept", f"{P}_mix"


def _key(i: int, setting: str) -> str:
    return f"{P}{i}_{setting}"


def active() -> bool:
    """Whether the form holds a mix of sources (else its one Dataset file)."""
    return bool(st.session_state.get(IDS))


def _set(i: int, src: dict) -> None:
    state = st.session_state
    state[_key(i, "path")] = str(src.get("path") or "")
    state[_key(i, "format")] = src.get("format") or "auto"
    state[_key(i, "weight")] = float(src["weight"]) if isinstance(src.get("weight"), (int, float)) else 1.0
    # what the row has no widget for, written back as it came (rows instead of a weight among them)
    state[KEPT][i] = {k: copy.deepcopy(v) for k, v in src.items() if k not in ("path", "format", "weight")}
    state[KEPT][i]["weighted"] = "weight" in src or "rows" not in src


def fill(cfg: dict) -> None:
    """Put a config's sources into the editor (none: the form's one Dataset file)."""
    state = st.session_state
    for key in [k for k in state if k.startswith(P)]:
        del state[key]
    data = cfg.get("data") or {}
    listed = [s for s in (data.get("sources") or []) if isinstance(s, dict)]
    state[KEPT], state[MIX] = {}, copy.deepcopy(data.get("mix"))
    for i, src in enumerate(listed):
        _set(i, src)
    state[IDS], state[NEXT] = list(range(len(listed))), len(listed)


def start() -> None:
    """'Mix in another source': the form's Dataset file becomes the first source, a blank second one follows."""
    state = st.session_state
    state.setdefault(KEPT, {})
    first = {
        "path": state.get("tr_data_path") or "",
        "format": state.get("tr_format") or "auto",
        "weight": 1.0,
    }
    _set(0, first)
    _set(1, {"weight": 1.0})
    state[IDS], state[NEXT] = [0, 1], 2


def _add() -> None:
    i = st.session_state.get(NEXT, 0)
    _set(i, {"weight": 1.0})
    st.session_state[IDS] = [*st.session_state.get(IDS, []), i]
    st.session_state[NEXT] = i + 1


def _remove(i: int) -> None:
    state = st.session_state
    left = [x for x in state.get(IDS, []) if x != i]
    if len(left) == 1:  # one source is a Dataset file again
        state["tr_data_path"], state["tr_format"] = _value(left[0], "path"), _value(left[0], "format")
        left = []
    state[IDS] = left


def _value(i: int, setting: str):
    value = st.session_state.get(_key(i, setting))
    return value.strip() if isinstance(value, str) else value


def read(raw: dict) -> None:
    """Write the editor's sources into `raw` (the form's run config): data.sources and data.mix with no data.path,
    or neither (the one Dataset file)."""
    data = raw.setdefault("data", {})
    if not active():
        data.pop("sources", None)
        data.pop("mix", None)
        return
    listed = []
    for i in st.session_state[IDS]:
        kept = dict(st.session_state.get(KEPT, {}).get(i) or {"weighted": True})
        src = {"path": _value(i, "path") or None}
        if (_value(i, "format") or "auto") != "auto":
            src["format"] = _value(i, "format")
        if kept.pop("weighted"):
            src["weight"] = _value(i, "weight")
            kept.pop("rows", None), kept.pop("replace", None)
        src.update({k: v for k, v in kept.items() if k in SOURCE_KEYS + DRAW_KEYS})
        listed.append(src)
    data.update(path=None, format="auto", sources=listed)
    if st.session_state.get(MIX):
        data["mix"] = copy.deepcopy(st.session_state[MIX])
    else:
        data.pop("mix", None)


def draw(method, summary) -> None:
    """The sources, a bordered box each: path, format, weight (or its rows, from a YAML), Remove; under them
    `summary(i)` ({"rows", "format", "preview", "problem"} or None before the form holds a valid config)."""
    ids = st.session_state.get(IDS) or []
    st.caption(
        "Each source is read in its own format and converted to the run's rows; the weights share the mix "
        "(datasets' interleave, data.sources[].weight). Max length and the eval split hold for the mix."
    )
    for n, i in enumerate(ids):
        with st.container(border=True):
            kept = (st.session_state.get(KEPT) or {}).get(i) or {}
            c = st.columns([4, 1, 1, 1], vertical_alignment="bottom")
            c[0].text_input(f"Source {n + 1}", key=_key(i, "path"), help=f"data.sources[{n}].path: a file, "
                            "a save_to_disk folder or a Hub dataset id ORG/NAME[@REVISION]")  # fmt: skip
            c[1].selectbox("Format", ("auto", *method.formats), key=_key(i, "format"))
            if kept.get("weighted", True):
                c[2].number_input("Weight", key=_key(i, "weight"), min_value=0.0, step=0.5,
                                  help=f"data.sources[{n}].weight: its share of the mix")  # fmt: skip
            else:
                c[2].caption(
                    f"rows {kept.get('rows')}" + (" (with replacement)" if kept.get("replace") else "")
                )
            c[3].button("Remove", key=_key(i, "remove"), on_click=_remove, args=(i,))
            _summary_line(summary(n) if _value(i, "path") else None)
    st.button("Add a source", key=f"{P}_add", icon=":material/add:", on_click=_add)


def _summary_line(found: dict | None) -> None:
    if not found:
        return
    if found.get("problem"):
        st.error(found["problem"])
        return
    sample = (
        " (a streamed sample: the whole split is read when the run starts)" if found.get("sample") else ""
    )
    st.caption(f"{found['rows']:,} rows, format **{found['format']}**{sample}")
    if found.get("preview"):
        with st.expander("First rows"):
            st.dataframe(pd.DataFrame(found["preview"]), hide_index=True, width="stretch")


@st.cache_data(ttl=30, show_spinner="Reading the source…")
def _summary(raw_yaml: str, n: int) -> dict | None:
    import yaml

    from core.recipe.mix_preview import source_summary
    from ui.train_panels import _tokenizer_and_config

    raw = yaml.safe_load(raw_yaml)
    raw.setdefault("training", {}).setdefault("max_length", 512)
    try:
        tok, _ = _tokenizer_and_config(raw["model"]["path"], bool(raw["model"].get("trust_remote_code")))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the form marks the model field
    return source_summary(raw, n, tok)


def summary(raw: dict, n: int) -> dict | None:
    """Source n of the form's config (not validated: its other sources may still be blank) as source_summary
    gives it, or None while the model cannot be read."""
    return _summary(config_to_yaml(raw), n)
