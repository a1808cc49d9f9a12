"""The diagnosis rules, most specific first: each names the signs, the cause, the fix, and explains a run's own
evidence (core/monitor/diagnose.py applies them; docs/troubleshooting.md is generated from them)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from core.files import read_bounded, read_json_object
from core.fmt import first_sentence, gib
from core.monitor.evidence import Evidence, Rule, _bytes, _search

GiB = 1024**3


def _explain_disk_full(ev: Evidence) -> tuple[list[str], list[str]]:
    details = [f"Run status: {first_sentence(ev.reason)}"] if ev.reason else []
    if not (ev.training() or {}).get("save_total_limit"):
        details.append("training.save_total_limit is not set: every checkpoint is kept.")
    return details, []


def _explain_cuda_oom(ev: Evidence) -> tuple[list[str], list[str]]:
    details, fixes = [], []
    text = ev.stderr
    tried = _search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    cap = _search(r"total capacity of ([\d.]+ [KMGT]?i?B) of which ([\d.]+ [KMGT]?i?B) is free", text)
    unalloc = _search(r"([\d.]+ [KMGT]?i?B) is reserved by PyTorch but unallocated", text)
    alloc = _search(r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch", text)
    tried_b = _bytes(tried.group(1)) if tried else None
    cap_b = _bytes(cap.group(1)) if cap else None
    if tried:
        line = f"PyTorch asked for {tried.group(1)} more"
        if cap:
            line += f" with {cap.group(2)} free on a {cap.group(1)} card"
        details.append(line + ".")
    if alloc and unalloc:
        details.append(
            f"Tensors held {alloc.group(1)}; {unalloc.group(1)} was reserved by PyTorch but unallocated."
        )
    unalloc_b = _bytes(unalloc.group(1)) if unalloc else None
    if unalloc_b and (
        (tried_b and unalloc_b >= tried_b) or (cap_b and unalloc_b >= 0.1 * cap_b) or unalloc_b >= 2 * GiB
    ):
        details.append(
            "The unallocated reserve is large next to the request: memory is fragmented into pieces too small "
            "for the allocation."
        )
        fixes.append(
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the run's environment (lets PyTorch grow "
            "segments instead of fragmenting) and launch again."
        )
    # Other processes: NVML samples know the run's process tree; stderr's "Process N" lines include our own
    # process when it runs in a container, so they count only when "this process" is listed separately.
    others = []
    if ev.series is not None:
        for procs in ev.series.gpu_other_processes.values():
            others += [p for p in procs if isinstance(p, dict)]
    other_bytes = sum(float(p.get("memory") or 0) for p in others)
    if not others and "this process has" in text:
        for pid, amount in re.findall(r"Process (\d+) has ([\d.]+ [KMGT]?i?B) memory in use", text):
            others.append({"pid": int(pid), "memory": _bytes(amount)})
            other_bytes += _bytes(amount) or 0
    if other_bytes >= 0.5 * GiB:
        pids = ", ".join(str(p.get("pid")) for p in others[:5])
        details.append(f"Other processes held {gib(other_bytes)} of the GPU (pid {pids}).")
        fixes.append(
            f"Close the other programs on the GPU (pid {pids}: another run, a notebook, a desktop app), or "
            "subtract their memory when planning."
        )
    plan = ev.plan or {}
    predicted = plan.get("device_total_bytes") or plan.get("reserved_peak_bytes")
    total = plan.get("gpu_bytes") or cap_b
    if predicted and total:
        if predicted > total:
            details.append(
                f"The plan already predicted {gib(predicted)} for a {gib(total)} card: this config does not fit."
            )
            fixes.append("Use the batch size / sequence length the Estimate page suggests for this card.")
        else:
            details.append(
                f"The plan predicted {gib(predicted)} of {gib(total)}; the run needed more (a longer batch "
                "than planned, or other processes)."
            )
            fixes.append(
                "Check the dataset's longest sample against training.max_length in the plan, and run the Smoke test "
                "to measure before launching."
            )
    elif not plan:
        details.append(
            "No plan.json for this run: estimate it on the Estimate page to see where memory goes."
        )
    return details, fixes


def _model_limits(ev: Evidence) -> tuple[int | None, int | None]:
    """vocab_size and max_position_embeddings of the run's model, when its folder is readable."""
    model = (ev.config or {}).get("model") or {}
    path = (
        model.get("path") or model.get("name_or_path") or model.get("name")
        if isinstance(model, dict)
        else None
    )
    cfg = read_json_object(Path(str(path)) / "config.json")  # bounded, regular files only: never a hang
    if cfg is None:
        return None, None
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return cfg.get("vocab_size"), cfg.get("max_position_embeddings") or cfg.get("n_positions")


