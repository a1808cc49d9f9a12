"""`python -m core.jobs FOLDER`: run the job described in FOLDER/job.json (started by core.jobs.start).

Holds the folder's lock for its life; writes progress.json while it works and result.json at the end:
{"state": "finished", "result": ...} or {"state": "failed", "error": "one sentence"}.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

from core import procs
from core.demo.build import PRETRAIN_STEPS, DemoError, build_demo, read_manifest, write_run_config
from core.files import read_json_object
from core.gguf import BadInput, ExportError, export_gguf
from core.jobs import JOB, Progress, _write_result
from core.recipe.config import validate_config
from core.recipe.data import DataError
from core.train.preflight import load_tokenizer_and_config, run_preflight
from core.workspace import WorkspaceError


def run_merge(p: dict, report: Progress) -> dict:
    from core import merge

    def progress(mp) -> None:
        report(
            phase=mp.phase,
            done=mp.tensors_done,
            total=mp.tensors_total,
            bytes_done=mp.bytes_written,
            bytes_total=mp.bytes_total,
        )

    result = merge.merge(
        p["base"],
        p["adapter"],
        p["out"],
        p.get("dtype"),
        p.get("shard", "5GB"),
        p.get("device", "cpu"),
        p.get("verify", "auto"),
        workspace=p["workspace"],
        progress=progress,
        on_preflight=lambda pf: report(phase="preflight", preflight=asdict(pf), final=True),
        force=bool(p.get("force")),
    )
    out = result.to_dict()
    if p.get("gguf"):  # merge, then GGUF: one click from an adapter
        g = p["gguf"]
        target = Path(p["out"])
        out["gguf"] = run_gguf(
            {"model": result.out_dir, "out": str(target.with_name(f"{target.name}-{g['type']}.gguf")), **g},
            report,
        )
    return out


def run_demo(p: dict, report: Progress) -> dict:

    lines: list[str] = []

    def log(*parts) -> None:
        lines.append(" ".join(str(x) for x in parts))
        report(phase="build", log=lines[-20:])

    out = build_demo(p["out"], pretrain_steps=p.get("pretrain_steps", PRETRAIN_STEPS), log=log)
    run_yaml = write_run_config(out)  # as the CLI's build: the run is one command away
    log(f"demo run config: {run_yaml}")
    return {"out": str(out), "manifest": read_manifest(out), "run_config": str(run_yaml)}


def run_preflight_job(p: dict, report: Progress) -> dict:

    cfg = validate_config(p["config"])
    report(phase="loading the tokenizer")
    tok, conf = load_tokenizer_and_config(cfg["model"])
    report(phase="checking every row")
    return {"findings": [f.__dict__ for f in run_preflight(cfg, tok, conf)]}


def run_gguf(p: dict, report: Progress) -> dict:

    result = export_gguf(
        p["model"],
        p["out"],
        p.get("type", "f16"),
        p.get("verify", "auto"),
        on_progress=lambda d: report(**{**d, "step": "gguf"}),
    )
    return result.to_dict()


def run_eval(p: dict, report: Progress) -> dict:
    from core.eval.heldout import PAGE_DATA
    from core.eval.run import evaluate

    # the Evaluate page's job: its messages name the page's field, not the CLI's --data
    result = evaluate(
        p.get("run"), **{k: v for k, v in p.items() if k != "run"}, progress=report, asked=PAGE_DATA
    )
    return {"folder": str(result.folder), "lines": result.lines, "reused": result.reused, "note": result.note}


def run_warm_start(p: dict, report: Progress) -> dict:
    """The GRPO demo's start model (core.demo.grpo.warm_base): a few steps of the demo run, merged; once."""
    from core.demo.grpo import WARM_BAND, WARM_STEPS, warm_base

    low, high = WARM_BAND
    report(
        phase=f"training the demo run up to {WARM_STEPS} steps, taking the first right on {low:.0%}-{high:.0%} of "
        "the held-out words, then merging it into the demo model"
    )
    return {"model": str(warm_base(p["out"]))}


def run_hub(p: dict, report: Progress) -> dict:
    from core.hub import fetch, rows
    from core.hub.ids import HubRef

    last: dict = {}

    def progress(d: dict) -> None:
        last.update(d)
        report(**d)

    ref = HubRef(p["id"], p.get("revision"), p.get("type", "model"))
    if ref.repo_type == "dataset":
        folder, found = rows.fetch(ref, {"subset": p.get("subset"), "split": p.get("split")}, progress)
        label = found.label()
    else:
        folder = fetch.download(ref, progress)
        label = f"{ref.repo_id} @ {folder.name[:7]}"
    return {"folder": str(folder), "label": label, "progress": last}  # the last report: bytes, files, rate


RUNNERS = {
    "hub": run_hub,
    "merge": run_merge,
    "demo": run_demo,
    "preflight": run_preflight_job,
    "gguf": run_gguf,
    "eval": run_eval,
    "warm_start": run_warm_start,
}


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that carry a sentence for the user (anything else is a bug: traceback in stderr.log)."""
    from core.eval.heldout import EvalError
    from core.merge import MergeError

    return (
        ValueError,
        EvalError,
        OSError,
        MergeError,
        DemoError,
        DataError,
        BadInput,
        ExportError,
        WorkspaceError,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m core.jobs FOLDER\n\nRun the background job described in FOLDER/job.json (the pages and\ncore.jobs.start write that folder; you rarely start this yourself)."
    if args in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    folder = Path(args[0]).resolve()
    procs.enter_start_folder()  # a path typed in the app, relative: from the folder the app was started in
    job = read_json_object(folder / JOB)
    if not job or job.get("kind") not in RUNNERS:
        print(f"error: {folder / JOB} is missing or names no known job kind.", file=sys.stderr)
        return 2
    lock = procs.adopt_claim() or procs.claim(folder)  # noqa: F841 - held until this process exits
    report = Progress(folder)
    try:
        result = RUNNERS[job["kind"]](job.get("params") or {}, report)
    except _user_errors() as exc:
        _write_result(folder, {"state": "failed", "error": str(exc).strip() or type(exc).__name__})
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:
        traceback.print_exc()
        _write_result(folder, {"state": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    report(phase="done", final=True)
    _write_result(folder, {"state": "finished", "result": result})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the lock goes with the process, the moment the result is written
