"""GPU truth in one prepared script: the planner and the monitor measured on a real CUDA card.

    python benchmarks/gpu_truth.py --out DIR            # on a machine with a CUDA GPU (<= ~8 minutes)
    python benchmarks/gpu_truth.py --out DIR --dry-run  # the same code paths on the CPU, smallest sizes (CI)
    python benchmarks/gpu_truth.py --quick              # --dry-run into a temporary folder, goal not judged

`--quick` is the dry run (tests/test_gpu_truth.py runs it as --dry-run, goal judged), with a goal miss not failing
it: headline printed, exit 0 unless something fails to run.

1. Planner vs CUDA: real widths at reduced depth (the planner is given the same reduced config), LoRA, QLoRA,
   full, with and without checkpointing, the engine's path and the HF-default one: torch's max_memory_allocated
   vs the tensor peak, max_memory_reserved vs the reserved peak, NVML's used memory vs the device total.
2. A real run through the product: the demo trained by the launcher (bf16; and QLoRA), gpu.jsonl samples, the
   Monitor's memory frames and plan line, the smoke test's measured peak next to the estimate.
3. Failure paths: an OOM forced with set_per_process_memory_fraction is diagnosed as OOM; expandable_segments
   changes the reserved peak the way the planner says.
4. The merge with --device cuda, verified.
5. Several GPUs (only where two or more are visible): the demo through the launcher on 2 GPUs with DDP and with
   FSDP (accelerate launch from the run's accelerate.yaml): finished, every rank's record and memory, the loss
   against the one-GPU run; then benchmarks/multi_gpu_truth.py (per-rank peaks against the per-GPU plan).
Writes DIR/gpu_truth.json (figures, device, driver, versions); the headline is the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GOAL_MEDIAN, GOAL_WORST = 0.03, 0.07
MiB = 2**20


def versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def device_info(cuda: bool) -> dict:
    import torch

    if not cuda:
        return {"device": "cpu"}
    from core import gpu

    gpus, why = gpu.detect_gpus()
    return {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "cuda": torch.version.cuda,
        "nvml": [g.__dict__ for g in gpus] if gpus else why,
    }


# ---- 1. planner vs measurement ---------------------------------------------------------------------------------


def matrix(dry: bool):
    """(name, transformers config, Plan) rows (the device set by measure_row)."""
    from estimator_accuracy import full_config

    from core.demo.toy import tiny_config
    from core.measure.build import with_layers
    from core.measure.step_plan import step_plan

    if dry:
        cfg = tiny_config("llama")
        s = dict(batch_size=2, seq_len=64)
        return [
            (
                "tiny lora",
                cfg,
                step_plan("lora", load_dtype="fp32", compute_dtype="fp32", autocast=False, **s),
            ),
            (
                "tiny qlora gc",
                cfg,
                step_plan(
                    "qlora",
                    load_dtype="fp32",
                    compute_dtype="fp32",
                    autocast=False,
                    gradient_checkpointing=True,
                    **s,
                ),
            ),
            # the GPU rows' paths (offloading is left out on a CPU, as the planner plans it)
            (
                "tiny lora gc offloading",
                cfg,
                step_plan(
                    "lora",
                    load_dtype="fp32",
                    compute_dtype="fp32",
                    autocast=False,
                    gradient_checkpointing=True,
                    activation_offloading=True,
                    **s,
                ),
            ),
            (
                "tiny lora dpo",
                cfg,
                step_plan("lora", load_dtype="fp32", compute_dtype="fp32", autocast=False, method="dpo", **s),
            ),
        ]
    tl = with_layers(full_config("tinyllama"), 4)
    l2 = with_layers(full_config("llama2-7b/4"), 4)
    s = dict(batch_size=2, seq_len=1024)
    rows = [
        ("tinyllama lora all", tl, step_plan("lora", **s)),
        ("tinyllama lora all gc", tl, step_plan("lora", gradient_checkpointing=True, **s)),
        ("tinyllama qlora gc paged8", tl, step_plan("qlora", gradient_checkpointing=True, optim="paged_adamw_8bit", **s)),
        ("tinyllama qlora plain-path gc", tl, step_plan("qlora", prepare_kbit=True, fused_lm_head=False, gradient_checkpointing=True, **s)),
        ("tinyllama lora plain-path", tl, step_plan("lora", fused_lm_head=False, **s)),
        ("llama2/4 full gc adamw8", l2, step_plan("full", gradient_checkpointing=True, optim="adamw_8bit", **s)),
        ("llama2/4 lora qv", l2, step_plan("lora", target_modules="q_proj,v_proj", **s)),
        ("llama2/4 qlora no-gc", l2, step_plan("qlora", **s)),
        # the levers modelled from their code until measured here (issue 12), and DPO's step (issue 13)
        ("tinyllama lora gc offloading", tl, step_plan("lora", gradient_checkpointing=True, activation_offloading=True, **s)),
        ("tinyllama lora padding-free gc", tl, step_plan("lora", gradient_checkpointing=True, padding_free=True, **s)),
        ("tinyllama lora dpo gc", tl, step_plan("lora", gradient_checkpointing=True, method="dpo", batch_size=1, seq_len=1024)),
    ]  # fmt: skip
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:  # optional: pip install liger-kernel
        rows.append(
            ("tinyllama lora gc liger", tl, step_plan("lora", gradient_checkpointing=True, liger=True, **s))
        )
    return rows


def measure_row(config, plan, cuda: bool, cache: Path) -> dict:
    """One steady step on the device: the tracker's tensor peak, torch's and NVML's figures, and the plan's."""
    from dataclasses import replace

    import torch

    from core.measure.build import build_model, build_optimizer
    from core.measure.step import make_batch, run_step
    from core.measure.step_plan import estimate_for

    device = "cuda" if cuda else "cpu"
    plan = replace(plan, device=device)
    model, cfg = build_model(config, plan, cache)
    optimizer = build_optimizer(model, plan)
    batch = {k: v.to(device) for k, v in make_batch(cfg, plan).items()}
    run_step(
        model, optimizer, batch, plan
    )  # the first step makes the optimizer state: the next one is steady
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    measured = run_step(model, optimizer, batch, plan)
    folder = cache / f"planner-{abs(hash(cfg.to_json_string()))}"
    folder.mkdir(exist_ok=True)
    cfg.to_json_file(str(folder / "config.json"))
    est = estimate_for(str(folder), plan) or {}
    row = {
        "tensor_peak": measured.peak_bytes,
        "planned_tensor_peak": est.get("tensor_peak_bytes"),
        "planned_reserved_peak": est.get("reserved_peak_bytes"),
        "planned_device_total": est.get("device_total_bytes"),
    }
    if measured.cuda:
        row.update(
            allocated_peak=measured.cuda.get("allocated_peak"),
            reserved_peak=measured.cuda.get("reserved_peak"),
            nvml_used=measured.cuda.get("nvml_used"),
        )
    del model, optimizer, batch
    if cuda:
        torch.cuda.empty_cache()
    return row


def _err(measured, planned) -> float | None:
    return planned / measured - 1 if measured and planned else None


def part_planner(dry: bool, cuda: bool, cache: Path) -> dict:
    rows = []
    for name, config, plan in matrix(dry):
        t0 = time.time()
        row = {"name": name, **measure_row(config, plan, cuda, cache)}
        row["seconds"] = round(time.time() - t0, 1)
        measured = row.get("allocated_peak") or row["tensor_peak"]
        row["err_tensor"] = _err(measured, row["planned_tensor_peak"])
        row["err_reserved"] = _err(row.get("reserved_peak"), row["planned_reserved_peak"])
        row["err_device"] = _err(row.get("nvml_used"), row["planned_device_total"])
        rows.append(row)
        print(
            f"  {name:<32} measured {measured / MiB:8.0f} MiB  planned {(row['planned_tensor_peak'] or 0) / MiB:8.0f}"
            f"  err {row['err_tensor']:+.1%}" + (f"  reserved err {row['err_reserved']:+.1%}" if row["err_reserved"] is not None else ""),
            flush=True,
        )  # fmt: skip
    summary = {}
    for key in ("err_tensor", "err_reserved", "err_device"):
        errs = [abs(r[key]) for r in rows if r[key] is not None]
        if errs:
            summary[key] = {"median": statistics.median(errs), "worst": max(errs), "n": len(errs)}
    return {"rows": rows, "summary": summary}


# ---- 2. a real run through the product --------------------------------------------------------------------------


def part_product(dry: bool, cuda: bool, work: Path) -> dict:
    from core import rundir
    from core.demo.build import build_demo, demo_config
    from core.monitor.watch import RunWatcher
    from core.runs.admin import start_smoke_test
    from core.runs.launcher import create_run, launch, wait_for, wait_for_smoke

    demo = build_demo(work / "demo", pretrain_steps=30 if dry else 300, log=lambda *_: None)
    out = {}
    for variant, extra in (("lora", {}), ("qlora", {"quantization": {"load_in_4bit": True}})):
        cfg = demo_config(out=demo)
        cfg["training"].update(max_steps=6 if dry else 40, logging_steps=2, eval_steps=None, save_steps=1000)
        cfg["data"]["eval_split"] = 0.0
        for section, values in extra.items():
            cfg[section].update(values)
        ws = work / "ws"
        run = create_run(ws, f"truth-{variant}", cfg)
        launch(run)
        info = wait_for(run, timeout=600)
        snap = RunWatcher(run).refresh()
        gpu_lines = len((run / rundir.GPU).read_text().splitlines()) if (run / rundir.GPU).exists() else 0
        smoke_dir = start_smoke_test(ws, f"truth-{variant}", cfg)
        smoke = wait_for_smoke(smoke_dir, timeout=600) or {}
        out[variant] = {
            "state": info.state,
            "reason": info.reason,
            "gpu_jsonl_lines": gpu_lines,
            "memory_frame_rows": len(snap.charts.get("gpu_memory", [])),
            "plan_line_gib": snap.lines.get("plan_peak_gib"),
            "smoke_peak": smoke.get("peak_bytes"),
            "smoke_estimate": smoke.get("estimate_bytes"),
            "smoke_measured_by": smoke.get("measured_by"),
            "smoke_error": _err(smoke.get("peak_bytes"), smoke.get("estimate_bytes")),
        }
        print(f"  run {variant}: {json.dumps(out[variant], default=str)}", flush=True)
    out["adapter"] = str(work / "ws" / "runs" / "truth-lora" / rundir.ADAPTER)
    out["base"] = str(demo / "base")
    return out


# ---- 3. failure paths -------------------------------------------------------------------------------------------


def part_failures(cuda: bool, work: Path, product: dict) -> dict:
    if not cuda:
        return {"skipped": "needs CUDA: a forced OOM and allocator settings have no CPU equivalent"}
    from core import rundir
    from core.monitor.diagnose import diagnose_run
    from core.recipe.config import dump_config, load_config

    run = work / "oom-run"
    run.mkdir()
    cfg = load_config(work / "ws" / "runs" / "truth-lora" / rundir.CONFIG)
    cfg["training"]["per_device_train_batch_size"] = 64
    dump_config(cfg, run / rundir.CONFIG)
    code = (
        "import sys, torch; torch.cuda.set_per_process_memory_fraction(0.002); "
        "from core.train.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    with open(run / rundir.STDERR, "wb") as err:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(run / rundir.CONFIG), "--run-dir", str(run)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, timeout=300,
        )  # fmt: skip
    d = diagnose_run(run)
    out = {"oom_exit": proc.returncode, "oom_rule": d.rule, "oom_fixes": d.fixes[:2]}
    reserved = {}
    for setting in ("", "expandable_segments:True"):
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=setting)
        child = subprocess.run(
            [sys.executable, __file__, "--child-row", "0", "--out", str(work)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        reserved[setting or "default"] = (
            json.loads(child.stdout.strip().splitlines()[-1])
            if child.returncode == 0
            else child.stderr[-500:]
        )
    out["expandable_segments"] = reserved
    return out


# ---- 4. merge on the device -------------------------------------------------------------------------------------


def part_merge(cuda: bool, work: Path, product: dict) -> dict:
    from core import merge

    result = merge.merge_at(
        product["base"], product["adapter"], work / "merged", device="cuda" if cuda else "cpu"
    )
    v = result.verification
    return {"passed": v.passed, "mode": v.mode, "max_abs_diff": v.max_abs_diff, "seconds": result.seconds}


# ---- 5. several GPUs --------------------------------------------------------------------------------------------


def part_multi_gpu(cuda: bool, work: Path, out_dir: Path) -> dict:
    import torch

    visible = torch.cuda.device_count() if cuda else 0
    if visible < 2:
        return {"skipped": f"{visible} CUDA GPU(s) visible: the multi-GPU paths need 2 (tests/test_multi_process.py "
                "runs the launcher on 2 CPU processes)"}  # fmt: skip
    from core import rundir
    from core.demo.build import demo_config
    from core.runs.launcher import create_run, launch, wait_for
    from core.train import ranks

    out = {"visible_gpus": visible}
    for strategy in ("ddp", "fsdp"):
        cfg = demo_config(out=work / "demo")
        cfg["training"].update(max_steps=40, logging_steps=2, eval_steps=None, save_steps=1000)
        cfg["data"]["eval_split"] = 0.0
        cfg["distributed"] = {"gpus": 2, "strategy": strategy}
        run = create_run(work / "ws", f"truth-2gpu-{strategy}", cfg)
        launch(run)
        info = wait_for(run, timeout=900)
        lines = (
            [json.loads(x) for x in (run / rundir.METRICS).read_text().splitlines()]
            if info.state == "finished"
            else []
        )
        out[strategy] = {
            "state": info.state,
            "reason": info.reason,
            "ranks": {k: (r.get("ended") or {}).get("state") for k, r in ranks.records(run).items()},
            "rank1_memory": any("rank1_cuda_reserved" in x for x in lines),
            "final_loss": next((x["loss"] for x in reversed(lines) if "loss" in x), None),
        }
        print(f"  2 GPUs {strategy}: {json.dumps(out[strategy], default=str)}", flush=True)
    child = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multi_gpu_truth.py"), "--out", str(out_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out["multi_gpu_truth"] = (child.stdout.strip().splitlines() or [""])[-1] + child.stderr[-300:]
    out["passed"] = all(out[s]["state"] == "finished" and out[s]["rank1_memory"] for s in ("ddp", "fsdp"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for gpu_truth.json (required but with --quick)")
    ap.add_argument(
        "--dry-run", action="store_true", help="the CPU, smallest sizes: keeps the script working"
    )
    ap.add_argument("--quick", action="store_true", help="--dry-run into a temporary folder, goal not judged")
    ap.add_argument("--child-row", type=int, help=argparse.SUPPRESS)  # one planner row in a fresh process
    args = ap.parse_args(argv)
    if args.out is None and not args.quick:
        ap.error("--out is required")
    if args.out is None:  # --quick: a folder of its own, removed after
        with tempfile.TemporaryDirectory(prefix="gpu-truth-") as tmp:
            return main([*(sys.argv[1:] if argv is None else argv), "--out", tmp])
    args.dry_run = args.dry_run or args.quick

    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child_row is not None:
        name, config, plan = matrix(not cuda)[args.child_row]
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(measure_row(config, plan, cuda, Path(tmp))))
        return 0
    if not cuda and not args.dry_run:
        print("no CUDA device here: run with --dry-run, or on a machine with a GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    report = {"dry_run": args.dry_run, "versions": versions(), "device": device_info(cuda)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("1. planner vs measurement", flush=True)
        report["planner"] = part_planner(args.dry_run, cuda, work)
        print("2. a run through the product", flush=True)
        report["product"] = part_product(args.dry_run, cuda, work)
        print("3. failure paths", flush=True)
        report["failures"] = part_failures(cuda, work, report["product"])
        print("4. merge", flush=True)
        report["merge"] = part_merge(cuda, work, report["product"])
        print("5. several GPUs", flush=True)
        report["multi_gpu"] = part_multi_gpu(cuda, work, out)
    report["seconds"] = round(time.time() - t0, 1)
    (out / "gpu_truth.json").write_text(json.dumps(report, indent=1, default=str))
    s = report["planner"]["summary"].get("err_tensor", {"median": 1.0, "worst": 1.0})
    runs_ok = all(
        report["product"][v]["state"] == "finished"
        and abs(report["product"][v]["smoke_error"] or 1.0) <= GOAL_WORST
        for v in ("lora", "qlora")
    )  # each run finished, and its smoke test measured what the plan said
    ok = s["median"] <= GOAL_MEDIAN and s["worst"] <= GOAL_WORST and runs_ok and report["merge"]["passed"]
    if cuda:
        ok = ok and report["failures"].get("oom_rule") == "cuda_oom"
    ok = ok and report["multi_gpu"].get("passed", True)  # judged where it ran
    where = "dry run, cpu" if args.dry_run else report["device"]["device"]
    print(f"report: {out / 'gpu_truth.json'} ({report['seconds']} s)")
    print(
        f"gpu_truth ({where}): tensor peak median {s['median']:.1%} worst {s['worst']:.1%}, runs "
        f"{'finished' if runs_ok else 'FAILED'}, merge {'verified' if report['merge']['passed'] else 'FAILED'} "
        f"(goal median <= {GOAL_MEDIAN:.0%}, worst <= {GOAL_WORST:.0%}, everything passes"
        + ("; --quick: not judged)" if args.quick else ")")
    )
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