def _explain_index(ev: Evidence) -> tuple[list[str], list[str]]:
    details, fixes = [], []
    vocab, max_pos = _model_limits(ev)
    target = _search(r"Target (-?\d+) is out of bounds", ev.stderr)
    if target or "n_classes" in ev.stderr:
        what = f"label {target.group(1)}" if target else "a label"
        details.append(
            f"The loss received {what} outside the vocabulary" + (f" (vocab_size {vocab})." if vocab else ".")
        )
        fixes.append(
            "Labels must be token ids of this model's tokenizer or -100: use the model's own tokenizer, and if "
            "you added tokens, call model.resize_token_embeddings(len(tokenizer))."
        )
    if re.search(r"index out of range in self|srcIndex < srcSelectDimSize", ev.stderr):
        lim = []
        if vocab:
            lim.append(f"vocab_size {vocab}")
        if max_pos:
            lim.append(f"max_position_embeddings {max_pos}")
        details.append(
            "An embedding lookup got an index beyond its table: a token id past the vocabulary or a position "
            "past the model's maximum" + (f" ({', '.join(lim)})." if lim else ".")
        )
        fixes.append(
            "Set training.max_length no larger than the model's max_position_embeddings and make sure the tokenizer "
            "matches the model (same vocabulary)."
        )
    if "device-side assert" in ev.stderr:
        details.append(
            "On the GPU this surfaces as a device-side assert; the traceback line may be misleading."
        )
    return details, fixes


def _nonfinite_loss(ev: Evidence) -> bool:
    if re.search(r"(?i)\b(?:nan|inf)\b", ev.reason) and re.search(r"(?i)loss", ev.reason):
        return True  # core.train stops with "loss became NaN at step N"
    if ev.series is None:
        return False
    _, loss = ev.series.metric("loss")
    return bool(loss.size) and not np.isfinite(loss).all()


def _explain_nan(ev: Evidence) -> tuple[list[str], list[str]]:
    details, fixes = [], []
    if ev.series is not None:
        steps, loss = ev.series.metric("loss")
        bad = ~np.isfinite(loss)
        if bad.any():
            i = int(np.argmax(bad))
            before = loss[:i][np.isfinite(loss[:i])]
            details.append(
                f"Loss became {loss[i]} at step {int(steps[i])}"
                + (
                    f" (last finite value {before[-1]:.4g})."
                    if before.size
                    else " (from the first logged step)."
                )
            )
            gsteps, gn = ev.series.metric("grad_norm")
            if gn.size:
                upto = gn[gsteps <= steps[i]]
                if upto.size:
                    details.append(f"Gradient norm just before: {upto[-1]:.4g}.")
    tr = ev.training()
    lr = tr.get("learning_rate")
    if lr is None and ev.series is not None:
        lr = ev.series.metrics.get("learning_rate").last() if ev.series.metrics.get("learning_rate") else None
    if isinstance(lr, (int, float)) and lr > 5e-4:
        details.append(f"training.learning_rate {lr:g} is high for LoRA (typical 1e-4 to 3e-4).")
        fixes.append(f"Lower training.learning_rate to {lr / 10:g} and keep a warmup.")
    if tr.get("fp16"):
        details.append("fp16 is on: its range ends at 65504, and activations or the loss scale can overflow.")
        fixes.append("Switch fp16 off and bf16 on (RTX 30xx/40xx, A6000 and L40 support bf16).")
    return details, fixes


