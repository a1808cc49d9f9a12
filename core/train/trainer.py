"""Train one run: `python -m core.train run.yaml --run-dir DIR [--resume] [--smoke]`.

An ordinary program (transformers Trainer + peft, bitsandbytes for QLoRA) whose only channel to the outside is
the run directory: status.json (state + reason), metrics.jsonl (one flushed line per log), gpu.jsonl (NVML at
1 Hz), checkpoints/, adapter/, smoke.json. The dashboard, a terminal or another machine run it the same way.

Signals: SIGTERM (or Ctrl+C) saves a checkpoint at the end of the current step and exits with state `stopped`;
`--resume` continues from the newest checkpoint in DIR/checkpoints with the same step count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from core.runs import rundir
from core.runs.rundir import latest_checkpoint, read_status, truncate_metrics, write_status
from core.train.config import ConfigError, dump_config, load_config
from core.train.data import IGNORE_INDEX, Collator, DataError, prepare_datasets

METRIC_KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm")
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED = 2, 1, 0


class TrainError(RuntimeError):
    """The run cannot go on; the message is the user-facing reason written to status.json."""


# ---- device and precision -----------------------------------------------------------------------------------


def choose_precision(cfg: dict) -> dict:
    """Device, load dtype and Trainer precision flags. On a CPU always float32 math (no bf16/fp16 autocast)."""
    import torch

    notes = []
    t, m = cfg["training"], cfg["model"]
    if torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
        # "auto" wants native bf16 (Ampere and newer: RTX 30xx/40xx, A6000, L40), not the slow emulation that
        # is_bf16_supported() also accepts by default (core.estimate.from_config plans "auto" as bf16 on such a card).
        bf16_native = torch.cuda.is_bf16_supported(including_emulation=False)
        bf16_ok = torch.cuda.is_bf16_supported()
        bf16 = bf16_native if t["bf16"] == "auto" else bool(t["bf16"])
        if bf16 and t["fp16"]:
            notes.append(
                "training.fp16 is true but training.bf16 is auto on a bf16 GPU: training in bf16 "
                "(set bf16: false to train in fp16)"
            )
        if bf16 and not bf16_ok:
            raise TrainError(
                "training.bf16 is true but this GPU has no bfloat16 support: set bf16: false, fp16: true."
            )
        fp16 = bool(t["fp16"]) and not bf16
        dtype = (
            m["dtype"] if m["dtype"] != "auto" else ("bfloat16" if bf16 else "float16" if fp16 else "float32")
        )
    else:
        device = "cpu"
        if t["bf16"] is True or t["fp16"]:
            notes.append("bf16/fp16 requested but there is no CUDA GPU: training in float32 on the CPU")
        bf16 = fp16 = False
        dtype = m["dtype"] if m["dtype"] != "auto" else "float32"
        if dtype == "float16":
            notes.append("float16 weights are not supported for CPU training: loading float32")
            dtype = "float32"
        from core.train.engine_args import CUDA_ONLY

        for key in CUDA_ONLY:
            if t.get(key):
                notes.append(f"training.{key} works on a CUDA GPU only: this CPU run goes without it")
    return {"device": device, "dtype": dtype, "bf16": bf16, "fp16": fp16, "notes": notes}


# ---- model --------------------------------------------------------------------------------------------------


def load_model(cfg: dict, prec: dict, path: str | None = None):
    """The base model as the run trains it: in the load dtype, 4-bit when asked (quantized where it lands), KV cache
    off. LoRA, the QLoRA preparation and the fused LM head are SFTTrainer's (make_trainer), so that the planner,
    the tracker and a run all see one model-building path."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.train.engine_args import bnb_config

    m = cfg["model"]
    kwargs = {
        "dtype": getattr(torch, prec["dtype"]),
        "attn_implementation": m["attn_implementation"],
        "trust_remote_code": m["trust_remote_code"],
    }
    quant = bnb_config(cfg, prec["dtype"])
    if quant is not None:
        kwargs["quantization_config"] = quant
        # 4-bit weights are quantized where they land: on the GPU choose_precision named (torch's current one)
        kwargs["device_map"] = (
            {"": torch.cuda.current_device()} if prec["device"].startswith("cuda") else {"": "cpu"}
        )
    model = AutoModelForCausalLM.from_pretrained(path or m["path"], **kwargs)
    model.config.use_cache = False  # the KV cache only costs memory in training
    return model


