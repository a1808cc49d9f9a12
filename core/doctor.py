"""What this machine can train with, and what to fix: `lora-cockpit doctor` (`python -m core.doctor`).

Python, the OS, the training stack's versions and torch's build, CUDA / ROCm / MPS and the NVIDIA driver, each GPU
with its free memory and the processes holding the rest, bitsandbytes' backend, the optional kernels, free disk and
write access at the workspace and the Hugging Face cache, the Hub endpoint and whether a token is set (never the
token); then each problem found, in one sentence with its fix. Exit 0 when nothing blocks training, 1 when
something does, 2 for bad arguments. `--json` prints the same facts as one object. The machine's facts come from
core.machine, the ones the planner reads; the Diagnostics page renders this module's report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from core import machine
from core.fmt import command, nbytes, run_piped
from core.hub import ids as hub_ids
from core.workspace import ENV_VAR, default_workspace, unwritable

DEFAULT_MIN_FREE_GIB = 5.0  # a run's checkpoints, an evaluation and a merged 7B model need several GiB
PYTORCH_WHEELS = "https://download.pytorch.org/whl/"
# PyTorch's CUDA wheel indexes, newest first, each with the CUDA version the driver must run
CUDA_WHEELS = (("cu130", (13, 0)), ("cu128", (12, 8)), ("cu126", (12, 6)))
TRAINING_STACK = ("torch", "transformers", "peft", "trl", "accelerate", "datasets")  # what any run imports


def folder_facts(path: str | os.PathLike) -> dict:
    """Where `path` is, whether this user can write there (a file created and removed in it, or in the nearest
    folder above it that exists: the workspace is created on first use) and the free space on its disk."""
    path = Path(path).expanduser().absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    facts = {"path": str(path), "exists": path.is_dir(), "writable": False, "free_bytes": None, "why": None}
    if not probe.is_dir():
        facts["why"] = f"{probe} is a file, not a folder"
        return facts
    with contextlib.suppress(
        OSError
    ):  # a folder whose disk cannot be asked: free space unknown, not a failure
        facts["free_bytes"] = shutil.disk_usage(probe).free
    try:
        with tempfile.TemporaryFile(dir=probe):
            facts["writable"] = True
    except OSError as exc:
        facts["why"] = unwritable(probe, exc)
    return facts


def hub_facts() -> dict:
    """The Hub this process uses and whether a token is set: where it comes from, never its value."""
    token_from = next(
        (v for v in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN") if os.environ.get(v, "").strip()), None
    )
    if token_from is None:
        try:
            from huggingface_hub import get_token

            token_from = "a saved login (hf auth login)" if get_token() else None
        except Exception:  # an old or broken huggingface_hub: no saved login can be read either
            token_from = None
    return {
        "endpoint": hub_ids.endpoint(),
        "offline": hub_ids.offline(),
        "token_set": token_from is not None,
        "token_from": token_from,
    }


def collect(
    workspace: str | os.PathLike | None = None,
    min_free_gib: float = DEFAULT_MIN_FREE_GIB,
    source=None,
) -> dict:
    """Every fact and the problems found, as one JSON-able dict. `source`: the GPU driver (NVML) to read, for tests
    on machines without a GPU; the real one by default."""
    torch = machine.torch_facts()
    nvml = machine.nvml(source=source, names=True)
    here = machine.cuda_gpus(source)
    bnb = machine.bitsandbytes()
    total, available = machine.ram()
    report = {
        "lora_cockpit": machine.version("lora-cockpit"),
        "system": machine.system(),
        "ram": {"total_bytes": total, "available_bytes": available},
        "packages": machine.packages(),
        "torch": {**asdict(torch), "gpu_build": torch.gpu_build},
        "nvidia": {"driver": nvml.driver, "cuda": nvml.cuda, "reason": nvml.reason},
        "gpus": [{**asdict(g), "others": list(g.others), "memory_free": g.memory_free} for g in nvml.gpus],
        # a ROCm GPU, or a CUDA one NVML cannot read: what torch itself sees
        "torch_devices": machine.torch_devices() if torch.cuda and not nvml.gpus else [],
        "trains_on": trains_on(here, torch),
        "bitsandbytes": {**asdict(bnb), "gpu": bnb.gpu},
        "kernels": machine.kernels(),
        "workspace": folder_facts(workspace or default_workspace()),
        "hub_cache": folder_facts(hub_ids.cache_dir()),
        "hub": hub_facts(),
        "min_free_bytes": int(min_free_gib * 2**30),
    }
    report["problems"] = sorted(problems(report), key=lambda p: not p["blocks"])  # what blocks first
    report["ok"] = not any(p["blocks"] for p in report["problems"])
    return report


def trains_on(here: machine.CudaGpus, torch: machine.TorchFacts) -> dict:
    """What a run started here trains on: the planner's card (core.machine.cuda_gpus), or ROCm's GPUs."""
    if here.usable:
        first = here.gpus[0]
        return {
            "device": "cuda",
            "gpus": here.usable,
            "label": f"{here.usable} CUDA GPU(s), first the {first.name}",
        }
    if torch.cuda:
        return {
            "device": "cuda",
            "gpus": torch.devices,
            "label": f"{torch.devices} GPU(s) through torch ({torch.build})",
        }
    return {"device": "cpu", "gpus": 0, "label": "this machine's CPU and RAM (torch can use no GPU)"}


def _version(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (text or "").split(".")[:2])
    except ValueError:
        return ()


def cuda_wheel(driver_cuda: str | None) -> str | None:
    """The newest PyTorch CUDA wheel index the driver runs (cu128 when the driver does not say), None when the
    driver is older than them all."""
    have = _version(driver_cuda)
    if not have:
        return "cu128"
    return next((tag for tag, need in CUDA_WHEELS if have >= need), None)


def torch_fix(report: dict) -> str:
    """The commands that install the torch build this machine needs: CUDA beside an NVIDIA GPU (the newest wheel
    its driver runs), else the CPU build; in place of an installed torch, of the same version (a plain `pip
    install torch --index-url ...` leaves an installed torch as it is: the requirement is already satisfied)."""
    installed = report["torch"]["version"]
    wheel = cuda_wheel(report["nvidia"]["cuda"]) if report["gpus"] else "cpu"
    pin = f"'torch=={installed.split('+')[0]}'" if installed else "torch"
    install = f"pip install {pin} --index-url {PYTORCH_WHEELS}{wheel or 'cu126'}"
    if installed:
        install = f"pip uninstall -y torch && {install}"
    if wheel is None:
        return (
            f"update the NVIDIA driver (it runs CUDA {report['nvidia']['cuda']}; torch needs 12.6 or newer), "
            f"then {install}"
        )
    return install


def problems(r: dict) -> list[dict]:
    """Each problem as {"blocks": does it stop training, "text": one sentence with its fix}."""
    out: list[dict] = []

    def block(text: str) -> None:
        out.append({"blocks": True, "text": text})

    def warn(text: str) -> None:
        out.append({"blocks": False, "text": text})

    torch, nvidia, bnb = r["torch"], r["nvidia"], r["bitsandbytes"]
    if not torch["version"]:
        block(f"torch is not installed: {torch_fix(r)}.")
    missing = [d for d in TRAINING_STACK if d != "torch" and not r["packages"].get(d)]
    if missing:
        block(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: pip install "
            f"{' '.join(missing)} (or pip install -r requirements.txt in a checkout)."
        )
    if torch["version"] and torch["error"]:
        block(
            f"torch {torch['version']} does not import ({torch['error'][:200]}): reinstall it: {torch_fix(r)}."
        )
    if r["gpus"] and r["trains_on"]["device"] == "cpu" and not torch["error"]:
        name = r["gpus"][0]["name"]
        if not torch["gpu_build"]:
            block(f"torch is the CPU build but an NVIDIA GPU is present ({name}): {torch_fix(r)}.")
        elif torch["build"].startswith("ROCm"):
            block(f"torch is the ROCm build but the GPU is an NVIDIA one ({name}): {torch_fix(r)}.")
        elif os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
            block("CUDA_VISIBLE_DEVICES hides every GPU from torch: unset it (or name the GPUs, e.g. 0).")
        elif _version(nvidia["cuda"]) and _version(nvidia["cuda"]) < _version(torch["build"].split()[-1]):
            block(
                f"torch {torch['version']} is built for {torch['build']} but the NVIDIA driver {nvidia['driver']} "
                f"runs CUDA {nvidia['cuda']} at most: update the driver, or {torch_fix(r)}."
            )
        else:
            block(
                f"torch ({torch['build']}) cannot use the NVIDIA GPU (torch.cuda.is_available() is False): "
                "check the driver with nvidia-smi; in a container, start it with the GPU passed in (docker run "
                "--gpus all)."
            )
    on_gpu = r["trains_on"]["device"] == "cuda"
    if on_gpu and not bnb["version"]:
        warn(
            "bitsandbytes is not installed: QLoRA (4-bit) and the 8-bit optimizers need it: pip install "
            "bitsandbytes."
        )
    elif on_gpu and not bnb["gpu"]:
        why = f"backend {bnb['backend']}" if bnb["backend"] else bnb["error"] or "no backend"
        warn(
            f"bitsandbytes {bnb['version']} has no GPU backend here ({why}): QLoRA (4-bit) and the 8-bit "
            f"optimizers will fail; reinstall it for {torch['build']}: pip install --force-reinstall --no-deps "
            f"'bitsandbytes=={bnb['version']}'."
        )
    if (
        on_gpu
        and torch["build"].startswith("CUDA")
        and not r["gpus"]
        and "nvidia-ml-py" in (nvidia["reason"] or "")
    ):
        warn(
            "nvidia-ml-py is not installed: the Monitor cannot show GPU memory and the planner cannot see what "
            "other processes hold: pip install nvidia-ml-py."
        )
    for g in r["gpus"]:
        # over a tenth of the card taken before a run starts: a notebook kernel, another run, a desktop
        if g["memory_total"] and g["memory_used"] and g["memory_used"] > 0.1 * g["memory_total"]:
            held = f" ({holders(g['others'])})" if g["others"] else ""
            warn(
                f"GPU {g['index']} ({g['name']}) has {nbytes(g['memory_used'])} of {nbytes(g['memory_total'])} in "
                f"use{held}: a run there gets only the {nbytes(g['memory_free'] or 0)} left; end that process, or "
                "pick another GPU (distributed.gpus)."
            )
    minimum = r["min_free_bytes"]
    ws, cache = r["workspace"], r["hub_cache"]
    if not ws["writable"]:
        block(
            f"The workspace cannot be written ({ws['why']}): choose a folder you can write to (--workspace DIR or "
            f"${ENV_VAR}), or make it writable."
        )
    if ws["free_bytes"] is not None and ws["free_bytes"] < minimum:
        block(
            f"Only {nbytes(ws['free_bytes'])} free on the disk holding the workspace {ws['path']} (under "
            f"{nbytes(minimum)}; checkpoints and merged models need more): free space there, or choose a "
            "workspace on a larger disk (--workspace DIR)."
        )
    if not cache["writable"]:
        warn(
            f"The Hugging Face cache cannot be written ({cache['why']}): Hub downloads will fail; set HF_HOME (or "
            "HF_HUB_CACHE) to a folder you can write to."
        )
    if cache["free_bytes"] is not None and cache["free_bytes"] < minimum:
        warn(
            f"Only {nbytes(cache['free_bytes'])} free on the disk holding the Hugging Face cache "
            f"{cache['path']}: a model download may not fit; free space there, or set HF_HOME to a folder on a "
            "larger disk."
        )
    return out


def holders(others: list[dict]) -> str:
    """'pid 4242 (python) holds 23.50 GiB, pid 17 holds ...' for the processes on a GPU, '' for none."""
    return ", ".join(
        f"pid {p['pid']}"
        + (f" ({p['name']})" if p.get("name") else "")
        + (f" holds {nbytes(p['memory'])}" if p.get("memory") else "")
        for p in others[:4]
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _folder_line(f: dict) -> str:
    state = "writable" if f["writable"] else f"NOT writable ({f['why']})"
    free = f", {nbytes(f['free_bytes'])} free" if f["free_bytes"] is not None else ""
    return f"{f['path']}{'' if f['exists'] else ' (created on first use)'}: {state}{free}"


def format_text(r: dict) -> str:
    """The report as plain text, for a terminal and a bug report."""
    s, t, nv, bnb = r["system"], r["torch"], r["nvidia"], r["bitsandbytes"]
    rows = [
        ("Python", f"{s['python']} ({s['implementation']}, {s['environment']}: {s['executable']})"),
        ("OS", f"{s['os']}, {s['machine']}, {s['cpus']} CPUs"),
        ("RAM", f"{nbytes(r['ram']['total_bytes'])} ({nbytes(r['ram']['available_bytes'])} available)"),
    ]
    torch_line = "not installed" if not t["version"] else f"{t['version']}, {t['build']} build"
    if t["error"]:
        torch_line += f"; does not import: {t['error'][:200]}"
    rocm = t["build"].startswith("ROCm") and t["cuda"]
    accel = f"CUDA {_yes(t['cuda'] and not rocm)}, ROCm {_yes(rocm)}, MPS {_yes(t['mps'])}"
    rows.append(("torch", f"{torch_line}; {accel}"))
    for dist, found in r["packages"].items():
        if dist == "torch":
            continue
        line = found or "not installed"
        if dist == "bitsandbytes" and found:
            line += f", backend {bnb['backend'] or 'none'}" + ("" if bnb["native"] else f" ({bnb['error']})")
        rows.append((dist, line))
    driver = f"{nv['driver']} (CUDA {nv['cuda'] or '?'})" if nv["driver"] else (nv["reason"] or "unknown")
    rows.append(("NVIDIA driver", driver))
    for g in r["gpus"]:
        free = f", {nbytes(g['memory_free'])} free" if g["memory_free"] is not None else ""
        held = f"; {holders(g['others'])}" if g["others"] else ""
        total = nbytes(g["memory_total"]) if g["memory_total"] else "memory unknown"
        rows.append((f"GPU {g['index']}", f"{g['name']}: {total}{free}{held}"))
    for d in r["torch_devices"]:
        total = nbytes(d["memory_total"]) if d["memory_total"] else "memory unknown"
        rows.append((f"GPU {d['index']}", f"{d['name']}: {total} (seen by torch)"))
    rows.append(("Trains on", r["trains_on"]["label"]))
    rows.append(("Kernels", ", ".join(f"{k} {v or 'no'}" for k, v in r["kernels"].items())))
    rows += [("Workspace", _folder_line(r["workspace"])), ("Hub cache", _folder_line(r["hub_cache"]))]
    hub = r["hub"]
    token = f"set (from {hub['token_from']})" if hub["token_set"] else "not set"
    rows.append(("Hub", f"{hub['endpoint']}{' (offline)' if hub['offline'] else ''}; token {token}"))
    width = max(len(k) for k, _ in rows) + 2
    head = f"LoRA Cockpit doctor (lora-cockpit {r['lora_cockpit'] or 'from a checkout'})"
    lines = [head, "", *(f"{k:<{width}}{v}" for k, v in rows), ""]
    if r["problems"]:
        lines.append("Problems:")
        lines += [f"  {'BLOCKS ' if p['blocks'] else 'warning'}  {p['text']}" for p in r["problems"]]
        lines.append("")
    blocking = sum(p["blocks"] for p in r["problems"])
    lines.append(
        f"{blocking} problem{'s' if blocking != 1 else ''} block{'' if blocking != 1 else 's'} training: fix "
        f"{'them' if blocking != 1 else 'it'} and run {command('doctor')} again."
        if blocking
        else "Nothing blocks training."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=command("doctor"), description="What this machine can train with, and what to fix."
    )
    parser.add_argument(
        "--workspace",
        metavar="DIR",
        help=f"the workspace to check (default: ${ENV_VAR}, else ./workspace, as every tool)",
    )
    parser.add_argument("--json", action="store_true", help="print the facts and problems as one JSON object")
    parser.add_argument(
        "--min-free-gib",
        type=float,
        default=DEFAULT_MIN_FREE_GIB,
        metavar="GIB",
        help="free disk below which the workspace blocks training (default %(default)s GiB)",
    )
    args = parser.parse_args(argv)
    if args.min_free_gib < 0:
        parser.error(f"--min-free-gib must be 0 or more, not {args.min_free_gib:g}.")
    report = collect(args.workspace, args.min_free_gib)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(run_piped(main))
