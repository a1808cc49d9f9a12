"""Merge & Export page: try an adapter against its base, then merge it shard by shard into a verified export.

All logic lives in core.merge; this page only collects choices and shows what the engine reports.
"""

from pathlib import Path

import pandas as pd
import streamlit as st
import torch

from core import jobs, merge
from core.fmt import disk
from core.hub import ids as hub_ids
from core.hub.fetch import complete_folder
from core.workspace import WorkspaceError, check_run_name, default_workspace, inside
from ui.gguf_panels import gguf_progress, gguf_tab, show_gguf, type_select
from ui.jobs import follow
from ui.routing import leave_legacy_mode

leave_legacy_mode()

FOLDER = "Another adapter folder…"


def pick_adapter(ws: Path) -> tuple[str | None, str | None, str]:
    """(adapter folder, run name or None, suggested base folder) from a run or a typed folder."""
    runs = merge.list_adapters(ws)
    labels = [f"{c.run} ({c.state or 'no status'})" for c in runs] + [FOLDER]
    wanted = st.session_state.pop("merge_run", None)  # a run chosen on the Monitor or the Runs page
    match = next((label for c, label in zip(runs, labels, strict=False) if c.run == wanted), None)
    if match:
        st.session_state["merge_adapter_choice"] = match
    choice = st.selectbox(
        "Adapter",
        labels,
        key="merge_adapter_choice",
        help=f"Runs with a saved adapter under {ws / 'runs'}, or any peft adapter folder.",
    )
    if choice == FOLDER:
        typed = st.text_input("Adapter folder", key="merge_adapter_dir", placeholder="/path/to/adapter")
        if not typed.strip():
            return None, None, ""
        adapter_dir = Path(typed).expanduser()
        if not (adapter_dir / "adapter_config.json").is_file():
            st.error(f"{adapter_dir} is not a peft adapter folder: it has no adapter_config.json.")
            return None, None, ""
        base, note = merge.guess_base(adapter_dir)
        run = None
    else:
        c = runs[labels.index(choice)]
        if c.state and c.state != "finished":
            st.warning(f"Run {c.run} is {c.state}: its adapter may be from an unfinished run.")
        adapter_dir, base, note, run = Path(c.adapter_dir), c.base_dir, c.base_note, c.run
    if base is None:
        st.caption(f"Base model: {note}")
    return str(adapter_dir), run, base or ""


def base_input(adapter_dir: str, suggested: str) -> str | None:
    base = st.text_input(
        "Base model folder",
        value=suggested,
        key=f"merge_base_{adapter_dir}",
        help="The original (unquantized) model the adapter was trained on: config.json + safetensors or .bin, or "
        "its Hub id (complete in the cache).",
    )
    if not base.strip():
        st.info("Enter the base model folder to continue.")
        return None
    ref = hub_ids.parse(base)
    if ref is not None:  # a Hub id: its complete snapshot in the cache (the Models page downloads one)
        folder = complete_folder(ref)
        if folder is None:
            st.error(
                f"{ref} is not complete in the Hugging Face cache: download it on the Models page first."
            )
            return None
        return str(folder)
    if not (Path(base).expanduser() / "config.json").is_file():
        st.error(f"{base} is not a model folder: it has no config.json.")
        return None
    return str(Path(base).expanduser())


@st.cache_data(ttl=60, show_spinner=False)
def _trained_prompts(adapter_dir: str) -> list[str]:
    """Prompts from the data the adapter was trained on (its run's config.yaml), when it came from a run."""
    from core.recipe import methods
    from core.recipe.config import ConfigError, load_config

    try:
        cfg = load_config(Path(adapter_dir).parent / "config.yaml")
    except (ConfigError, OSError):
        return []
    return methods.get(cfg).sample_prompts(cfg["data"])


