"""Running the engine as a user does from a terminal: `python -m core.train` in its own process."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train(cfg: dict, run_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Write `cfg` as run_dir/config.yaml and train it: `python -m core.train CONFIG --run-dir RUN_DIR`."""
    from core.runs import rundir
    from core.train.config import dump_config

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
