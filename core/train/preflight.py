"""Preflight: check the model folder and the data against the tokenizer and the model config before any GPU work.

Loads only the tokenizer and the model's config (the weights' headers are read, no weights), so it takes seconds
and can run from the UI. The
run's method (core.recipe.methods) supplies its data checks; each finding names the rows (counted from 1) and the
fix.

CLI: python -m core.preflight run.yaml   (exit 2 when the data has an error)
"""

from __future__ import annotations

import sys

from core.files import quiet_datasets
from core.fmt import command, error_line, summary
from core.hub.fetch import readable
from core.recipe import methods, mix, mix_config, vision
from core.recipe.config import ConfigError, check_with_libraries, load_config
from core.recipe.data import DataError
from core.recipe.engine_args import lora_dropout_problem
from core.recipe.findings import (  # noqa: F401  (the names callers take from here)
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
    method = methods.get(cfg)
    if mix_config.sources(cfg["data"]):  # several sources: each read and checked, named in each finding
        return mix.findings(cfg, method, tokenizer, model_config, in_trainer)
    return method.preflight(cfg, tokenizer, model_config, in_trainer)


def refuse_on_errors(findings: list[Finding], file=None) -> None:
    """Print every finding but the first error (to `file`, default stdout), and raise that error as DataError: one
    sentence, printed once by whoever catches it."""
    first = next((f for f in findings if f.level == "error"), None)
    for f in findings:
        if f is not first:
            print(f"preflight: {f}", file=file, flush=True)
    if first is not None:
        raise DataError(f"preflight: {first}")


def prepare_run(
    cfg: dict, device=None, smoke: bool = False, datasets: bool = True, file=None, in_trainer: bool = False
):
    """(tokenizer, train, eval, drawn): what a run trains on (drawn: what a mix of data.sources drew, for
    RUN/mix.json; None for one data.path), made before the run writes anything or loads a weight, so
    that bad input is refused with nothing left behind. The tokenizer and the model's config (no weights), the
    data preflight (refuse_on_errors), the method's datasets (their own refusals: a row left with nothing to
    learn), then the libraries' objects built as the run builds them on `device` (a core.precision.Device; None:
    the config's own flags) with or without a held-out split (check_with_libraries). datasets=False (a
    supervisor whose ranks make their own): the checks alone, (tokenizer, None, None, None). in_trainer: the trainer
    process asks (a GRPO run's own reward code runs in its preflight). Raises ConfigError or DataError, one
    sentence each."""
    from core.precision import PrecisionError, resolve

    m = cfg["model"]
    try:
        prec = resolve(cfg, device) if device is not None else None
    except PrecisionError as exc:
        raise ConfigError(str(exc)) from None
    try:
        tokenizer, model_config = load_tokenizer_and_config(m)
    except TokenizerError as exc:  # names the damaged file
        raise ConfigError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.path: the tokenizer or config.json in {m['path']} does not load ({error_line(exc)})."
        ) from None
    problem = lora_dropout_problem(cfg, model_config)
    if problem:
        raise ConfigError(problem)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss anyway
    if vision.is_vlm(model_config):  # a VLM's processing class is its processor (images + text)
        try:
            tokenizer = vision.load_processor(
                readable(m["path"]), m["trust_remote_code"], cfg["data"].get("max_pixels")
            )
        except DataError as exc:
            raise ConfigError(str(exc)) from None
    refuse_on_errors(run_preflight(cfg, tokenizer, model_config, in_trainer), file)
    train_ds = eval_ds = drawn = None
    if datasets:
        with quiet_datasets():  # no progress bars over the sentence that may follow
            if mix_config.sources(cfg["data"]):
                train_ds, eval_ds, drawn = mix.draw(cfg, tokenizer, methods.get(cfg))
            else:
                train_ds, eval_ds = methods.get(cfg).datasets(cfg, tokenizer)
    # without the datasets, a held-out split is what the config asks for (split_eval needs 4 rows, ranks have them)
    has_eval = eval_ds is not None if datasets else cfg["data"]["eval_split"] > 0
    check_with_libraries(cfg, has_eval=has_eval, smoke=smoke, prec=prec)
    if smoke and eval_ds is not None:  # a smoke test evaluates one eval batch of them (the plan's)
        method = methods.get(cfg)
        eval_ds = eval_ds.select(
            range(min(len(eval_ds), method.eval_rows(cfg, method.smoke_eval_batch(cfg))))
        )
    return tokenizer, train_ds, eval_ds, drawn


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=command("preflight"), description=summary(__doc__))
    parser.add_argument("config", help="run config YAML")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        problem = check_model(cfg["model"]["path"])
        if problem:
            raise ConfigError(problem)
        findings = run_preflight(cfg)
    except (ConfigError, DataError) as exc:  # our own sentence, whole (on one line)
        print(f"error: {error_line(exc, 2000)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # a library's, on one line
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 2
    for f in findings:
        print(f, file=sys.stderr if f.level == "error" else sys.stdout)
    if not findings:
        print("preflight: no problems found")
    return 2 if has_errors(findings) else 0


if __name__ == "__main__":
    sys.exit(main())
