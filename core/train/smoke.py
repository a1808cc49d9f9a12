"""The smoke test's measurement: the peak memory of one real training step, and the line that reports it."""

from __future__ import annotations

import contextlib
import threading
import time

from core import rundir
from core.recipe import methods
from core.train.state import Run, RunOutcome


@contextlib.contextmanager
def _marked(trainer, marks, tracker):
    """The trainer's methods named in `marks` ((method name, phase) pairs; "a.b": method b of its attribute a)
    run as that phase of the measurement."""

    def wrap(original, phase):
        def marked(*args, **kwargs):
            with tracker.held_phase(phase):
                return original(*args, **kwargs)

        return marked

    def owner(name: str):
        obj = trainer
        for part in name.split(".")[:-1]:
            obj = getattr(obj, part)
        return obj, name.rsplit(".", 1)[-1]

    for name, phase in marks:
        obj, attr = owner(name)
        setattr(obj, attr, wrap(getattr(obj, attr), phase))
    try:
        yield
    finally:
        for name, _ in marks:
            delattr(*owner(name))  # the class's own method again


# Trainer.evaluate: the eval batches, then the callbacks' work at each evaluation (sub-phase "eval:callbacks": the
# samples callback's greedy answers, when it has any); GRPO's generation inside an evaluation is "eval:generation"
EVAL_MARKS = (("evaluate", "eval"), ("callback_handler.on_evaluate", "callbacks"))


@contextlib.contextmanager
def measure_peak(trainer, marks=()):
    """Yields a dict that gets peak_bytes / peak_phase / measured_by when the block (the training step of
    `trainer`, its model on its device) ends. `marks`: (trainer method, phase) pairs whose calls are a phase of
    their own (GRPO's generation: the method's `measure_phases`), so that the peak phase can be named.

    peak_bytes is comparable to the planner's tensor_peak_bytes: the most bytes live tensors hold at once in a
    *steady* step. The smoke step is the first one, where the optimizer makes its state (Adam's moments) only
    at the end; from the second step on that state is alive during forward and backward too, so the tracker's
    steady peak adds it there. The first step's own peak stays as first_step_peak_bytes. On CUDA torch's
    allocator peaks (first step) come next to it; without core.tracker, the process RSS rise (psutil) plus the
    model's own bytes, marked measured_by "rss".
    """
    import torch

    model = trainer.model
    result: dict = {}
    cuda = torch.cuda.is_available()
    try:
        from core.tracker import main_phase_peaks, track_live_tensors
    except Exception:
        track_live_tensors = None
    if track_live_tensors is not None:
        # The model is on its device already (Trainer moved it): its tensors are the baseline.
        with (
            track_live_tensors(model=model, device="cuda" if cuda else "cpu", auto_phases=True) as tracker,
            _marked(trainer, (*marks, *EVAL_MARKS), tracker),
        ):
            yield result
        step = tracker.result()
        peaks = main_phase_peaks(step.steady_phase_peaks)
        training = {k: v for k, v in peaks.items() if k != "eval"} or {"step": step.steady_peak_bytes}
        phase = max(training, key=training.get)
        result.update(
            # the training step's peak; the evaluation's beside it (its own phase)
            peak_bytes=int(training[phase]),
            peak_phase=phase,
            eval_peak_bytes=peaks.get("eval"),
            phase_peaks=peaks,
            # the evaluation's own moments: its generation (GRPO), the samples callback's answers
            eval_moments={k: int(v) for k, v in step.steady_phase_peaks.items() if k.startswith("eval:")},
            first_step_peak_bytes=int(step.peak_bytes),
            baseline_bytes=int(step.baseline_bytes),
            optimizer_state_bytes=int(step.optimizer_state_bytes),
            measured_by="tracker",
        )
        if step.cuda:
            result.update(
                cuda_peak_bytes=step.cuda.get("allocated_peak"),
                reserved_peak_bytes=step.cuda.get("reserved_peak"),
            )
        return
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        yield result
        torch.cuda.synchronize()
        result.update(
            peak_bytes=torch.cuda.max_memory_allocated(),
            reserved_peak_bytes=torch.cuda.max_memory_reserved(),
            peak_phase="step",
            measured_by="torch.cuda",
        )
        return
    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.005)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield result
    finally:
        done.set()
        t.join()
    result.update(peak_bytes=max(0, peak[0] - base) + model_bytes, peak_phase="step", measured_by="rss")