def _dataloader_hang(ev: Evidence) -> bool:
    """No step completed for a long time while the GPU sat idle."""
    s = ev.series
    if s is None or ev.state not in ("failed", "stopped", "running"):
        return False
    t, util = s.gpu_series("utilization")
    if util.size < 30:
        return False
    last_metric = s.last_time or (ev.status or {}).get("started") or t[0]
    idle = util[t > last_metric]
    span = t[-1] - max(last_metric, t[0])
    return span >= 120 and idle.size >= 30 and float(np.mean(idle)) < 5.0


def _explain_hang(ev: Evidence) -> tuple[list[str], list[str]]:
    s = ev.series
    t, util = s.gpu_series("utilization")
    last_metric = s.last_time or (ev.status or {}).get("started") or t[0]
    idle = util[t > last_metric]
    step = (ev.status or {}).get("step")
    details = [
        f"No progress for {t[-1] - max(last_metric, t[0]):.0f} s"
        + (f" (stuck at step {step})" if step is not None else "")
        + f" while GPU utilisation averaged {float(np.mean(idle)):.1f}%."
    ]
    tr = ev.training()
    workers = tr.get("dataloader_num_workers")
    if workers:
        details.append(f"training.dataloader_num_workers is {workers}.")
    return details, []


def _killed(ev: Evidence) -> bool:
    if ev.state != "failed":
        return False
    # core.runs writes "ended without reporting" when the trainer vanished without writing its own status:
    # with no Python traceback in stderr that is almost always the kernel's OOM killer (SIGKILL).
    killed = re.search(
        r"SIGKILL|signal 9|\bkilled\b|exit(?:ed)? (?:code|status) (?:-9|137)|ended without reporting",
        ev.reason,
        re.I,
    )
    return bool(killed) and "Traceback (most recent call last)" not in ev.stderr[-20000:]


# The OOM killer ends the process holding the most memory when RAM (or the cgroup's limit) runs out: a run that
# held less than this share of it at its last sample was most likely killed by something else.
OOM_SHARE = 0.5


def memory_limit() -> float | None:
    """The RAM a process here can have: the machine's, or its cgroup's limit (a container) when lower."""
    limits = []
    try:
        import psutil

        limits.append(float(psutil.virtual_memory().total))
    except Exception:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = read_bounded(path, 64).decode().strip()
        except (OSError, ValueError):
            continue
        if text.isdigit() and 0 < int(text) < 2**60:  # "max" or a huge number: no limit
            limits.append(float(text))
    return min(limits) if limits else None


def _last_rss(ev: Evidence) -> tuple[float, int] | None:
    """(the run's resident memory at its last sample, that sample's step) from metrics.jsonl's rss_bytes."""
    if ev.series is None:
        return None
    steps, rss = ev.series.metric("rss_bytes")
    ok = np.isfinite(rss) & (rss > 0)
    if not ok.any():
        return None
    return float(rss[ok][-1]), int(steps[ok][-1])


def _far_below_ram(ev: Evidence) -> bool:
    last, limit = _last_rss(ev), memory_limit()
    return bool(last and limit and last[0] < OOM_SHARE * limit)


def _oom_killed(ev: Evidence) -> bool:
    return _killed(ev) and not _far_below_ram(ev)


def _killed_from_outside(ev: Evidence) -> bool:
    return _killed(ev) and _far_below_ram(ev)


