"""`lora-cockpit`: the app and every tool under one command.

lora-cockpit [app] [--port 8501] [--workspace DIR]    the app on 127.0.0.1, from any folder
lora-cockpit TOOL ARGS...                             a tool: the same flags, output and exit codes as
                                                      `python -m core.TOOL ARGS...`
lora-cockpit --version | --help

The app and every tool work in the folder they were started in: the workspace is --workspace, else
$LORA_COCKPIT_WORKSPACE, else ./workspace there, and relative paths typed in the app start there too.
"""

from __future__ import annotations

import os
import runpy
import sys
from importlib import resources
from pathlib import Path

from core.fmt import PROG_ENV
from core.procs import START_ENV
from core.workspace import ENV_VAR, default_workspace
from lora_cockpit import __version__

# tool -> (the module `python -m` runs, the arguments put before the user's, one line of help)
TOOLS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "estimate": ("core.estimate", (), "the memory bill of a training run, term by term, with a fit verdict"),
    "train": (
        "core.train",
        (),
        "train a run config into a run folder (--dry-run: check it and print its plan)",
    ),
    "preflight": ("core.preflight", (), "check a run config's data against its model before training"),
    "runs": ("core.runs", (), "list, show, launch, stop, resume and delete runs"),
    "queue": ("core.runs", ("queue",), "the run queue and sweeps: add, list, rm, move, resume"),
    "eval": ("core.eval", (), "the base model against the tuned one on held-out rows"),
    "merge": ("core.merge", (), "merge an adapter into its base model, streamed and verified"),
    "gguf": ("core.gguf", (), "convert a model folder to GGUF for llama.cpp / Ollama"),
    "demo": (
        "core.demo",
        (),
        "build the tiny local demo (and train it: --run, --run-dpo, --run-kto, --run-grpo)",
    ),
    "diagnose": ("core.diagnose", (), "why a run failed, and what to change"),
    "hub": ("core.hub", (), "Hugging Face Hub models and datasets: info, download, list, rm"),
    "doctor": ("core.doctor", (), "what this machine can train with, and what to fix (--json for scripts)"),
}
APP_FLAGS = (
    # what the app's .streamlit/config.toml says (Streamlit reads the one beside dashboard.py), on the command line
    # too: the app stays local whatever a config.toml in the start folder or ~/.streamlit says
    "--server.address=127.0.0.1",
    "--server.headless=true",
    "--server.fileWatcherType=none",
    "--server.enableXsrfProtection=true",
    "--runner.postScriptGC=false",
    "--browser.gatherUsageStats=false",
)


def app_dir() -> Path:
    """The folder holding dashboard.py, pages/ and .streamlit/config.toml: lora_cockpit/app inside the installed
    package (package data, copied there by setup.py's build: found wherever pip, pipx or uv put the package), else
    the checkout this package sits in (an editable install, or a checkout on the path)."""
    packaged = resources.files("lora_cockpit") / "app"
    for folder in (Path(str(packaged)), Path(__file__).resolve().parents[1]):
        if (folder / "dashboard.py").is_file() and (folder / "pages").is_dir():
            return folder
    raise SystemExit("error: the app's files (dashboard.py, pages/) are not installed with this package.")


def usage() -> str:
    width = max(map(len, TOOLS))
    tools = "\n".join(f"  {name:<{width}}  {line}" for name, (_, _, line) in TOOLS.items())
    return (
        "usage: lora-cockpit [app] [--port PORT] [--workspace DIR]\n"
        "       lora-cockpit TOOL [ARGS...]   (TOOL --help for its flags)\n\n"
        f"Plan, launch, watch, evaluate, merge and export LoRA fine-tunes (version {__version__}).\n\n"
        f"tools:\n{tools}\n"
    )


def run_app(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="lora-cockpit app", description="Start the app on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=8501, help="the port to listen on (default 8501)")
    parser.add_argument(
        "--workspace",
        help="the folder for runs, demo assets and exports (default: $LORA_COCKPIT_WORKSPACE, else ./workspace "
        "of the folder it starts in)",
    )
    args = parser.parse_args(argv)
    workspace = default_workspace(args.workspace)
    os.environ[ENV_VAR] = str(workspace)  # the app's sidebar starts from it
    folder = app_dir()
    # No chdir into `folder`: the app works in the start folder (a relative data path typed there is found there);
    # Streamlit reads the config.toml beside dashboard.py wherever it runs from
    print(f"LoRA Cockpit {__version__}: http://127.0.0.1:{args.port} (workspace {workspace})", flush=True)
    from streamlit.web import cli as streamlit_cli

    sys.argv = ["streamlit", "run", str(folder / "dashboard.py"), f"--server.port={args.port}", *APP_FLAGS]
    return streamlit_cli.main()


def run_tool(name: str, argv: list[str]) -> int:
    """`python -m core.<tool> argv` in this process: the tool's own parser, output and exit code."""
    module, before, _ = TOOLS[name]
    sys.argv = [f"lora-cockpit {name}", *before, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # for the tools, the app and what they start: usage lines and hints say `lora-cockpit runs ...`
    # (core.fmt.command), and relative paths start in this folder (core.procs.START_ENV)
    os.environ[PROG_ENV] = "lora-cockpit"
    os.environ[START_ENV] = os.getcwd()
    if argv[:1] in (["--version"], ["-V"]):
        print(f"lora-cockpit {__version__}")
        return 0
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if not argv or argv[0] == "app" or argv[0].startswith("--"):
        return run_app(argv[1:] if argv and argv[0] == "app" else argv)
    if argv[0] in TOOLS:
        return run_tool(argv[0], argv[1:])
    print(f"error: lora-cockpit has no tool {argv[0]!r}.\n\n{usage()}", file=sys.stderr)
    return 2