def try_it(base_dir: str, adapter_dir: str) -> None:
    st.markdown("Greedy generation from the same prompt, with the base alone and with the adapter applied.")
    samples = _trained_prompts(adapter_dir)
    if samples:
        # a prompt like the training data's, so the adapter's effect shows (a generic one gives a tiny demo
        # model gibberish); the user's own text stays theirs once they type it
        if st.session_state.get("merge_prompt_for") != adapter_dir:
            st.session_state["merge_prompt"] = samples[0]
            st.session_state["merge_prompt_for"] = adapter_dir
        st.caption("Prompts from its training data: " + " · ".join(f"`{s[:60]}`" for s in samples))
    st.session_state.setdefault("merge_prompt", "Tell me about LoRA in one sentence.")
    prompt = st.text_area("Prompt", key="merge_prompt")  # its value lives in session state (set above)
    c1, c2 = st.columns(2)
    max_new = c1.slider("New tokens", 8, 256, 48, key="merge_max_new")
    chat = c2.checkbox("Use the chat template", value=True, key="merge_chat")
    image = None
    if merge.is_vision_model(base_dir):  # a vision-language model: the prompt may ask about a picture
        image = st.text_input("Image file (optional)", key="merge_image").strip() or None
        if image and Path(image).expanduser().is_file():
            st.image(str(Path(image).expanduser()), width=128)
    if st.button("Generate with base and adapter", key="merge_try"):
        try:
            with st.spinner("Loading the model and generating twice…"):
                st.session_state["merge_try_result"] = merge.try_adapter(
                    base_dir, adapter_dir, prompt, max_new_tokens=max_new, chat=chat, image=image
                )
        except (merge.MergeError, OSError, ValueError) as e:
            st.error(str(e))
            return
    res = st.session_state.get("merge_try_result")
    if res is not None:
        left, right = st.columns(2)
        left.markdown("**Base**")
        left.code(res.base_text or "(nothing generated)", language=None, wrap_lines=True)
        right.markdown("**Base + adapter**")
        right.code(res.adapter_text or "(nothing generated)", language=None, wrap_lines=True)
        st.caption(f"{res.seconds:.1f} s for both")


def show_preflight(pf: merge.Preflight, where) -> None:
    with where.container():
        c = st.columns(4)
        # The "of what" goes into the label: a metric value this long is cut off in a quarter-width column.
        c[0].metric(f"RAM needed ({disk(pf.ram_available)} free)", disk(pf.ram_needed))
        c[1].metric(f"Disk needed ({disk(pf.disk_free)} free)", disk(pf.disk_needed))
        c[2].metric(f"Output ({pf.out_dtype})", disk(pf.out_bytes))
        c[3].metric("Tensors · shards", f"{pf.n_tensors} · {pf.n_shards}")
        st.caption(
            f"{pf.n_lora_modules} LoRA modules, {pf.n_replaced} replaced tensors; verification: {pf.verify_mode} "
            f"(the logits check needs ~{disk(pf.verify_ram_needed)} RAM)."
        )
        for note in pf.notes:
            st.info(note)
        for problem in pf.problems:
            st.error(problem)


