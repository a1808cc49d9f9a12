"""The package (#41): a wheel built from this checkout, installed into a fresh virtualenv outside the repository
(torch and the other libraries already present: the venv sees the system's), then used from a temporary folder:
`lora-cockpit --version`, a tool's output, the demo and a dry-run of its config, and the app itself on a port,
rendered in a real browser and refusing a foreign Host header, as the repository's app does. And every other way
of installing a wheel (#49 items 1 and 2: `pip install --target`, `--prefix`, `--user`; pipx and `uv tool install`
where they are installed): a working command from an empty folder, its workspace that folder's ./workspace, the
app's page served, and nothing written under the install prefix."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, exceptions_on, free_port, open_app

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


# what a caller's environment may hold that would point the installed command elsewhere
CALLER_ONLY = (
    "PYTHONPATH",
    "PYTHONUSERBASE",
    "LORA_COCKPIT_WORKSPACE",
    "LORA_COCKPIT_START_DIR",
    "LORA_COCKPIT_PROG",
)


def _env(**extra) -> dict:
    return {
        **{k: v for k, v in os.environ.items() if k not in CALLER_ONLY},
        **{k: str(v) for k, v in extra.items()},
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this checkout (built from a copy: nothing is written into the checkout)."""
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
    (built,) = wheels.glob("lora_cockpit-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The venv's bin folder, with the wheel of this checkout installed."""
    tmp = tmp_path_factory.mktemp("venv")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
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


def _wait_healthy(port: int, timeout_s: float) -> None:
    """Until the app's health endpoint answers ok (or the time is up: the checks after it then say what failed)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                return
        except OSError:
            pass
        time.sleep(0.5)


def _cli(bin_dir: Path, cwd: Path, *args, timeout=600):
    env = _env()
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
    env = _env()
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
        _wait_healthy(port, 90)
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


# ---- every way of installing the wheel (#49 items 1 and 2) ------------------------------------------------------

SCHEMES = ("target", "prefix", "user", "pipx", "uv")


def _install(scheme: str, wheel: Path, root: Path) -> tuple[Path, dict]:
    """Install `wheel` under `root` as `scheme` does: the `lora-cockpit` command and the environment a user of that
    scheme runs it with (--target and --prefix: PYTHONPATH at what pip wrote; --user: PYTHONUSERBASE)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed"]
    if scheme == "target":
        env, cmd = _env(PYTHONPATH=root), [*pip, "--target", str(root), str(wheel)]
    elif scheme == "prefix":
        site = sysconfig.get_path("purelib", "posix_prefix", vars={"base": str(root), "platbase": str(root)})
        env, cmd = _env(PYTHONPATH=site), [*pip, "--prefix", str(root), str(wheel)]
    elif scheme == "user":
        env, cmd = _env(PYTHONUSERBASE=root), [*pip, "--user", str(wheel)]
    elif (
        scheme == "pipx"
    ):  # its own venv; the libraries (torch, ...) from the system's, as the test venv does
        env = _env(PIPX_HOME=root / "home", PIPX_BIN_DIR=root / "bin", PIPX_MAN_DIR=root / "man")
        cmd = ["pipx", "install", "--system-site-packages", "--pip-args=--no-deps", str(wheel)]
    else:  # uv: its tool venv gets the dependencies from the index (no system packages there)
        env = _env(UV_TOOL_DIR=root / "tools", UV_TOOL_BIN_DIR=root / "bin")
        cmd = ["uv", "tool", "install", "--python", sys.executable, str(wheel)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "bin" / "lora-cockpit", env


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time, and every folder: what a write would change.
    Python's own bytecode cache is left out (an installer that does not compile, as pipx's, leaves Python to
    write __pycache__ on first import), and with it the folders' times, which its writes change."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) if p.is_file() else (0, 0)
        for p in root.rglob("*")
        if "__pycache__" not in p.parts
    }


def _page(port: int) -> dict:
    """The app's first screen as Streamlit's agent API renders it (the script run in a session, as a browser's)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/_stcore/agent/interact",
        data=b"{}",
        headers={"Content-Type": "application/json"},
    )
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_way_of_installing_gives_a_command_that_writes_only_where_it_starts(wheel, scheme, tmp_path):
    if scheme in ("pipx", "uv") and not shutil.which(scheme):
        pytest.skip(f"{scheme} is not installed on this machine")
    root, empty = tmp_path / "prefix", tmp_path / "empty"
    empty.mkdir()
    command, env = _install(scheme, wheel, root)
    # the interpreter the script runs (pipx's shebang adds -E)
    python = command.read_text().splitlines()[0].removeprefix("#!").split()[0]
    found = subprocess.run(
        [python, "-c", "import core, lora_cockpit.cli as c; print(core.__file__); print(c.app_dir())"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(f).is_relative_to(root) for f in found), f"{scheme}: imports from {found}, not {root}"
    before = _listing(root)

    def run(*args):
        return subprocess.run(
            [command, *args], cwd=empty, env=env, capture_output=True, text=True, timeout=300
        )

    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("lora-cockpit "), version.stderr
    listed = run("runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == f"no runs in {empty / 'workspace' / 'runs'}"

    port = free_port()
    proc = subprocess.Popen(
        [command, "--port", str(port)],
        cwd=empty,
        env={**env, "STREAMLIT_SERVER_ENABLE_AGENT_API": "true"},  # the page's contents over HTTP, no browser
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        first = proc.stdout.readline()
        assert f"(workspace {empty / 'workspace'})" in first, first
        _wait_healthy(port, 120)
        page = _page(port)
        assert page["status"] == "ready" and page["page"]["title"] == "Estimate", page.get("status")
        tree = json.dumps(page["tree"])
        assert '"type": "exception"' not in tree, tree[:3000]
        assert f"Writes under {empty / 'workspace'}." in tree  # the first screen says where it writes
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
    after = _listing(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], f"{scheme}: written under the install prefix {root}: {changed[:20]}"