def make_trainer(
    cfg: dict,
    prec: dict,
    model,
    tokenizer,
    train_ds,
    eval_ds=None,
    run_dir=None,
    smoke=False,
    collator=None,
    callbacks=(),
    report_to=None,
):
    """The run's trainer: SFTTrainer, or DPOTrainer for method dpo. LoRA (peft_config) or full, TRL's QLoRA handling
    (no fp32 upcast; adapters in bf16), its fused LM head, every training key of the config as SFTConfig /
    DPOConfig. DPO's reference is the base with the adapter disabled (no second copy), a copy of the model for a
    full fine-tune (TRL's default), or model.reference_path. Used by core.train and core.measure."""
    from core.train.engine_args import lora_config, training_args

    args = training_args(cfg, run_dir, prec, smoke=smoke, has_eval=eval_ds is not None, report_to=report_to)
    kwargs = dict(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collator,
        processing_class=tokenizer,
        peft_config=lora_config(cfg),
        callbacks=list(callbacks),
    )
    if cfg.get("method") == "dpo":
        from trl import DPOTrainer

        reference = cfg["model"].get("reference_path")
        if reference:
            kwargs["ref_model"] = load_model(cfg, prec, path=reference)
        trainer = DPOTrainer(**kwargs)
    else:
        from trl import SFTTrainer

        trainer = SFTTrainer(**kwargs)
    _fp32_trainable(trainer.model, prec)
    return trainer


def _fp32_trainable(model, prec: dict):
    """fp16 mixed precision (CUDA only) needs float32 trainable weights: torch's GradScaler refuses float16
    gradients ("Attempting to unscale FP16 gradients"). peft makes the LoRA weights float32 already; trainable
    biases (lora.bias) and full fine-tuning on float16 weights would hit that at the first step."""
    if prec["fp16"]:
        import torch

        for p in model.parameters():
            if p.requires_grad and p.dtype == torch.float16:
                p.data = p.data.float()
    return model


# ---- the callback -------------------------------------------------------------------------------------------


class StopFlag:
    """Set by SIGTERM/SIGINT; checked at the end of each step (a signal handler must not save by itself)."""

    def __init__(self):
        self.signal: str | None = None

    def install(self):
        def handler(signum, _frame):
            self.signal = signal.Signals(signum).name

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        return self


