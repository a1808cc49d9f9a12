"""Preflight: check the model folder and the data against the tokenizer and the model config before any GPU work.

Loads only the tokenizer and the model's config (the weights' headers are read, no weights), so it takes seconds
and can run from the UI. The
run's method (core.train.methods) supplies its data checks; each finding names the rows (counted from 1) and the
fix.

CLI: python -m core.preflight run.yaml   (exit 2 when the data has an error)
"""

from __future__ import annotations

import sys

from core.train import methods
from core.train.config import ConfigError, load_config
from core.train.data import DataError
from core.train.findings import (  # noqa: F401  (the names callers take from here)
    Finding,
    TokenizerError,
    check_model_folder,
    format_rows,
    has_errors,
    load_tokenizer_and_config,
    model_limits,
)
from core.train.weights import weights_problem


def check_model(path) -> str | None:
    """What a launch checks of the model folder before loading anything: the folder (check_model_folder), then its
    weights' shapes and sizes against config.json (core.train.weights). None when the model can be loaded."""
    return check_model_folder(path) or weights_problem(path)


def run_preflight(cfg: dict, tokenizer=None, model_config=None, in_trainer: bool = False) -> list[Finding]:
    """All findings for a validated run config, by its method; an empty list means the data is ready.
    in_trainer: the trainer process asks (a GRPO run's own reward code is tried there, never in the app)."""
    return methods.get(cfg).preflight(cfg, tokenizer, model_config, in_trainer)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m core.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="run config YAML")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        problem = check_model(cfg["model"]["path"])
        if problem:
            raise ConfigError(problem)
        findings = run_preflight(cfg)
    except (ConfigError, DataError, OSError, ValueError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: {text}", file=sys.stderr)
        return 2
    for f in findings:
        print(f, file=sys.stderr if f.level == "error" else sys.stdout)
    if not findings:
        print("preflight: no problems found")
    return 2 if has_errors(findings) else 0


if __name__ == "__main__":
    sys.exit(main())
