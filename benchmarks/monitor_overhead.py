"""Monitoring overhead: tokens/s of one tiny LoRA config through core.train (metrics callback, status writes,
GPU sampler) vs a plain TRL SFTTrainer with no extra callbacks. Goal: ratio >= 0.99.

Both sides run in this process, alternately (A B, B A, ...), on identical model, data and SFTConfig: the plain
side is built by the engine's own functions from the same validated run config (see run_plain), so the two cannot
drift apart when an engine default changes, and the script refuses to compare sides whose settings differ. Each
side's throughput is real tokens per second in steady state (from step 20 to the last step, clocked as
each batch is collated, identically on both sides), measured two ways: wall clock, and CPU time of the whole
process (every thread, the GPU sampler's included). On a shared machine the wall clock swings by tens
of percent with other people's jobs, while CPU time counts only the work this process did, so the goal is
checked on tokens per CPU-second and the wall-clock ratio is printed next to it. Enough steps make the fixed
start-up cost of train() (optimizer, dataloader) small and equal on both sides; medians of per-pair ratios.

    python benchmarks/monitor_overhead.py [--steps 300] [--pairs 5] [--samples N] [--control] [--quick]

With --samples N both sides hold rows out and evaluate, and core.train also generates greedy answers to N held-out
prompts at each evaluation (training.eval_samples, issue 24): the ratio is then the cost of the samples, printed.
With --control both sides are the plain one (an A/A run): the spread of its ratios is this machine's noise, what a
headline within it cannot resolve.

What is compared between the sides is what they train: every SFTConfig field and the model's checkpointing state,
with each run's folder and name masked (where a run writes and what it is called: output_dir, logging_dir, the
tracker project named after the run) and report_to left out (the engine's own logging, part of what is measured).

`--quick` (what the suite runs: the script still runs): 1 pair of 25-step runs; prints the headline, exit 0 even
on a goal miss (a toy run cannot judge a 1% goal), non-zero on an error or when the sides train different things.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL = 0.99
SKIP = 20  # steps left out at the start: optimizer creation, first-step allocations, lazy inits


class TimedCollator:
    """The trainer's own collator plus a clock reading per batch (one per step on both sides, ~1 us): throughput
    between batch SKIP and the last batch is steady state, without train()'s start-up and wind-down."""

    def __init__(self, inner):
        self.inner = inner
        self.tokens = 0
        self.marks: list[tuple[float, float, int]] = []  # (wall, cpu, tokens so far) before each batch

    def __call__(self, features):
        self.marks.append((time.perf_counter(), time.process_time(), self.tokens))
        self.tokens += sum(len(f["input_ids"]) for f in features)
        return self.inner(features)

    def steady(self) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second) from batch SKIP to the last batch."""
        (w0, c0, n0), (w1, c1, n1) = self.marks[SKIP], self.marks[-1]
        return (n1 - n0) / (w1 - w0), (n1 - n0) / (c1 - c0)


def timed(trainer) -> TimedCollator:
    """Wrap the collator SFTTrainer chose (the Trainer reads it when it builds the dataloader in train())."""
    trainer.data_collator = TimedCollator(trainer.data_collator)
    return trainer.data_collator


# What may differ between the sides beyond their run folder: the engine's own logging (TensorBoard when installed),
# which is part of what core.train's side costs
OWN_KEYS = ("report_to",)
SHOWN = ("trainer", "gradient_checkpointing", "optim", "bf16", "max_length", "per_device_train_batch_size")
RUN, RUN_NAME = "<run folder>", "<run name>"


def masked(value, run_dir: Path):
    """`value` with the run's folder and name masked: where a run writes (output_dir, logging_dir) and what it is
    called (a tracker's project, a run name) say nothing about what it trains."""
    if isinstance(value, str):
        return RUN_NAME if value == run_dir.name else value.replace(str(run_dir), RUN)
    if isinstance(value, list | tuple):
        return type(value)(masked(v, run_dir) for v in value)
    if isinstance(value, dict):
        return {k: masked(v, run_dir) for k, v in value.items()}
    return value


def settings(trainer, run_dir: Path) -> dict:
    """What the trainer trains: its class, every SFTConfig field but OWN_KEYS with the run's folder and name masked,
    the model's checkpointing state. A field is left out by what it holds (the run's own folder or name), not by
    its name: a new training setting or default is compared the day it appears."""
    args = {k: masked(v, run_dir) for k, v in trainer.args.to_dict().items() if k not in OWN_KEYS}
    return {
        "trainer": type(trainer).__name__,
        "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        **args,
    }


def make_assets(root: Path, seq_chars: int) -> tuple[Path, Path]:
    from core.demo.toy import build_tiny_model

    model = build_tiny_model(
        root / "model", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4
    )
    # Every row the same length: tokens per step are constant, so throughput is comparable across runs.
    rows = [{"text": "".join(chr(97 + (i * 7 + j) % 26) for j in range(seq_chars))} for i in range(512)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def run_config(model: Path, data: Path, steps: int, seq_chars: int, samples: int = 0) -> dict:
    """The benchmark's run config; with `samples`, both sides hold 10% of the rows out and evaluate every 25 steps,
    and core.train also writes greedy answers to `samples` held-out prompts at each evaluation (eval_samples)."""
    cfg = {
        "model": {"path": str(model)},
        "data": {"path": str(data)},
        "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
        "training": {
            "max_length": seq_chars + 2,
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1,
            "max_steps": steps,
            "logging_steps": 10,
            "save_steps": steps * 10,  # no checkpoint inside the timed region on either side
            "learning_rate": 1e-3,
            "lr_scheduler_type": "constant",
            "warmup_steps": 0,
        },
    }
    if samples:
        cfg["data"]["eval_split"] = 0.1
        cfg["training"].update(eval_steps=25, eval_samples=samples)
    return cfg


class CallbackClock:
    """CPU seconds spent inside core.train's own trainer callbacks (metrics lines, status writes, the stop and NaN
    checks): what the engine does per step that a plain SFTTrainer does not, measured directly rather than read
    from the difference of two noisy throughputs."""

    def __init__(self):
        self.cpu = 0.0

    def wrap(self, trainer):
        for callback in trainer.callback_handler.callbacks:
            if not type(callback).__module__.startswith("core."):
                continue
            for name in dir(callback):
                if name.startswith("on_"):
                    setattr(callback, name, self._timed(getattr(callback, name)))

    def _timed(self, method):
        def run(*args, **kwargs):
            c0 = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - c0

        return run


def run_core(cfg_path: Path, root: Path, i: int) -> tuple[tuple[float, float], dict, float]:
    """core.train.run.run_training as the CLI runs it; also the share of a step's CPU time its callbacks took."""
    import core.train.steps as engine  # where the run makes its trainer
    from core.train.run import StopFlag, run_training

    made, make_trainer, clock = [], engine.make_trainer, CallbackClock()

    def make_timed(*args, **kwargs):  # the same clock as the plain side; nothing else of core.train changes
        trainer = make_trainer(*args, **kwargs)
        made.append((timed(trainer), trainer))
        clock.wrap(trainer)
        return trainer

    engine.make_trainer = make_timed
    run_dir = root / f"core-{i}"
    try:
        summary = run_training(cfg_path, run_dir, stop=StopFlag())
    finally:
        engine.make_trainer = make_trainer
    collator, trainer = made[-1]
    return collator.steady(), settings(trainer, run_dir), clock.cpu / summary["train_cpu_seconds"]


def run_plain(cfg: dict, i: int, root: Path) -> tuple[tuple[float, float], dict]:
    """The same training with nothing of ours around it: no metrics callback, status writes, GPU sampler, NaN
    check, run lock or TensorBoard logging. Everything that decides *what* is trained is the engine's own code
    path, not a copy of its settings: the validated config, core.train's device/precision choice, its model
    loader, tokenizer set-up, data pipeline and make_trainer (SFTConfig from every training key, LoraConfig,
    SFTTrainer), so a new engine default (such as gradient checkpointing on) reaches both sides at once."""
    import transformers
    from transformers import AutoTokenizer

    from core.recipe.config import validate_config
    from core.recipe.data import prepare_datasets
    from core.train.model import choose_precision, load_model, make_trainer

    cfg = validate_config(cfg)
    prec = choose_precision(cfg)
    transformers.set_seed(cfg["training"]["seed"])
    tok = AutoTokenizer.from_pretrained(cfg["model"]["path"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # as core.train does
    train_ds, eval_ds = prepare_datasets(cfg, tok)
    train_ds = train_ds.remove_columns("length")
    eval_ds = eval_ds.remove_columns("length") if eval_ds is not None else None  # --samples: both evaluate
    run_dir = root / f"plain-{i}"
    trainer = make_trainer(
        cfg,
        prec,
        load_model(cfg, prec),
        tok,
        train_ds,
        eval_ds,
        run_dir=run_dir,
        report_to="none",
    )
    collator = timed(trainer)
    trainer.train()
    return collator.steady(), settings(trainer, run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--seq", type=int, default=62, help="characters per row (tokens = seq + 2)")
    parser.add_argument(
        "--samples",
        type=int,
        default=0,
        help="training.eval_samples on core.train's side (both sides evaluate every 25 steps): its cost, printed",
    )
    parser.add_argument(
        "--control", action="store_true", help="plain SFTTrainer on both sides: the machine's noise, printed"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 pair of short runs: the script still runs (goal not judged)"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.pairs = SKIP + 5, 1

    import datasets
    import torch
    import transformers
    import yaml

    torch.set_num_threads(1)  # one core per side: less sensitive to the other core's load
    # x86's slow path for denormal floats makes an operation's time depend on the values it meets (GPUs have
    # no such path); flushed on both sides, so throughput depends on the work, not on what the weights hold
    torch.set_flush_denormal(True)
    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = make_assets(root, args.seq)
        cfg = run_config(model, data, args.steps, args.seq, args.samples)
        cfg_path = root / "run.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        run_plain(
            run_config(model, data, SKIP + (2 if args.quick else 10), args.seq), -1, root
        )  # warm-up: first-run costs (lazy imports, caches)
        wall_ratios, cpu_ratios, callback_shares = [], [], []
        first = "plain (A/A)" if args.control else "core.train"
        for i in range(args.pairs):
            order = ("core", "plain") if i % 2 == 0 else ("plain", "core")
            tps, trained = {}, {}
            for side in order:
                if side == "core" and args.control:  # the A/A run: the plain side in core.train's slot
                    tps[side], trained[side] = run_plain(cfg, 100 + i, root)
                elif side == "core":
                    tps[side], trained[side], share = run_core(cfg_path, root, i)
                    callback_shares.append(share)
                else:
                    tps[side], trained[side] = run_plain(cfg, i, root)
            if trained["core"] != trained["plain"]:
                diff = {
                    k: (trained["core"].get(k), trained["plain"].get(k))
                    for k in trained["core"].keys() | trained["plain"].keys()
                    if trained["core"].get(k) != trained["plain"].get(k)
                }
                print(f"the sides train different things (core.train, plain): {diff}", file=sys.stderr)
                return 2
            if i == 0:
                on = {k: trained["core"][k] for k in SHOWN}
                print(f"both sides: {on}", flush=True)
            wall_ratios.append(tps["core"][0] / tps["plain"][0])
            cpu_ratios.append(tps["core"][1] / tps["plain"][1])
            callbacks = (
                ""
                if args.control
                else f"; core.train's callbacks {100 * callback_shares[-1]:.3f}% of its CPU time"
            )
            print(
                f"pair {i + 1}: wall tok/s {first} {tps['core'][0]:.0f} vs plain {tps['plain'][0]:.0f} "
                f"(ratio {wall_ratios[-1]:.4f}); per CPU-second {first} {tps['core'][1]:.0f} vs plain "
                f"{tps['plain'][1]:.0f} (ratio {cpu_ratios[-1]:.4f}){callbacks}",
                flush=True,
            )
    wall, ratio = statistics.median(wall_ratios), statistics.median(cpu_ratios)
    print(f"steps per run {args.steps}, pairs {args.pairs}, batch 8 x {args.seq + 2} tokens, torch threads 1")
    print(f"median wall-clock tokens/s ratio: {wall:.4f} (noisy on a shared machine; reported, not the goal)")
    if args.control:  # no core.train side: no callbacks to report
        print(
            f"monitor_overhead control (plain SFTTrainer / itself): median {ratio:.4f}, per-pair range "
            f"{min(cpu_ratios):.4f} - {max(cpu_ratios):.4f} (this machine's noise; no goal)"
        )
        return 0
    print(
        f"core.train's own callbacks (metrics, status, stop/NaN checks): median "
        f"{100 * statistics.median(callback_shares):.3f}% of its training CPU time"
    )
    if args.samples:  # the cost of the samples is printed, not held to the goal (it is generation, by design)
        print(
            f"monitor_overhead with eval_samples {args.samples} (both sides evaluating every 25 steps), tokens per "
            f"CPU-second ratio (core.train / plain SFTTrainer): {ratio:.4f} (printed; the goal is for samples off)"
        )
        return 0
    print(
        f"monitor_overhead tokens per CPU-second ratio (core.train / plain SFTTrainer): {ratio:.4f} (goal >= {GOAL}"
        + ("; --quick: not judged)" if args.quick else ")")
    )
    return 0 if ratio >= GOAL or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