def _make_callback_class():
    from transformers import TrainerCallback

    class RunCallback(TrainerCallback):
        """Writes metrics.jsonl and status.json; turns a stop signal or a NaN loss into a clean end."""

        def __init__(self, run_dir: Path, stop: StopFlag, smoke: bool, device: str, samples_per_step: int):
            self.run_dir, self.stop, self.smoke, self.device = run_dir, stop, smoke, device
            self.samples_per_step = samples_per_step
            self.nan_step: int | None = None
            self.stopped_at: int | None = None
            self.step_seconds: list[float] = []
            # A smoke test writes no metrics: its one step is not a training curve.
            self._fh = None if smoke else open(run_dir / rundir.METRICS, "a", encoding="utf-8")  # noqa: SIM115
            import psutil

            self._proc = psutil.Process()
            self._last_t = time.time()
            self._last_tokens = 0.0
            self._last_step = 0
            self._step_t0 = 0.0
            self._status_t = 0.0

        def close(self):
            if self._fh is not None:
                self._fh.close()

        def _status(self, **fields):
            write_status(self.run_dir, **fields)

        def on_train_begin(self, args, state, control, **kw):
            self._last_t, self._last_step = time.time(), state.global_step
            self._status(state="running", step=state.global_step, max_steps=state.max_steps)
            if self.stop.signal:  # signalled while loading: stop before the first step
                control.should_training_stop = True

        def on_step_begin(self, args, state, control, **kw):
            self._step_t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_seconds.append(time.perf_counter() - self._step_t0)
            if self.stop.signal and self.stopped_at is None:
                self.stopped_at = state.global_step
                control.should_training_stop = True
                control.should_save = not self.smoke
            now = time.time()
            if now - self._status_t > 1.0:  # at most one status write a second keeps the overhead invisible
                self._status_t = now
                self._status(step=state.global_step)

        def on_save(self, args, state, control, **kw):
            self._last_t = time.time()  # checkpoint writing is not training time: keep it out of tokens/s

        def on_evaluate(self, args, state, control, **kw):
            self._last_t = time.time()  # likewise evaluation

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if not any(k in logs for k in METRIC_KEYS):
                return  # the end-of-training summary (train_runtime, ...) is not a metric line
            now = time.time()
            rec = {"time": now, "step": state.global_step, "epoch": float(state.epoch or 0.0)}
            # every number the trainer logs: loss, learning rate, grad norm and TRL's own (mean_token_accuracy,
            # entropy, num_tokens, their eval_ twins); the end-of-run summary was filtered out above
            for key, value in logs.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in rec:
                    rec[key] = float(value)
            if "loss" in logs:
                dt = max(now - self._last_t, 1e-9)
                tokens = float(logs.get("num_tokens", self._last_tokens))
                rec["tokens_per_s"] = max(0.0, tokens - self._last_tokens) / dt
                rec["samples_per_s"] = (state.global_step - self._last_step) * self.samples_per_step / dt
                self._last_t, self._last_tokens, self._last_step = now, tokens, state.global_step
            rec.update(cuda_memory())
            rec["rss_bytes"] = self._proc.memory_info().rss  # CPU memory: the curve a run without a GPU has
            # json.dumps writes NaN for a NaN loss: the file stays readable by Python's json and the UI sees it.
            if self._fh is not None:
                self._fh.write(json.dumps(rec) + "\n")
                self._fh.flush()
            loss = logs.get("loss")
            if loss is not None and not math.isfinite(loss) and self.nan_step is None:
                self.nan_step = state.global_step
                control.should_training_stop = True
                control.should_save = False  # a NaN checkpoint is worthless
            self._status(step=state.global_step)

    return RunCallback


def cuda_memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {
        "cuda_allocated": torch.cuda.memory_allocated(),
        "cuda_reserved": torch.cuda.memory_reserved(),
        "cuda_peak": torch.cuda.max_memory_allocated(),
    }


# ---- peak memory for smoke mode (one small function, so the measuring method can be swapped) ----------------


