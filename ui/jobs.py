"""The one fragment that follows a background process (a core.jobs job, a smoke test) from its files."""

from collections.abc import Callable
from typing import Any

import streamlit as st


def follow(
    read: Callable[[], Any],
    draw: Callable[[Any], None],
    done: Callable[[Any], bool] = lambda view: view is None or view.done,
    every: float = 1.0,
) -> None:
    """Redraw what `read()` says of a running process every `every` seconds, with `draw(view)`; once `done(view)`,
    rerun the whole page once so that it draws the result statically. A reload, another tab or a restarted server
    reattaches the same way: the process's state is in its files, not in this session."""

    @st.fragment(run_every=every)
    def _follow():
        view = read()
        if done(view):
            st.rerun()
        draw(view)

    _follow()
