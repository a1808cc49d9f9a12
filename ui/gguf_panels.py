"""The Merge & Export page's GGUF part: the type list (which types need llama.cpp's quantizer, said before Convert),
the GGUF tab for an existing export, a job's progress, and a finished export's report with its files to download
(or, when large, their paths to copy). core.gguf does the work; imported on first use (it loads numpy and gguf)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import streamlit as st

from core import jobs
from core.fmt import disk
from ui.jobs import follow

GGUF_TYPES = ["q8_0", "f16", "bf16", "q5_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"]
# Up to this size the browser gets the file itself; a larger one is read into the server's memory for the button,
# so it gets its path to copy instead.
DOWNLOAD_MAX_BYTES = 100 * 2**20


def type_label(gtype: str) -> str:
    """'q4_k_m · needs llama.cpp's quantizer (not installed)': a K-quant says what it needs, before Convert."""
    from core.gguf import K_TYPES
    from core.gguf.export import quantizer_missing

    if gtype not in K_TYPES:
        return gtype
    return f"{gtype} · needs llama.cpp's quantizer" + (" (not installed)" if quantizer_missing(gtype) else "")


def type_select(slot, key: str, **kw) -> tuple[str, str | None]:
    """(the type chosen, why it cannot be written here or None), the reason shown under the list."""
    from core.gguf.export import quantizer_missing

    gtype = slot.selectbox("GGUF type", GGUF_TYPES, key=key, format_func=type_label, **kw)
    missing = None if kw.get("disabled") else quantizer_missing(gtype)
    if missing:
        slot.warning(missing)
    return gtype, missing


def gguf_progress(p: dict) -> None:
    total, done = p.get("tensors_total") or p.get("tensors") or 0, p.get("tensors_done") or 0
    frac = min(1.0, done / total) if isinstance(total, int) and total else 0.0
    st.progress(frac, text=f"GGUF: {p.get('phase', 'starting')} {done}/{total or '?'} tensors")


def show_gguf(d: dict) -> None:
    from core.gguf import summary_lines

    st.success("\n\n".join(summary_lines(d)))
    if d.get("template_problem"):
        st.warning(
            "The Modelfile has no chat TEMPLATE: "
            + d["template_problem"]
            + " Ollama would format conversations wrongly with a guessed one; write TEMPLATE by hand."
        )
    if d.get("modelfile"):
        with contextlib.suppress(OSError):  # moved or deleted since: the summary above still names it
            st.code(Path(d["modelfile"]).read_text(encoding="utf-8")[:4000], language=None)
    if d.get("ollama_command"):
        st.code(d["ollama_command"], language="bash")
    downloads([Path(p) for p in (d.get("out"), d.get("modelfile")) if p])


def downloads(files: list[Path]) -> None:
    """Each file to download, or its path to copy when it is large (or gone)."""
    columns = st.columns(max(1, len(files)))
    for column, path in zip(columns, files, strict=False):
        try:
            size = path.stat().st_size
        except OSError:
            column.caption(f"{path.name}: no longer there.")
            continue
        if size <= DOWNLOAD_MAX_BYTES:
            column.download_button(
                f"Download {path.name} ({disk(size)})",
                path.read_bytes(),
                file_name=path.name,
                mime="application/octet-stream",
                icon=":material/download:",
                key=f"gguf_download_{path}",
            )
        else:
            column.caption(f"{path.name} is {disk(size)}, too large to send through the browser; its path:")
            column.code(str(path), language=None)


def free_path(path: Path) -> Path:
    """`path`, or `<stem>-2<suffix>`, `-3`, ... the first that does not exist."""
    n, out = 2, path
    while out.exists():
        out, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return out


def gguf_tab(ws: Path) -> None:
    """Convert a merged export (any model folder in <workspace>/exports) to GGUF, as a background job."""
    from core.gguf import BadInput, estimate_size

    exports = sorted((p for p in (ws / "exports").glob("*") if (p / "config.json").is_file()), reverse=True)
    if not exports:
        st.info("Merge an adapter first (the Merge & export tab): its export folder is what GGUF converts.")
        return
    c1, c2, c3 = st.columns([3, 2, 1])
    src = c1.selectbox("Model folder", exports, format_func=lambda p: p.name, key="gguf_src")
    gtype, missing = type_select(c2, "gguf_type", help="q8_0: near-lossless; q4_k_m: Ollama's usual")
    verify = c3.selectbox("Verification", ["auto", "quick", "full", "none"], key="gguf_verify")
    first = src.with_name(f"{src.name}-{gtype}.gguf")
    out = free_path(first)  # a GGUF file is never overwritten: a later export takes the next free name
    try:
        size = estimate_size(src, gtype)
        again = (
            f" ({first.name} exists already and is kept: this export writes the next name)"
            if out != first
            else ""
        )
        st.caption(f"Output: {out} · about {disk(size['bytes'])} ({size['tensors']} tensors){again}")
    except BadInput as e:
        st.error(str(e))
        return
    # the newest export of this model and type: the one running, or the last one that finished
    job = jobs.latest(ws, "gguf", model=str(src), type=gtype)
    running = job is not None and not job.done
    if running:
        st.caption("An export of this model and type is running: its progress is below.")
    if st.button("Convert to GGUF", key="gguf_go", type="primary", disabled=running or bool(missing)):
        try:
            jobs.start(
                ws,
                "gguf",
                {"model": str(src), "out": str(out), "type": gtype, "verify": verify},
                key=str(out),
            )
        except jobs.JobError as e:
            st.error(str(e))
            return
        st.rerun()
    if job is None:
        return
    if running:

        def draw(view):
            gguf_progress(view.progress)
            st.caption(
                f"Running as a background job ({view.path.name}); reloading this page reattaches to it."
            )

        follow(lambda: jobs.read(job.path), draw)
    elif job.state == "failed":
        st.error(job.error or "The GGUF export failed.")
    else:
        show_gguf(job.result or {})