def smoke_line(smoke: dict) -> str:
    """What the Train page shows of a smoke test, in one line for the terminal."""

    def mib(n) -> str:
        return f"{n / 2**20:,.1f} MiB" if isinstance(n, (int, float)) else "n/a"

    def versus(peak, est) -> str:
        return (
            f" ({peak / est - 1:+.1%} vs the estimate {mib(est)})"
            if peak and est
            else " (no plan.json to compare)"
        )

    peak, sps = smoke.get("peak_bytes"), smoke.get("seconds_per_step")
    step = f"{sps:.2f} s per step" if isinstance(sps, (int, float)) else "n/a s per step"
    evaluated = (
        f"; eval step peak {mib(smoke['eval_peak_bytes'])}"
        f"{versus(smoke['eval_peak_bytes'], smoke.get('estimate_eval_bytes'))} at eval batch size "
        f"{smoke.get('eval_batch_size')}"
        if smoke.get("eval_peak_bytes")
        else ""
    )
    return (
        f"smoke test: measured peak {mib(peak)}{versus(peak, smoke.get('estimate_bytes'))}{evaluated}, {step} on "
        f"{smoke.get('device')}, batch size {smoke.get('batch_size') or 1} at max_length {smoke.get('max_length')} "
        f"(measured by {smoke.get('measured_by')})"
    )


def finish_smoke(run: Run, outcome: RunOutcome, step: int) -> dict:
    """smoke.json: the measured peak of the one step (outcome.peak) next to the plan's (plan.json, written for
    this step)."""
    cfg, run_dir, peak = run.cfg, run.run_dir, outcome.peak
    plan = rundir.read_plan(run_dir) or {}
    planned = {k: v for k, v in (plan.get("phases") or {}).items() if k != "eval"}
    result = {
        "state": "finished",
        "reason": None,
        "time": time.time(),
        "peak_bytes": peak.get("peak_bytes"),
        "peak_phase": peak.get("peak_phase"),
        "phase_peaks": peak.get("phase_peaks"),  # steady, per phase: the plan's `phases` beside them
        "measured_by": peak.get("measured_by"),
        "reserved_peak_bytes": peak.get("reserved_peak_bytes"),
        # how the steady peak came about: the first step's own peak, what was alive before it, and the
        # optimizer state it made (alive through every later step)
        "first_step_peak_bytes": peak.get("first_step_peak_bytes"),
        "baseline_bytes": peak.get("baseline_bytes"),
        "optimizer_state_bytes": peak.get("optimizer_state_bytes"),
        "cuda_peak_bytes": peak.get("cuda_peak_bytes"),
        "seconds_per_step": outcome.step_seconds[-1] if outcome.step_seconds else None,
        "device": run.prec.device.label,
        # the plan's training step (its evaluation is compared on its own)
        "estimate_bytes": max(planned.values()) if planned else plan.get("tensor_peak_bytes"),
        "estimate_reserved_bytes": plan.get("reserved_peak_bytes"),
        # one eval step after the training step (held-out rows only): measured and planned
        "eval_peak_bytes": peak.get("eval_peak_bytes"),
        "eval_moments": peak.get("eval_moments") or None,
        "estimate_eval_bytes": (plan.get("phases") or {}).get("eval"),
        "eval_batch_size": methods.get(cfg).smoke_eval_batch(cfg) if peak.get("eval_peak_bytes") else None,
        # GRPO has no max_length: its rows are a prompt and its completion
        "max_length": cfg["training"].get("max_length") or methods.get(cfg).sequence_length(cfg),
        "batch_size": methods.get(cfg).smoke_batch(cfg),
    }
    rundir.write_smoke(run_dir, result)
    with contextlib.suppress(OSError):  # the Trainer made an output folder that stays empty in smoke mode
        (run_dir / rundir.CHECKPOINTS).rmdir()
    reason = f"smoke test: one step at batch size {result['batch_size']}"
    rundir.write_status(run_dir, state="finished", reason=reason, step=step)
    return result
