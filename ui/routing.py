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


def follow_choice(paths: list[str], chosen: str, widget: str, chosen_for: str) -> None:
    """Make the selectbox `widget` follow a run chosen on another page (st.session_state[chosen]; the newest,
    paths[0], when none is): set once per choice, so a pick made on this page stays until another page chooses."""
    wanted = st.session_state.get(chosen)
    if wanted not in paths:
        wanted = paths[0]  # newest
    if st.session_state.get(widget) not in paths or st.session_state.get(chosen_for) != wanted:
        st.session_state[widget] = wanted
        st.session_state[chosen_for] = wanted
