"""Running the engine as a user does from a terminal: `python -m core.train` in its own process; and a CLI's
`main(argv)` called in this process (`in_process`), for error-path checks that need no process of their own."""

import contextlib
import io
import signal
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train(cfg: dict, run_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Write `cfg` as run_dir/config.yaml and train it: `python -m core.train CONFIG --run-dir RUN_DIR`."""
    from core import rundir
    from core.recipe.config import dump_config

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = dump_config(cfg, run_dir / rundir.CONFIG)
    return subprocess.run(
        [sys.executable, "-m", "core.train", str(cfg_path), "--run-dir", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def runs(workspace: Path, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m core.runs ARGS` with `workspace` as the workspace, as a user runs it from a terminal."""
    import os

    env = dict(os.environ, LORA_COCKPIT_WORKSPACE=str(workspace))
    return subprocess.run(
        [sys.executable, "-m", "core.runs", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_process(main, *args) -> subprocess.CompletedProcess:
    """`main(argv)` of a CLI (python -m core.X), called here instead of in a new interpreter: a subprocess pays ~9 s
    of transformers import, this call none after the first. What it printed and its exit code come back as from
    subprocess.run: argparse's SystemExit gives its code; any other exception propagates and fails the test (where
    a subprocess check asserted "no Traceback on stderr"). For error paths: each CLI keeps one real subprocess test
    (the interpreter, `-m`, the exit status). Global state a CLI sets for its own process (warning filters,
    transformers' verbosity and progress bars, SIGTERM and SIGINT handlers) is put back afterwards."""
    out, err = io.StringIO(), io.StringIO()
    hf_logging = sys.modules.get("transformers.utils.logging")
    verbosity = hf_logging.get_verbosity() if hf_logging else None
    bars = hf_logging.is_progress_bar_enabled() if hf_logging else None
    argv = [str(a) for a in args]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:
                if isinstance(exc.code, str):  # sys.exit("message"): printed, exit 1, as the interpreter does
                    print(exc.code, file=sys.stderr)
                    code = 1
                else:
                    code = exc.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        hf_logging = sys.modules.get("transformers.utils.logging")
        if hf_logging is not None:
            hf_logging.set_verbosity(
                verbosity if verbosity is not None else hf_logging._get_default_logging_level()
            )
            if bars is False:
                hf_logging.disable_progress_bar()
            else:
                hf_logging.enable_progress_bar()
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())
