"""The package (#41): a wheel built from this checkout, installed into a fresh virtualenv outside the repository
(torch and the other libraries already present: the venv sees the system's), then used from a temporary folder:
`lora-cockpit --version`, a tool's output, the demo and a dry-run of its config, and the app itself on a port,
rendered in a real browser and refusing a foreign Host header, as the repository's app does."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, exceptions_on, free_port, open_app

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The venv's bin folder, with the wheel of this checkout installed (built from a copy: nothing is written
    into the checkout)."""
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    )
    for name in filter(None, files.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    wheels = tmp / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
        ],
        check=True,
        capture_output=True,
    )
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    (wheel,) = wheels.glob("lora_cockpit-*.whl")
    # --ignore-installed: the venv sees the system's packages, and where the README's install put lora-cockpit
    # there (editable, pointing at whichever checkout ran it) pip would call this wheel installed already
    subprocess.run(
        [
            venv / "bin" / "python",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--ignore-installed",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import core; print(core.__file__)"],
        cwd=tmp,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), (
        f"the venv imports core from {where}, not from the wheel it installed"
    )
    return venv / "bin"


def _cli(bin_dir: Path, cwd: Path, *args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LORA_COCKPIT_WORKSPACE")}
    return subprocess.run(
        [str(bin_dir / "lora-cockpit"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_installed_command_runs_every_tool_from_anywhere(installed, tmp_path):
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = _cli(installed, tmp_path, "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"lora-cockpit {version}"
    helped = _cli(installed, tmp_path, "--help").stdout
    for tool in (
        "estimate",
        "train",
        "runs",
        "queue",
        "eval",
        "merge",
        "gguf",
        "demo",
        "preflight",
        "diagnose",
        "hub",
    ):
        assert f"\n  {tool} " in helped, tool
    listed = _cli(installed, tmp_path, "estimate", "--list-models")
    assert listed.returncode == 0 and "meta-llama/Llama-2-7b-hf" in listed.stdout  # the presets travel along
    wrong = _cli(installed, tmp_path, "nope")
    assert wrong.returncode == 2 and "has no tool 'nope'" in wrong.stderr
    demo = _cli(installed, tmp_path, "demo", "--out", str(tmp_path / "demo"), "--pretrain-steps", "20")
    assert demo.returncode == 0, demo.stderr[-2000:]
    planned = _cli(installed, tmp_path, "train", str(tmp_path / "demo" / "run.yaml"), "--dry-run")
    assert planned.returncode == 0 and '"verdict"' in planned.stdout, planned.stderr[-2000:]
    refused = _cli(installed, tmp_path, "train", str(tmp_path / "missing.yaml"), "--dry-run")
    assert (
        refused.returncode == 2 and "does not exist" in refused.stderr
    )  # the tool's own exit code and sentence
    assert not (tmp_path / "workspace").exists() or not any((tmp_path / "workspace").iterdir())


def _handshake(port: int, host: str) -> bytes:
    """The status line of a websocket handshake to the app's stream with this Host header."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            (
                f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: x3JJHMbDL1EzLkh9GBhXDw==\r\n\r\n"
            ).encode()
        )
        return s.recv(200).split(b"\r\n")[0]


@pytest.mark.e2e  # the installed app in headless Chromium
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Chromium at /usr/bin/chromium")
def test_the_installed_app_serves_its_pages_locally_and_refuses_a_foreign_host(installed, tmp_path):
    from playwright.sync_api import sync_playwright

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LORA_COCKPIT_WORKSPACE")}
    proc = subprocess.Popen(
        [str(installed / "lora-cockpit"), "--port", str(port), "--workspace", str(tmp_path / "ws")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        first = proc.stdout.readline()
        assert first.startswith("LoRA Cockpit ") and f"http://127.0.0.1:{port}" in first, first
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read()
                    == b"ok"
                ):
                    break
            except OSError:
                time.sleep(0.5)
        assert _handshake(port, f"127.0.0.1:{port}") == b"HTTP/1.1 101 Switching Protocols"
        assert _handshake(port, "evil.example") == b"HTTP/1.1 403 Forbidden"  # allowedHosts: no DNS rebinding
        with sync_playwright() as pw:
            browser, page = open_app(pw, f"http://127.0.0.1:{port}")
            try:
                page.get_by_role("heading", name="Estimate").first.wait_for(state="visible")
                assert not exceptions_on(page)
            finally:
                browser.close()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