def show_result(r: merge.MergeResult) -> None:
    v = r.verification
    (st.success if v.passed else st.error)("\n\n".join(v.lines()))
    st.markdown(
        f"**Exported to** `{r.out_dir}` — {len(r.files)} files, {disk(r.total_bytes)}, {r.seconds:.1f} s, "
        f"peak RAM of this process {disk(r.peak_rss)}."
    )
    st.dataframe(pd.DataFrame([{"file": n, "size": disk(s)} for n, s in r.files]), hide_index=True)
    st.code(
        f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({r.out_dir!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({r.out_dir!r})",
        language="python",
    )


@st.cache_data(ttl=60, show_spinner="Checking that the adapter belongs to this base…")
def _mismatches(base_dir: str, adapter_dir: str) -> list[str]:
    try:
        return merge.mismatches(base_dir, adapter_dir)
    except merge.MergeError:
        return []  # it cannot be merged at all: Check and Merge say why


def merge_form(ws: Path, base_dir: str, adapter_dir: str, run: str | None) -> None:
    default_name = merge.suggest_export_name(run or Path(adapter_dir).name, ws)
    c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
    name = c1.text_input(
        "Export folder name (under exports/)", value=default_name, key=f"merge_name_{adapter_dir}"
    )
    dtype = c2.selectbox("Output dtype", ["same as base", "bf16", "fp16", "fp32"], key="merge_dtype")
    shard = c3.text_input("Max shard size", value="5GB", key="merge_shard")
    verify = c4.selectbox(
        "Verification",
        ["auto", "full", "quick"],
        key="merge_verify",
        help="full compares logits with base+adapter (needs RAM for one fp32 model); "
        "auto picks full when RAM allows.",
    )
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    device = st.radio("Compute the deltas on", devices, horizontal=True, key="merge_device")
    c1, c2 = st.columns([1, 3])
    then_gguf = c1.checkbox(
        "Then convert to GGUF", key="merge_then_gguf", help="For llama.cpp, Ollama, LM Studio."
    )
    gguf_type, gguf_missing = type_select(c2, "merge_gguf_type", disabled=not then_gguf)
    force = False
    mismatch = _mismatches(base_dir, adapter_dir)
    if mismatch:  # the only case 'Merge anyway' is for: offered once there is one, with what it overrides
        st.warning("This adapter may not belong to this base: " + "; ".join(mismatch) + ".")
        force = st.checkbox(
            "Merge anyway",
            key="merge_force",
            help="The check refuses by default: such a merge usually gives a broken model. Tick it only if you "
            "are sure this is the base the adapter was trained on.",
        )

    try:
        check_run_name(name)
        target = inside(ws, ws / "exports" / name.strip())
    except WorkspaceError as e:
        st.error(f"Export folder name: {e}".replace("Run name", "Name"))
        return
    st.caption(f"Target: {target} (written into a temporary folder beside it, renamed when verified)")
    dt = None if dtype == "same as base" else dtype
    pre_slot = st.empty()
    b1, b2 = st.columns(2)
    if b1.button("Check (preflight)", key="merge_check"):
        try:
            pf, _ = merge.preflight(base_dir, adapter_dir, target, dt, shard, verify, force, workspace=ws)
            show_preflight(pf, pre_slot)
            if pf.ok:
                st.success("Ready to merge.")
        except merge.MergeError as e:
            st.error(str(e))
    # this target's job; else this adapter's newest merge (after it finished, or a server restart, the default
    # target has moved on to the next free name)
    job = jobs.latest(ws, "merge", key=str(target)) or jobs.latest(ws, "merge", adapter=adapter_dir)
    running = job is not None and not job.done
    if b2.button("Merge and export", type="primary", key="merge_go", disabled=running):
        if then_gguf and gguf_missing:
            st.error(f"Not started: {gguf_missing}")
            return
        params = {
            "base": base_dir,
            "adapter": adapter_dir,
            "out": str(target),
            "dtype": dt,
            "shard": shard,
            "device": device,
            "verify": verify,
            "workspace": str(ws),
            "force": force,
        }
        if then_gguf:
            params["gguf"] = {"type": gguf_type, "verify": "auto"}
        try:
            jobs.start(ws, "merge", params, key=str(target))
        except jobs.JobError as e:
            st.error(str(e))
            return
        st.rerun()
    if job is not None:
        merge_job(job, pre_slot)


def merge_job(job, pre_slot) -> None:
    """The merge runs as its own process (core.jobs): a reload or another tab reattaches to it here."""
    if not job.done:

        def draw(view):
            p = view.progress
            if p.get("preflight"):  # drawn inside the fragment: it may not write to the page's own slots
                show_preflight(merge.Preflight(**p["preflight"]), st.empty())
            if p.get("step") == "gguf":
                gguf_progress(p)
                return
            total, done = p.get("total") or 0, p.get("done") or 0
            st.progress(min(1.0, done / total) if total else 0.0, text=merge.progress_sentence(p))
            st.caption(
                f"Running as a background job ({view.path.name}); reloading this page reattaches to it."
            )

        follow(lambda: jobs.read(job.path), draw)
        return
    if job.state == "failed":
        st.error(job.error or "The merge failed.")
        return
    result = _result_from_dict({k: v for k, v in (job.result or {}).items() if k != "gguf"})
    if result is not None:
        show_preflight(result.preflight, pre_slot)
        show_result(result)
    if (job.result or {}).get("gguf"):
        st.markdown("##### GGUF")
        show_gguf(job.result["gguf"])


def _result_from_dict(d: dict):
    try:
        return merge.MergeResult(
            **{
                **d,
                "preflight": merge.Preflight(**d["preflight"]),
                "verification": merge.Verification(**d["verification"]),
                "files": [tuple(f) for f in d["files"]],
            }
        )
    except (KeyError, TypeError):  # a result file from another version: say so instead of breaking the page
        st.warning("The last merge's result file could not be read; merge again to see its report.")
        return None


st.title("Merge & Export")
st.caption(
    "Merge a LoRA adapter into its base model shard by shard (RAM stays near one tensor plus the adapter), verify "
    "it against the adapter, and export a model that loads with plain transformers."
)
workspace = Path(st.session_state.get("workspace", str(default_workspace()))).expanduser()
adapter_dir, run, suggested = pick_adapter(workspace)
if adapter_dir:
    base_dir = base_input(adapter_dir, suggested)
    if base_dir:
        tab_try, tab_merge, tab_gguf = st.tabs(["Try it", "Merge & export", "GGUF"])
        with tab_try:
            try_it(base_dir, adapter_dir)
        with tab_merge:
            merge_form(workspace, base_dir, adapter_dir, run)
        with tab_gguf:
            gguf_tab(workspace)
