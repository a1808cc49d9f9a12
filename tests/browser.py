"""Real Streamlit server + headless Debian Chromium (Playwright) for the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def streamlit_server(workspace: Path, log_dir: Path, timeout: float = 60, env: dict | None = None):
    """Start `streamlit run dashboard.py` on a free loopback port; yield its base URL. `env`: extra variables
    for the server process (e.g. XDG_CACHE_HOME for a cache folder of its own)."""
    port = free_port()
    env = {**os.environ, "LORA_COCKPIT_WORKSPACE": str(workspace), "HF_HUB_OFFLINE": "1", **(env or {})}
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / "streamlit.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "dashboard.py", "--server.port", str(port),
         "--server.headless", "true", "--server.fileWatcherType", "none"],
        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    f"streamlit did not start: {(log_dir / 'streamlit.log').read_text()[-2000:]}"
                )
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


def wait_idle(page, timeout_ms: int = 60_000):
    """Wait until the app script has finished its run (Streamlit marks the app element)."""
    page.wait_for_selector('[data-test-script-state="notRunning"]', timeout=timeout_ms, state="attached")


def errors_on(page) -> list[str]:
    """The red st.error boxes on the page."""
    return [e.inner_text() for e in page.query_selector_all('[data-testid="stAlertContentError"]')]


def exceptions_on(page) -> list[str]:
    return [e.inner_text() for e in page.query_selector_all('[data-testid="stException"]')]


class Requests:
    """Every request a page makes, and those that failed: the app is used offline, so none may leave the server
    (a favicon or a font from a CDN fails there, and leaks that the app is open)."""

    def __init__(self, page, base_url: str):
        self.base, self.urls, self.failures = base_url, [], []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("requestfailed", lambda r: self.failures.append(f"{r.url} ({r.failure})"))

    def outside(self) -> list[str]:
        """Requests to anywhere but the app's own server (inline data: and blob: URLs are no requests)."""
        local = (self.base + "/", "data:", "blob:")
        return sorted({u for u in self.urls if not u.startswith(local) and u != self.base})

    def failed(self) -> list[str]:
        # a page left while its long-poll or a chart's data was in flight shows as net::ERR_ABORTED: that is the
        # browser cancelling, not a request that could not be served
        return [f for f in self.failures if "net::ERR_ABORTED" not in f]


def open_app(playwright, url: str):
    """(browser, page): headless Debian Chromium on the app's landing page, loaded and idle."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.set_default_timeout(60_000)
    page.goto(url + "/")
    wait_idle(page)
    return browser, page