@contextlib.contextmanager
def measure_peak(model):
    """Yields a dict that gets peak_bytes / peak_phase / measured_by when the block (the training step) ends.

    peak_bytes is comparable to the planner's tensor_peak_bytes: the most bytes live tensors hold at once in a
    *steady* step. The smoke step is the first one, where the optimizer makes its state (Adam's moments) only
    at the end; from the second step on that state is alive during forward and backward too, so the tracker's
    steady peak adds it there. The first step's own peak stays as first_step_peak_bytes. On CUDA torch's
    allocator peaks (first step) come next to it; without core.measure.tracker, the process RSS rise (psutil) plus the
    model's own bytes, marked measured_by "rss".
    """
    import torch

    result: dict = {}
    cuda = torch.cuda.is_available()
    try:
        from core.measure.tracker import track_live_tensors
    except Exception:
        track_live_tensors = None
    if track_live_tensors is not None:
        # The model is on its device already (Trainer moved it): its tensors are the baseline.
        with track_live_tensors(model=model, device="cuda" if cuda else "cpu", auto_phases=True) as tracker:
            yield result
        step = tracker.result()
        result.update(
            peak_bytes=int(step.steady_peak_bytes),
            peak_phase=step.steady_peak_phase,
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


class SmokeCollator(Collator):
    """Fills every batch up to training.max_length: the smoke step then has the longest rows a run can meet, the
    sequence length the planner's estimate is made for (a batch of one short row would measure far less).

    The filler is attended to (attention_mask 1) but not trained on (labels -100): a row that really is
    max_length long has no padding mask either, and a mask would switch sdpa to a slower path that keeps
    more. The smoke step's weights are never saved, so what it attends to does not matter."""

    def __init__(self, pad_token_id: int, max_length: int):
        super().__init__(pad_token_id)
        self.max_length = max_length

    def __call__(self, features: list[dict]) -> dict:
        batch = super().__call__(features)  # counts the real tokens, as in a run
        fill = {"input_ids": self.pad_token_id, "attention_mask": 1, "labels": IGNORE_INDEX}
        return _fill_to(batch, self.max_length, fill)


def _fill_to(batch: dict, max_length: int, fill: dict) -> dict:
    """Each tensor of `fill` in `batch` widened to max_length columns with its fill value (the smoke step's
    rows are as long as the longest a run can meet)."""
    import torch

    extra = max_length - batch["input_ids"].shape[1]
    if extra > 0:
        for key, value in fill.items():
            pad = torch.full((batch[key].shape[0], extra), value, dtype=batch[key].dtype)
            batch[key] = torch.cat([batch[key], pad], dim=1)
    return batch


def PairSmokeCollator(pad_token_id: int, max_length: int):
    """SmokeCollator for DPO: TRL's DataCollatorForPreference, then the chosen and the rejected row filled up to
    training.max_length (attended, not scored: completion_mask 0), so the smoke step is the longest a run meets."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class _Filled(DataCollatorForPreference):
        def torch_call(self, examples):
            fill = {"input_ids": pad_token_id, "attention_mask": 1, "completion_mask": 0}
            return _fill_to(super().torch_call(examples), max_length, fill)

    return _Filled(pad_token_id=pad_token_id, max_length=max_length)


# ---- the run ------------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _write_plan(cfg: dict, run_dir: Path) -> None:
    """plan.json for a run started without one (from a terminal): the Monitor draws it on the memory chart."""
    from core.estimate.bill import PlanError
    from core.estimate.from_config import plan_json
    from core.estimate.specs import SpecError

    try:
        rundir.write_plan(run_dir, plan_json(cfg))
    except (PlanError, SpecError) as exc:
        print(f"plan.json: not written: {exc}", flush=True)


def _report_to(cfg: dict, run_dir: Path, smoke: bool):
    """TensorBoard next to the run's own files when it is installed, unless the config says report_to."""
    if smoke or "report_to" in cfg["training"]:
        return None
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return "none"
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(run_dir / "tensorboard"))
    return "tensorboard"


