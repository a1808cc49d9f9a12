"""A run on a SLURM cluster: `python -m core.runs export NAME --slurm` writes `<run>/slurm.sbatch`.

Plain sbatch + srun, nothing to install: one task per machine, each starting the run's own supervisor
(`python -m core.train … --machine-rank $SLURM_NODEID --main-process-ip <first node>`), which starts that
machine's ranks through accelerate with the run's accelerate config — so a cluster run follows the same rules as
one on a workstation (the lock, the stop that checkpoints, a dead rank failing the run, resume with the same
world size). The run directory must be on storage every node sees (the Monitor follows it there). SkyPilot or
submitit would add a dependency and a second launcher for what one sbatch file says.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from core import rundir
from core.files import atomic_write_text
from core.recipe import distributed

SCRIPT = "slurm.sbatch"
REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_BEFORE_LIMIT_S = 300  # SIGTERM this long before the time limit: the ranks save a checkpoint and stop


def slurm_script(run_dir: Path, cfg: dict, python: str = sys.executable) -> str:
    """The sbatch script for the run in `run_dir` (its validated config `cfg`)."""
    run_dir = Path(run_dir).resolve()
    d = cfg["distributed"]
    q = shlex.quote
    config = run_dir / rundir.CONFIG
    train = (
        f"exec {q(python)} -m core.train {q(str(config))} --run-dir {q(str(run_dir))} "
        '--machine-rank "$SLURM_NODEID" --main-process-ip "$MAIN" $RESUME'
    )
    return "\n".join(
        [
            "#!/bin/bash",
            f"# Run {run_dir.name} on {d['num_machines']} machine(s) x {distributed.gpus_per_machine(cfg)} GPU(s):",
            "# written by `python -m core.runs export NAME --slurm`; submit with `sbatch` from any node. One task per",
            "# machine starts the run's supervisor, which starts that machine's ranks (accelerate launch).",
            f"#SBATCH --job-name=lora-{re.sub(r'[^A-Za-z0-9_.-]+', '-', run_dir.name)[:40]}",
            f"#SBATCH --nodes={d['num_machines']}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={distributed.gpus_per_machine(cfg)}",
            f'#SBATCH --output="{run_dir}/slurm-%j.log"',
            f"#SBATCH --signal=TERM@{STOP_BEFORE_LIMIT_S}",
            "set -euo pipefail",
            f"cd {q(str(REPO_ROOT))}",
            'MAIN=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "RESUME=",
            f"if compgen -G {q(str(run_dir / rundir.CHECKPOINTS))}'/checkpoint-*' > /dev/null; then RESUME=--resume; fi",
            "export MAIN RESUME",
            "srun --kill-on-bad-exit=1 bash -c " + q(train),
            "",
        ]
    )


def export_slurm(run_dir: Path, cfg: dict) -> Path:
    """Write the script beside the run; one already there (perhaps edited) is kept and the next free name taken."""
    run_dir = Path(run_dir)
    path, n = run_dir / SCRIPT, 2
    while path.exists():
        path, n = run_dir / f"slurm-{n}.sbatch", n + 1
    try:
        atomic_write_text(path, slurm_script(run_dir, cfg), parents=False)
        path.chmod(0o755)
    except OSError as exc:
        raise OSError(f"Cannot write {path} ({exc.strerror or exc}): make the run folder writable.") from None
    return path