def _memory_details(ev: Evidence) -> list[str]:
    last, limit = _last_rss(ev), memory_limit()
    out = []
    if last and limit:
        out.append(
            f"At its last sample (step {last[1]}) the run held {gib(last[0])} of RAM, {last[0] / limit:.0%} of the "
            f"{gib(limit)} it could have."
        )
    elif limit:
        out.append(
            f"The run logged no memory sample before it ended (it died before its first logged step); the RAM it "
            f"could have: {gib(limit)}."
        )
    return out


def _explain_cpu_oom(ev: Evidence) -> tuple[list[str], list[str]]:
    details = []
    m = _search(r"you tried to allocate (\d+) bytes", ev.stderr)
    if m:
        details.append(f"A CPU allocation of {gib(float(m.group(1)))} failed.")
    if ev.reason:
        details.append(f"Run status: {first_sentence(ev.reason)}")
    details += _memory_details(ev)
    fixes = []
    if _killed(ev):
        fixes.append(
            "To be sure it was the kernel: `journalctl -k` (or `dmesg`) shows 'Out of memory: Killed process <pid>'."
        )
    return details, fixes


def _explain_killed(ev: Evidence) -> tuple[list[str], list[str]]:
    details = [f"Run status: {first_sentence(ev.reason)}"] if ev.reason else []
    details += _memory_details(ev)
    details.append(
        "The kernel's OOM killer ends the process that holds the most memory: this run held far less."
    )
    return details, []


_PIP_NAMES = {"yaml": "pyyaml", "sklearn": "scikit-learn", "flash_attn": "flash-attn", "PIL": "pillow"}


def _explain_module(ev: Evidence) -> tuple[list[str], list[str]]:
    m = _search(r"No module named '([\w.]+)'", ev.stderr)
    if not m:
        return [], []
    mod = m.group(1)
    top = mod.split(".")[0]
    pkg = _PIP_NAMES.get(top, top.replace("_", "-"))
    return [f"Python could not import {mod!r}."], [
        f"Install it in the environment that runs training: python -m pip install {pkg}"
    ]


def _explain_file(ev: Evidence) -> tuple[list[str], list[str]]:
    for pat in (
        r"No such file or directory: '([^']+)'",
        r"Unable to find '([^']+)'",
        r"Repo id must be in the form [^:]*: '([^']+)'",
        r"'([^']+)' is not a local folder",
        r"(\S+) does not appear to have a file named ([\w.]+)",
    ):
        m = _search(pat, ev.stderr)
        if m:
            return [
                f"Missing: {m.group(1)}" + (f" (no {m.group(2)})" if m.lastindex and m.lastindex > 1 else "")
            ], []
    return [], []


