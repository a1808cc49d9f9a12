"""What the diagnosis rules (core.monitor.diagnose_rules) read in a run's own evidence: the tests a rule needs
beyond its stderr patterns (a non-finite loss, a dataloader hang, a process killed by the kernel's OOM killer or
from outside) and each rule's explanation -- details and fixes from the run's stderr, status, config, metrics and
the machine's memory limit.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from core.files import read_bounded, read_json_object
from core.fmt import first_sentence, gib
from core.monitor.evidence import Evidence, _bytes, _search

GiB = 1024**3


def explain_disk_full(ev: Evidence) -> tuple[list[str], list[str]]:
    details = [f"Run status: {first_sentence(ev.reason)}"] if ev.reason else []
    if not (ev.training() or {}).get("save_total_limit"):
        details.append("training.save_total_limit is not set: every checkpoint is kept.")
    return details, []


def explain_cuda_oom(ev: Evidence) -> tuple[list[str], list[str]]:
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


def explain_index(ev: Evidence) -> tuple[list[str], list[str]]:
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


def nonfinite_loss(ev: Evidence) -> bool:
    if re.search(r"(?i)\b(?:nan|inf)\b", ev.reason) and re.search(r"(?i)loss", ev.reason):
        return True  # core.train stops with "loss became NaN at step N"
    if ev.series is None:
        return False
    _, loss = ev.series.metric("loss")
    return bool(loss.size) and not np.isfinite(loss).all()


def explain_nan(ev: Evidence) -> tuple[list[str], list[str]]:
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


def dataloader_hang(ev: Evidence) -> bool:
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


def explain_hang(ev: Evidence) -> tuple[list[str], list[str]]:
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


def oom_killed(ev: Evidence) -> bool:
    return _killed(ev) and not _far_below_ram(ev)


def killed_from_outside(ev: Evidence) -> bool:
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


def explain_cpu_oom(ev: Evidence) -> tuple[list[str], list[str]]:
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


def explain_killed(ev: Evidence) -> tuple[list[str], list[str]]:
    details = [f"Run status: {first_sentence(ev.reason)}"] if ev.reason else []
    details += _memory_details(ev)
    details.append(
        "The kernel's OOM killer ends the process that holds the most memory: this run held far less."
    )
    return details, []


_PIP_NAMES = {"yaml": "pyyaml", "sklearn": "scikit-learn", "flash_attn": "flash-attn", "PIL": "pillow"}


def explain_module(ev: Evidence) -> tuple[list[str], list[str]]:
    m = _search(r"No module named '([\w.]+)'", ev.stderr)
    if not m:
        return [], []
    mod = m.group(1)
    top = mod.split(".")[0]
    pkg = _PIP_NAMES.get(top, top.replace("_", "-"))
    return [f"Python could not import {mod!r}."], [
        f"Install it in the environment that runs training: python -m pip install {pkg}"
    ]


def explain_file(ev: Evidence) -> tuple[list[str], list[str]]:
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


def explain_unknown(ev: Evidence) -> tuple[list[str], list[str]]:
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
