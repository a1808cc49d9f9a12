"""A real Hub-protocol server on 127.0.0.1 for the tests: olah 0.5.4 (a self-hosted Hugging Face mirror) serving
local git repositories from its mirrors folder, offline (it never reaches huggingface.co).

Its known limits in that mode: repo info needs a revision (core.hub always names one), HTTP Range is ignored, and
a file a repo lacks reads as 401 'repository not found' (dataset repos here carry a README.md so that datasets'
probe for it finds one). Every test process gets its own HF_HOME: the user's cache is never touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIT = ["git", "-c", "user.email=tests@localhost", "-c", "user.name=tests", "-c", "init.defaultBranch=main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HubServer:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.mirrors = self.root / "mirrors"
        self.port = free_port()
        self.log = self.root / "olah.out"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- repos ----------------------------------------------------------------------------------------------

    def repo(self, repo_id: str, kind: str = "model") -> Path:
        return self.mirrors / ("datasets" if kind == "dataset" else "models") / repo_id

    def publish(self, repo_id: str, files: dict[str, bytes | str | Path], kind: str = "model") -> str:
        """Commit `files` (name -> bytes, text or a file to copy) to the repo's main branch; its new commit."""
        folder = self.repo(repo_id, kind)
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / ".git").exists():
            subprocess.run([*GIT, "init", "-q"], cwd=folder, check=True)
        for name, content in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copyfile(content, path)
            else:
                path.write_bytes(content if isinstance(content, bytes) else content.encode())
        subprocess.run([*GIT, "add", "-A"], cwd=folder, check=True)
        subprocess.run([*GIT, "commit", "-q", "-m", "publish"], cwd=folder, check=True)
        out = subprocess.run(
            [*GIT, "rev-parse", "HEAD"], cwd=folder, check=True, capture_output=True, text=True
        )
        return out.stdout.strip()

    def publish_folder(self, repo_id: str, folder: Path, kind: str = "model", **extra) -> str:
        files: dict = {p.name: p for p in Path(folder).iterdir() if p.is_file()}
        files.update(extra)
        return self.publish(repo_id, files, kind)

    # ---- the server -----------------------------------------------------------------------------------------

    def start(self) -> HubServer:
        config = self.root / "olah.toml"
        # metadata-cache-ttl 0: a branch moved by a test is seen at once (olah keeps it 600 s by default)
        config.write_text(
            "[basic]\n"
            'host = "127.0.0.1"\n'
            f"port = {self.port}\n"
            f'repos-path = "{self.root / "olah-repos"}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n'
            "metadata-cache-ttl = 0\n"
            'hf-scheme = "http"\n'
            'hf-netloc = "127.0.0.1:9"\n'  # never huggingface.co, even if offline mode were off
            'hf-lfs-netloc = "127.0.0.1:9"\n'
            "[accessibility]\n"
            "offline = true\n"
        )
        (self.root / "home").mkdir(parents=True, exist_ok=True)
        self.mirrors.mkdir(parents=True, exist_ok=True)
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))
        }  # its own huggingface_hub must not read ours
        env.update(HOME=str(self.root / "home"), PYTHONUNBUFFERED="1")  # its database: HOME/.olah
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "olah.server",
                    "-c",
                    str(config),
                    "--log-path",
                    str(self.root / "logs"),
                ],
                cwd=self.root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"olah did not listen on {self.port}: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def gets(self, repo_id: str, name: str, kind: str = "model") -> int:
        """How many times the server sent `name` of the repo (the access log's GETs of its resolve URL)."""
        prefix = f'"GET /{"datasets/" if kind == "dataset" else ""}{repo_id}/resolve/'
        return sum(
            1 for line in self.log.read_text().splitlines() if prefix in line and f"/{name} HTTP" in line
        )

    # ---- a client's environment -----------------------------------------------------------------------------

    def env(self, hf_home: Path, offline: bool = False, **extra) -> dict:
        """The environment of a CLI that uses this server (or, offline, only the cache at hf_home)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("HF_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
        }
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HOME=str(hf_home),
            HF_HUB_OFFLINE="1" if offline else "0",
            HF_DATASETS_OFFLINE="1" if offline else "0",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_DATASETS_CACHE=str(Path(hf_home) / "datasets"),
            **extra,
        )
        return env

    def run(self, args: list[str], hf_home: Path, offline: bool = False, timeout: float = 600, **extra):
        return subprocess.run(
            [sys.executable, *args],
            cwd=REPO,
            env=self.env(hf_home, offline, **extra),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
