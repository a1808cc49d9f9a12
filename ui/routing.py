"""The guard every page calls first."""

import streamlit as st
from streamlit.runtime.pages_manager import PagesManager


def leave_legacy_mode() -> None:
    """A session whose first request is a page's URL, before the router ever ran in this server process: Streamlit
    is still in its legacy pages/ mode and ran that file alone (no sidebar, no workspace). Leave that mode for good
    and rerun through dashboard.py (a first run has no widget events to lose)."""
    if PagesManager.uses_pages_directory and not st.session_state.get("_routed"):
        PagesManager.uses_pages_directory = False
        st.rerun()