def _explain_unknown(ev: Evidence) -> tuple[list[str], list[str]]:
    lines = [ln.strip() for ln in ev.stderr.splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b.*", ln)]
    details = []
    if exc:
        details.append(f"Last error: {exc[-1][:400]}")
    elif lines:
        details.append(f"Last stderr line: {lines[-1][:400]}")
    if ev.reason:
        details.append(f"Run status: {first_sentence(ev.reason)}")
    return details, []


RULES: list[Rule] = [
    Rule(
        name="disk_full",
        title="Disk full",
        signs="A status reason starting 'disk full', or stderr with `No space left on device` (ENOSPC, errno 28), "
        "`Disk quota exceeded` or safetensors' `StorageFull`.",
        cause="The disk that holds the run directory filled up: checkpoints (adapter plus optimizer state, each "
        "training.save_steps), metrics and logs could not be written. The trainer stops before a checkpoint that would not "
        "fit, and on a write that fails it records why.",
        fix=[
            "Free space on the disk that holds the workspace (old runs: python -m core.runs delete NAME; old "
            "exports), or move the workspace to a larger disk (LORA_COCKPIT_WORKSPACE), then resume the run.",
            "Keep fewer checkpoints: set training.save_total_limit (e.g. 2), or raise training.save_steps.",
        ],
        patterns=(
            r"(?i)^disk full\b",
            r"No space left on device",
            r"Disk quota exceeded",
            r"StorageFull",
            r"\[Errno 28\]",
        ),
        explain=_explain_disk_full,
    ),
    Rule(
        name="cuda_oom",
        title="GPU out of memory (CUDA OOM)",
        signs="stderr contains `torch.OutOfMemoryError: CUDA out of memory` (or CUBLAS_STATUS_ALLOC_FAILED).",
        cause="The run needed more GPU memory than was free at that moment.",
        fix=[
            "Lower training.per_device_train_batch_size and raise training.gradient_accumulation_steps to keep the effective batch.",
            "Lower training.max_length, enable training.gradient_checkpointing, or use QLoRA (4-bit) with paged_adamw_8bit.",
            "If the message shows a large 'reserved by PyTorch but unallocated' figure, memory is fragmented: "
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
            "If other processes hold GPU memory (the Monitor lists them from NVML), close them.",
        ],
        patterns=(r"CUDA out of memory", r"OutOfMemoryError", r"CUBLAS_STATUS_ALLOC_FAILED"),
        explain=_explain_cuda_oom,
    ),
    Rule(
        name="index_out_of_range",
        title="A token id or label is out of range (device-side assert)",
        signs="`CUDA error: device-side assert triggered` with `t >= 0 && t < n_classes` or `srcIndex < "
        "srcSelectDimSize`; on CPU `IndexError: Target N is out of bounds` or `index out of range in self`.",
        cause="A label is not a valid token id of the model (>= vocab_size), a token id is past the embedding "
        "table, or a sequence is longer than the model's maximum positions.",
        fix=[
            "Run the dataset preflight on the Train page: it checks token ids, labels and lengths against the model.",
            "Use the model's own tokenizer; after adding tokens call model.resize_token_embeddings(len(tokenizer)).",
            "Keep training.max_length at or below the model's max_position_embeddings.",
        ],
        patterns=(
            r"device-side assert triggered",
            r"Assertion `t >= 0 && t < n_classes` failed",
            r"Assertion `srcIndex < srcSelectDimSize` failed",
            r"IndexError: Target -?\d+ is out of bounds",
            r"IndexError: index out of range in self",
        ),
        explain=_explain_index,
    ),
    Rule(
        name="cpu_oom",
        title="Out of CPU memory (RAM)",
        signs="`DefaultCPUAllocator: can't allocate memory`, `MemoryError`, `Cannot allocate memory`, or the "
        "process vanished (SIGKILL, 'ended without reporting') with no Python traceback: the kernel's OOM killer.",
        cause="The machine ran out of RAM: loading the model in full precision before quantising, a large "
        "dataset held in memory, or many data loader workers each copying it.",
        fix=[
            "Close other memory-hungry programs, or add swap.",
            "Lower training.dataloader_num_workers (each worker holds its own copy of the dataset pipeline).",
            "Load the model directly in 4-bit (QLoRA) and with low_cpu_mem_usage; tokenise the dataset to disk "
            "(datasets map with a cache) instead of holding it in Python lists.",
        ],
        patterns=(
            r"DefaultCPUAllocator: can't allocate memory",
            r"^\s*MemoryError\b",
            r"Cannot allocate memory",
            r"std::bad_alloc",
        ),
        test=_oom_killed,
        explain=_explain_cpu_oom,
    ),
    Rule(
        name="killed",
        title="Killed from outside (SIGKILL)",
        signs="The process vanished (SIGKILL, 'ended without reporting') with no Python traceback while its memory "
        "at its last sample (metrics.jsonl's rss_bytes) was under half of the machine's RAM (or its container's "
        "limit): not the kernel's OOM killer.",
        cause="Something outside the run ended it with SIGKILL: `kill -9`, a job scheduler or container runtime "
        "(a time limit, a pre-emption), or the session it ran in closing.",
        fix=[
            "Find who ended it: the scheduler's or container's logs, the shell history; `journalctl -k` shows "
            "'Out of memory: Killed process <pid>' only when the kernel did it.",
            "Resume it from its newest checkpoint (Resume on the Monitor, or python -m core.runs resume NAME).",
            "Stop a run with Stop or python -m core.runs stop NAME (it saves a checkpoint first), not kill -9.",
        ],
        test=_killed_from_outside,
        explain=_explain_killed,
    ),
    Rule(
        name="dataloader_worker_died",
        title="A data loader worker died",
        signs="`DataLoader worker (pid N) is killed by signal` or `DataLoader worker ... exited unexpectedly`.",
        cause="A worker process of the PyTorch DataLoader was killed, most often by the kernel's OOM killer "
        "(each worker copies the dataset) or because shared memory (/dev/shm) is too small.",
        fix=[
            "Set training.dataloader_num_workers=0 (or 1-2) and launch again.",
            "Set training.dataloader_pin_memory=False; in Docker, raise --shm-size.",
        ],
        patterns=(r"DataLoader worker \(pid", r"DataLoader worker .*exited unexpectedly"),
        explain=_explain_cpu_oom,
    ),
    Rule(
        name="nan_loss",
        title="Loss became NaN / inf",
        signs="A non-finite loss in metrics.jsonl, a status reason such as 'loss became NaN at step N', or "
        "stderr reporting a NaN loss / anomaly.",
        cause="The optimisation diverged: a learning rate too high for this model, or fp16 overflow (values "
        "beyond 65504).",
        fix=[
            "Lower training.learning_rate (10x), keep training.max_grad_norm=1.0 and a warmup.",
            "Use bf16 instead of fp16 on GPUs that support it.",
            "Resume from the last checkpoint before the NaN, not from the end.",
        ],
        patterns=(r"(?i)\bloss (?:is|became) (?:nan|inf)\b", r"returned nan values in its \d+th output"),
        test=_nonfinite_loss,
        explain=_explain_nan,
    ),
    Rule(
        name="missing_module",
        title="A Python package is missing",
        signs="`ModuleNotFoundError: No module named '...'`.",
        cause="The training process runs in a Python environment without a package it needs.",
        fix=["Install the package in the environment that runs training (python -m pip install <package>)."],
        patterns=(r"ModuleNotFoundError: No module named",),
        explain=_explain_module,
    ),
    Rule(
        name="file_not_found",
        title="A model or data file was not found",
        signs="`FileNotFoundError`, `No such file or directory`, or transformers reporting a path that is not a "
        "model folder (`Repo id must be in the form`, `does not appear to have a file named`).",
        cause="A path in the run config (model folder, dataset file, checkpoint) does not exist or is incomplete.",
        fix=[
            "Check model.path and the dataset path in config.yaml; the app works offline, so models must be "
            "local folders with config.json and weights.",
        ],
        patterns=(
            r"FileNotFoundError",
            r"No such file or directory",
            r"Repo id must be in the form",
            r"is not a local folder and is not a valid model identifier",
            r"does not appear to have a file named",
        ),
        explain=_explain_file,
    ),
    Rule(
        name="dataloader_hang",
        title="No progress with the GPU idle (data loader hang)",
        signs="No new step for two minutes or more while GPU utilisation stays near 0%.",
        cause="The data loader is stuck (a worker deadlock, a slow network file system, or tokenisation on the "
        "fly that cannot keep up), so the GPU waits.",
        fix=[
            "Set training.dataloader_num_workers=0 to rule out worker deadlocks, then raise it gradually.",
            "Set training.dataloader_pin_memory=False.",
            "Tokenise the dataset before training and keep it on a local disk.",
        ],
        test=_dataloader_hang,
        explain=_explain_hang,
    ),
    Rule(
        name="unknown",
        title="Unrecognised failure",
        signs="None of the rules above matched.",
        cause="The run failed for a reason these rules do not know; the last error line is shown below.",
        fix=["Read the stderr tail below, fix the cause, and launch again."],
        test=lambda ev: True,
        explain=_explain_unknown,
    ),
]
