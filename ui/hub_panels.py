"""Hub panels: a download's progress (the Models page's jobs, a run fetching its model on the Monitor), the
cache table and the endpoint line of the sidebar. UI only: the facts come from core.hub."""

from datetime import datetime

import pandas as pd
import streamlit as st

from core.fmt import nbytes
from core.hub import ids as hub_ids
from core.hub.fetch import progress_line
from core.train.sources import download_line, read_download


def endpoint_caption() -> None:
    """The sidebar's line: which Hub (HF_ENDPOINT) this server and its runs use, and whether offline."""
    st.markdown("### Hugging Face Hub")
    st.caption(hub_ids.describe())


def download_progress(p: dict, label: str | None = None) -> None:
    """One download's bar: bytes, files, rate and time left."""
    total = p.get("bytes_total") or 0
    share = min(1.0, (p.get("bytes_done") or 0) / total) if total else 0.0
    st.progress(share, text=label or f"{p.get('repo')} @ {str(p.get('commit'))[:7]}: {progress_line(p)}")


def run_download(run_dir: str, state: str) -> None:
    """On the Monitor: the Hub download a starting run is doing before it trains."""
    p = read_download(run_dir)
    if not p or state != "starting" or p.get("final"):
        return
    download_progress(p, download_line(p))


def cache_table(repos) -> None:
    rows = [
        {
            "id": r.repo_id,
            "type": r.repo_type,
            "revisions": ", ".join(
                ("/".join(v.refs) + " " if v.refs else "")
                + "@ "
                + v.commit[:7]
                + ("" if v.complete else " (partial)")
                for v in r.revisions
            ),
            "size": nbytes(r.size_bytes),
            "last used": datetime.fromtimestamp(r.last_used).strftime("%Y-%m-%d %H:%M"),
        }
        for r in repos
    ]
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
