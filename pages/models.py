"""Models page: models and datasets from the Hugging Face Hub by id. Check what a download would fetch (only the
files training needs, against the free space), download it as a background job (a reload or a restarted server
reattaches; Cancel keeps what finished, the next download fetches the rest), and the cache with size, revision
and last use; delete a repo (never one a live run uses). UI only: core.hub does the work."""

import streamlit as st

from core import jobs
from core.fmt import nbytes
from core.hub import cache, fetch, rows
from core.hub.ids import HubError, cache_dir, describe, parse
from core.hub.live import remove
from core.workspace import default_workspace
from ui.hub_panels import cache_table, download_progress
from ui.jobs import follow
from ui.routing import leave_legacy_mode

leave_legacy_mode()


@st.cache_data(ttl=30, show_spinner="Asking the Hub…")
def _plan(text: str, kind: str, subset: str | None, split: str) -> dict:
    ref = parse(text, kind)
    found = fetch.facts(ref)
    files = rows.data_files(found, {"subset": subset, "split": split}) if kind == "dataset" else None
    plan = fetch.plan_download(ref, files, found)
    return {
        "summary": plan.summary(),
        "fits": plan.fits,
        "missing": len(plan.missing),
        "need": plan.missing_bytes,
    }


def download_form(ws: str) -> None:
    c1, c2 = st.columns([3, 1])
    text = c1.text_input("Hub id", key="hub_id", placeholder="ORG/NAME or ORG/NAME@REVISION").strip()
    kind = c2.radio("Kind", ["model", "dataset"], key="hub_kind", horizontal=True)
    subset, split = None, "train"
    if kind == "dataset":
        c1, c2 = st.columns(2)
        subset = c1.text_input("Subset (empty: the default)", key="hub_subset").strip() or None
        split = c2.text_input("Split", value="train", key="hub_split").strip() or "train"
    if not text:
        st.caption(
            "Only the files training needs are fetched: safetensors weights, config, tokenizer, chat template."
        )
        return
    ref = parse(text, kind)
    if ref is None:
        st.error(
            f"'{text}' is not a Hub id: give ORG/NAME, optionally @REVISION (a local folder needs no download)."
        )
        return
    try:
        plan = _plan(text, kind, subset, split)
    except HubError as exc:
        st.error(str(exc))
        return
    (st.caption if plan["fits"] else st.error)(
        plan["summary"] + ("" if plan["fits"] else f": does not fit ({fetch.KEEP_FREE_ENV} must stay free).")
    )
    key = f"{kind}:{ref}"
    busy = any(j.params.get("key") == key for j in jobs.running(ws, "hub"))
    if st.button(
        "Download", type="primary", disabled=busy or not plan["fits"] or not plan["missing"], key="hub_go"
    ):
        params = {"id": ref.repo_id, "revision": ref.revision, "type": ref.repo_type, "key": key}
        params.update({"subset": subset, "split": split} if kind == "dataset" else {})
        try:
            jobs.start(ws, "hub", params, key=key)
        except jobs.JobError as exc:
            st.error(str(exc))
            return
        st.rerun()
    if not plan["missing"]:
        st.success(f"{ref} is complete in the cache.")


def downloads(ws: str) -> None:
    active = jobs.running(ws, "hub")
    for job in active:
        c1, c2 = st.columns([5, 1], vertical_alignment="bottom")
        c1.markdown(f"**{job.params.get('id')}** ({job.params.get('type')}) · job {job.path.name}")
        if c2.button("Cancel", key=f"hub_cancel_{job.path.name}", icon=":material/cancel:"):
            jobs.cancel(job.path)
            st.rerun()
    if active:

        def draw(views) -> None:
            for view in views:
                if view.progress.get("bytes_total") is not None:
                    download_progress(view.progress)
                else:
                    st.caption(f"{view.params.get('id')}: listing its files…")

        follow(lambda: jobs.running(ws, "hub"), draw, done=lambda views: not views)
        return
    last = jobs.latest(ws, "hub")
    if last is None:
        return
    if last.state == "finished":
        st.success(f"Downloaded {(last.result or {}).get('label')} into {(last.result or {}).get('folder')}.")
    elif last.error == "cancelled":
        st.info(
            f"{last.params.get('id')}: cancelled. The complete files are kept; Download fetches the rest."
        )
    else:
        st.error(f"{last.params.get('id')}: {last.error}")


def cached(ws: str) -> None:
    try:
        repos = cache.list_cached()
    except HubError as exc:
        st.error(str(exc))
        return
    if not repos:
        st.caption(f"Nothing cached yet in {cache_dir()}.")
        return
    cache_table(repos)
    st.caption(f"{len(repos)} repo(s), {nbytes(sum(r.size_bytes for r in repos))} in {cache_dir()}")
    names = [f"{r.repo_type}:{r.repo_id}" for r in repos]
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    chosen = c1.selectbox("Delete from the cache", names, key="hub_delete_pick")
    if c2.button("Delete", key="hub_delete", icon=":material/delete:"):
        kind, repo_id = chosen.split(":", 1)
        try:
            freed = remove(ws, parse(repo_id, kind) or _ref(repo_id, kind))
        except HubError as exc:
            st.error(str(exc))
        else:
            st.session_state["hub_flash"] = f"Deleted {repo_id}: {nbytes(freed)} freed."
            st.rerun()


def _ref(repo_id: str, kind: str):
    from core.hub.ids import HubRef

    return HubRef(repo_id, None, kind)


st.title("Models")
st.caption(f"Models and datasets from the Hub at {describe()}, cached in {cache_dir()}.")
workspace = st.session_state.get("workspace") or str(default_workspace())
flash = st.session_state.pop("hub_flash", None)
if flash:
    st.success(flash)
st.subheader("Download")
download_form(workspace)
downloads(workspace)
st.subheader("Cached")
cached(workspace)