def quiet_progress_bars():
    """Progress bars would bury the stderr tail the launcher shows when a run fails."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def run_training(
    config_path: str | os.PathLike,
    run_dir: str | os.PathLike,
    resume: bool = False,
    smoke: bool = False,
    stop: StopFlag | None = None,
    keep_lock: bool = False,
) -> dict:
    """Train and return a summary; raises ConfigError/DataError/TrainError for the user's problems, RunRefused
    and RunBusy (core.runs.rundir; touching nothing) for a run directory that cannot be trained into.

    The process holds the run's lock from here to the end: that, not a pid, is what makes the run "running".
    keep_lock (the CLI): hold it until the process exits, so the run reads as ended only once it is gone."""
    run_dir = Path(run_dir).resolve()
    rundir.check_run_dir(run_dir, resume)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise rundir.RunRefused(f"--run-dir {run_dir} cannot be created ({exc.strerror}).") from None
    lock_fd = rundir.adopt_claim() or rundir.claim(run_dir)
    try:
        rundir.write_pid_info(run_dir)
        return _run_training(config_path, run_dir, resume, smoke, stop)
    finally:
        if not keep_lock:
            os.close(lock_fd)  # in-process callers: the run is seen ended from here on


def _run_training(config_path, run_dir: Path, resume: bool, smoke: bool, stop: StopFlag | None) -> dict:
    import transformers
    from transformers import AutoTokenizer

    from core.monitor.gpu import GpuSampler
    from core.train.preflight import has_errors, run_preflight

    quiet_progress_bars()
    if stop is None:
        stop = StopFlag().install() if threading.current_thread() is threading.main_thread() else StopFlag()
    cfg = load_config(config_path)
    from core.train.preflight import check_model_folder

    problem = check_model_folder(cfg["model"]["path"])  # before anything is written or loaded
    if problem:
        raise ConfigError(problem)
    if (
        Path(config_path).resolve() != (run_dir / rundir.CONFIG).resolve()
        and not (run_dir / rundir.CONFIG).exists()
    ):
        dump_config(cfg, run_dir / rundir.CONFIG)  # the run dir must say what it ran

    if not smoke and rundir.read_plan(run_dir) is None:
        _write_plan(cfg, run_dir)
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        print("resume: no checkpoint in checkpoints/ yet: starting from step 0", flush=True)
    if not smoke:
        truncate_metrics(run_dir, int(checkpoint.name.split("-")[-1]) if checkpoint else 0)
    prec = choose_precision(cfg)
    status = {"state": "starting", "reason": None, "step": 0, "max_steps": None, "ended": None}
    if not resume or read_status(run_dir) is None:
        status["started"] = time.time()
    write_status(run_dir, device=prec["device"], precision=prec["dtype"], smoke=smoke, **status)
    print(
        f"device: {prec['device']}  weights: {prec['dtype']}  bf16: {prec['bf16']}  fp16: {prec['fp16']}",
        flush=True,
    )
    for note in prec["notes"]:
        print(f"note: {note}", flush=True)

    transformers.set_seed(cfg["training"]["seed"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            cfg["model"]["path"], trust_remote_code=cfg["model"]["trust_remote_code"]
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.path: the tokenizer in {cfg['model']['path']} does not load ({_first_line(exc)})."
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss anyway
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(
        cfg["model"]["path"], trust_remote_code=cfg["model"]["trust_remote_code"]
    )
    findings = run_preflight(cfg, tokenizer, model_config)
    for f in findings:
        print(f"preflight: {f}", flush=True)
    if has_errors(findings):
        raise DataError(
            "preflight found errors: " + " | ".join(str(f) for f in findings if f.level == "error")
        )
    dpo = cfg["method"] == "dpo"
    if dpo:  # prompt/chosen/rejected pairs: DPOTrainer tokenizes them itself
        from core.train.prefdata import prepare_pair_datasets

        train_ds, eval_ds = prepare_pair_datasets(cfg)
    else:
        train_ds, eval_ds = prepare_datasets(cfg, tokenizer)
        # pre-tokenized with the prompt masked (labels -100): SFTTrainer uses input_ids/labels as they are
        train_ds = train_ds.remove_columns("length")
        if eval_ds is not None:
            eval_ds = eval_ds.remove_columns("length")

    sampler = GpuSampler(
        run_dir / rundir.GPU,
        interval=1.0,
        watch_pid=os.getpid(),
        on_unavailable=lambda why: print(f"gpu.jsonl: not written: {why}", flush=True),
    ).start()
    t = cfg["training"]
    collator = None
    if smoke:
        smoke_collator = PairSmokeCollator if dpo else SmokeCollator
        collator = smoke_collator(tokenizer.pad_token_id, t["max_length"])
    samples_per_step = 1 if smoke else t["per_device_train_batch_size"] * t["gradient_accumulation_steps"]
    callback = _make_callback_class()(run_dir, stop, smoke, prec["device"], samples_per_step)
    try:
        try:
            model = load_model(cfg, prec)
        except (OSError, ValueError) as exc:  # a folder that passed the checks but still does not load
            raise ConfigError(
                f"model.path: {cfg['model']['path']} does not load ({_first_line(exc)})."
            ) from None
        trainer = make_trainer(
            cfg,
            prec,
            model,
            tokenizer,
            train_ds,
            eval_ds,
            run_dir=run_dir,
            smoke=smoke,
            collator=collator,
            callbacks=[callback],
            report_to=_report_to(cfg, run_dir, smoke),
        )
        model = trainer.model
        if hasattr(model, "print_trainable_parameters"):
            model.print_trainable_parameters()
        with measure_peak(model) if smoke else contextlib.nullcontext({}) as peak:
            t0, cpu0 = time.perf_counter(), time.process_time()
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
            train_seconds, train_cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        sampler.stop()
        callback.close()

    step = trainer.state.global_step
    summary = {
        "step": step,
        "max_steps": trainer.state.max_steps,
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,  # all threads of this process (the GPU sampler's too)
        "tokens": int(callback._last_tokens),
        "device": prec["device"],
    }
    if callback.nan_step is not None:
        raise TrainError(f"loss became NaN at step {callback.nan_step}")
    if smoke:
        plan = rundir.read_plan(run_dir) or {}
        smoke_result = {
            "state": "finished",
            "reason": None,
            "time": time.time(),
            "peak_bytes": peak.get("peak_bytes"),
            "peak_phase": peak.get("peak_phase"),
            "measured_by": peak.get("measured_by"),
            "reserved_peak_bytes": peak.get("reserved_peak_bytes"),
            # how the steady peak came about: the first step's own peak, what was alive before it, and the
            # optimizer state it made (alive through every later step)
            "first_step_peak_bytes": peak.get("first_step_peak_bytes"),
            "baseline_bytes": peak.get("baseline_bytes"),
            "optimizer_state_bytes": peak.get("optimizer_state_bytes"),
            "cuda_peak_bytes": peak.get("cuda_peak_bytes"),
            "seconds_per_step": callback.step_seconds[-1] if callback.step_seconds else None,
            "device": prec["device"],
            "estimate_bytes": plan.get("tensor_peak_bytes"),
            "estimate_reserved_bytes": plan.get("reserved_peak_bytes"),
            "max_length": cfg["training"]["max_length"],
        }
        rundir.write_smoke(run_dir, smoke_result)
        with contextlib.suppress(OSError):  # the Trainer made an output folder that stays empty in smoke mode
            (run_dir / rundir.CHECKPOINTS).rmdir()
        write_status(run_dir, state="finished", reason="smoke test: one step at batch size 1", step=step)
        return {**summary, "state": "finished", "smoke": smoke_result}
    if callback.stopped_at is not None:
        reason = f"stopped by {stop.signal} at step {step}; saved checkpoints/checkpoint-{step}; continue with --resume"
        write_status(run_dir, state="stopped", reason=reason, step=step)
        return {**summary, "state": "stopped"}
    if stop.signal and step == 0:  # signalled before the first step ended: nothing to save
        write_status(
            run_dir, state="stopped", reason=f"stopped by {stop.signal} before the first step", step=0
        )
        return {**summary, "state": "stopped"}
    # A signal after the last step (while saving) does not undo a finished run: the adapter is still saved.
    save_final(trainer, tokenizer, run_dir, cfg)
    write_status(run_dir, state="finished", reason=None, step=step)
    return {**summary, "state": "finished"}


def save_final(trainer, tokenizer, run_dir: Path, cfg: dict) -> Path:
    """The adapter (peft format) + tokenizer into DIR/adapter, written to a temp folder then renamed."""
    import shutil

    name = rundir.ADAPTER if cfg["lora"]["enabled"] else rundir.MODEL
    final, tmp = run_dir / name, run_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def report_failure(run_dir: Path, reason: str, smoke: bool) -> None:
    """failed + reason into status.json (and into smoke.json for a smoke test)."""
    if not run_dir.is_dir():
        return
    if smoke:
        rundir.write_smoke(run_dir, {"state": "failed", "reason": reason, "time": time.time()})
    write_status(run_dir, state="failed", reason=reason)


def dry_run(config_path: str, gpu_gb: float | None = None) -> int:
    """Everything a launch checks, without a model's weights: the config (by the libraries' own classes), the
    data against the tokenizer and the model config, and the plan. Prints the plan as JSON."""
    from core.estimate.bill import PlanError
    from core.estimate.from_config import plan_json
    from core.estimate.specs import SpecError
    from core.train.config import check_with_libraries
    from core.train.preflight import check_model_folder, has_errors, load_tokenizer_and_config, run_preflight

    try:
        cfg = load_config(config_path)
        check_with_libraries(cfg)
        problem = check_model_folder(cfg["model"]["path"])
        if problem:
            raise ConfigError(problem)
        tokenizer, model_config = load_tokenizer_and_config(cfg["model"])
        findings = run_preflight(cfg, tokenizer, model_config)
        for f in findings:
            print(f"preflight: {f}", file=sys.stderr, flush=True)
        if has_errors(findings):
            first = next(f for f in findings if f.level == "error")
            raise DataError(f"preflight: {first}")
        plan = plan_json(cfg, gpu_gb)
    except (ConfigError, DataError, PlanError, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except (OSError, ValueError) as exc:  # the model folder's tokenizer or config.json could not be read
        print(f"error: model.path: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    print(json.dumps(plan, indent=1, default=str), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="run config YAML (its sections and defaults: core/train/config.py)")
    parser.add_argument("--run-dir", help="the run directory to write into (not needed with --dry-run)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in the run dir"
    )
    parser.add_argument("--smoke", action="store_true", help="one step at batch size 1: measure peak memory")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, run the data preflight and print the plan (plan.json's object); no training",
    )
    parser.add_argument(
        "--gpu-gb", type=float, help="plan for a card of this many GiB (default: this machine's)"
    )
    stop = StopFlag().install()  # first thing: a stop during the slow imports must not kill us mid-write
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run(args.config, args.gpu_gb)
    if not args.run_dir:
        print("error: give --run-dir DIR (the folder the run writes into), or --dry-run.", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = Path(args.run_dir)
    mode = " (smoke test)" if args.smoke else " (resume)" if args.resume else ""
    print(f"core.train: pid {os.getpid()} training {run_dir}{mode}", file=sys.stderr, flush=True)
    try:
        summary = run_training(
            args.config, run_dir, resume=args.resume, smoke=args.smoke, stop=stop, keep_lock=True
        )
    except (rundir.RunRefused, rundir.RunBusy) as exc:  # not our run directory to write into: touch nothing
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except (ConfigError, DataError, TrainError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        report_failure(run_dir, str(exc), args.smoke)
        return EXIT_BAD_INPUT if isinstance(exc, (ConfigError, DataError)) else EXIT_FAILED
    except Exception as exc:
        traceback.print_exc()
        reason = f"{type(exc).__name__}: {exc}"
        report_failure(run_dir, reason, args.smoke)
        print(f"error: {reason}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print(f"run {summary['state']} at step {summary['step']}", flush=True)
    if args.smoke:
        print(smoke_line(summary.get("smoke") or {}), flush=True)
    return EXIT_STOPPED


def smoke_line(smoke: dict) -> str:
    """What the Train page shows of a smoke test, in one line for the terminal."""

    def mib(n) -> str:
        return f"{n / 2**20:,.1f} MiB" if isinstance(n, (int, float)) else "n/a"

    peak, est, sps = smoke.get("peak_bytes"), smoke.get("estimate_bytes"), smoke.get("seconds_per_step")
    vs = (
        f" ({peak / est - 1:+.1%} vs the estimate {mib(est)})"
        if peak and est
        else " (no plan.json to compare)"
    )
    step = f"{sps:.2f} s per step" if isinstance(sps, (int, float)) else "n/a s per step"
    return (
        f"smoke test: measured peak {mib(peak)}{vs}, {step} on {smoke.get('device')}, batch size 1 at "
        f"max_length {smoke.get('max_length')} (measured by {smoke.get('measured_by')})"
    )


if __name__ == "__main__":
    sys.exit(main())
