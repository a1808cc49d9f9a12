"""`python -m core.estimate`: the memory bill of a plan (or of a run config) in a terminal.

python -m core.estimate --model meta-llama/Llama-2-7b-hf --tuning lora --batch-size 4 --seq-len 2048 --json
python -m core.estimate --config run.yaml [--data-lengths]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from core.estimate import cards
from core.estimate.bill import OUTSIDE_TORCH, estimate, estimate_for_lengths
from core.estimate.cli_flags import (
    EVAL_FIELDS,
    ROLLOUT_FIELDS,
    VLM_FIELDS,
    _multi_gpu_flags,
    _rollout_flags,
    _rollout_values,
    method_flags,
    method_values,
    recurrent_flags,
    recurrent_values,
    vlm_flags,
    vlm_values,
)
from core.estimate.fit import fit_search
from core.estimate.from_config import busy_gpus, card_for, plan_for_config
from core.estimate.levers import lever_savings, modelled_note, what_would_fit, with_every_lever
from core.estimate.moe_terms import moe_lines
from core.estimate.plan import Estimate, GiB, Plan, PlanError
from core.estimate.source import source_line
from core.estimate.specs import SpecError, preset_ids
from core.estimate.vlm_terms import vlm_lines
from core.fmt import command, gib
from core.recipe import methods
from core.recipe.config import ConfigError, default_config, load_config
from core.recipe.data import DataError
from core.recipe.findings import load_tokenizer_and_config
from core.recipe.mix_preview import data_preview

# The batch size and length a plan gets when none is given: the run config's own (the Estimate page's too)
RUN_DEFAULTS = default_config()["training"]


def format_table(est: Estimate, fit: dict | None = None, advice: list[dict] | None = None) -> str:
    lines = [
        f"Model {est.model_id}: {est.total_params:,} params, {est.trainable_params:,} trainable; "
        + planned_shape(est)
    ]
    lines.append(f"{'component':<26}{'bytes':>16}  {'size':>11}")
    for name, b in est.components.items():
        if b:
            note = (
                "  (outside torch)"
                if name in OUTSIDE_TORCH
                else NOTES.get(name, "")
                if est.generation
                else ""
            )
            lines.append(f"{name:<26}{b:>16,}  {gib(b, width=7)}{note}")
    lines.append("-" * 56)
    for label, b in (
        ("tensor peak", est.tensor_peak_bytes),
        ("reserved peak", est.reserved_peak_bytes),
        ("device total", est.device_total_bytes),
        ("GPU capacity", est.gpu_bytes),
    ):
        lines.append(f"{label:<26}{b:>16,}  {gib(b, width=7)}")
    if est.cpu_pinned_bytes:
        b = est.cpu_pinned_bytes
        lines.append(
            f"{'pinned CPU RAM':<26}{b:>16,}  {gib(b, width=7)}  (activation offloading; not on the card)"
        )
    d = est.distributed
    if d and d["cpu_offload_bytes"]:
        b = d["cpu_offload_bytes"]
        lines.append(f"{'CPU RAM (offloaded)':<26}{b:>16,}  {gib(b, width=7)}  (cpu_offload; per process)")
    lines.append(f"peak phase: {est.peak_phase};  KV cache per token: {est.kv_cache_bytes_per_token:,} bytes")
    if est.generation:
        lines += _generation_lines(est)
    if est.evaluation:
        lines += _evaluation_lines(est)
    if d:
        load = f"; load peak {gib(d['load_peak_bytes'])}" if d["load_peak_bytes"] else ""
        lines.append(f"{d['gpus']} GPUs, strategy {d['strategy']}: every figure above is per GPU{load}")
    per = " per GPU" if d else ""
    lines.append(f"verdict{per}: {est.verdict} ({est.fraction:.0%} of the card; aim for 85-90%)")
    if est.reference:
        lines.append(f"Reference model: {est.reference}")
    lines += moe_lines(est) + vlm_lines(est)
    if fit and "max_completion_len" in fit:
        lines.append(
            f"largest batch size at this length: {fit['max_batch_size']}; "
            f"longest completion at this batch size: {fit['max_completion_len']}"
        )
    elif fit:
        lines.append(
            f"largest batch size at this seq len: {fit['max_batch_size']}; "
            f"largest seq len at this batch size: {fit['max_seq_len']}"
        )
    if fit and "max_eval_batch_size" in fit:
        lines.append(
            f"largest eval batch (per_device_eval_batch_size) that fits: {fit['max_eval_batch_size']}"
        )
    for a in advice or []:
        combined = "combined: " if a.get("combined") else ""
        lines.append(f"  - {combined}{a['change']}: saves {a['saves_bytes'] / GiB:.2f} GiB -> {a['verdict']}")
        if a.get("costs"):
            lines.append(f"      cost: {a['costs']}")
    return "\n".join(lines)


def planned_shape(est: Estimate) -> str:
    """'batch size 4 x 512 tokens': the step the figures below are for (the flags' values or their defaults)."""
    plan = est.plan
    what = " (prompt + completion)" if est.generation else ""
    rows = f"; the largest batch {plan['batch_tokens']:,} tokens" if plan.get("batch_tokens") else ""
    return f"batch size {plan['batch_size']} x {plan['seq_len']:,} tokens{what}{rows}"


# what a generating method's terms are, next to their names
NOTES = {
    "lm_head_loss": "  (the completions' log-probs: fused LM head)",
    "rollout_batch": "  (the generation batch's ids, masks, log-probs)",
    "vllm_pool": "  (vLLM's share of the card)",
}


def _generation_lines(est: Estimate) -> list[str]:
    """The generation phase of a generating method (GRPO) and every phase's total: its terms show whatever the
    peak phase is."""
    g = est.generation
    others = ", ".join(f"{name} {gib(b)}" for name, b in g["moments"].items() if name != g["moment"])
    lines = [
        f"generation phase: {gib(g['bytes'])} at its {g['moment']} ({g['sequences']} completions, "
        f"{g['tokens']:,} tokens)" + (f"; its {others}" if others else "")
    ]
    static = ("weights", "quant_constants", "reference_model", "lora_params", "optimizer_states")
    for name, b in g["components"].items():
        if name not in static:
            lines.append(f"  {name:<24}{b:>16,}  {gib(b, width=7)}")
    lines.append("phases (tensors): " + ", ".join(f"{name} {gib(b)}" for name, b in est.phases.items()))
    return lines


def _evaluation_lines(est: Estimate) -> list[str]:
    """The evaluation phase (Trainer.evaluate: one eval batch without autograd, GRPO's generation of it, the
    samples callback's answers), whatever the peak phase is; said outright when it is the peak."""
    ev = est.evaluation
    others = ", ".join(f"{name} {gib(b)}" for name, b in ev["moments"].items() if name != ev["moment"])
    peak = est.peak_phase == "eval"
    lines = [
        f"evaluation phase: {gib(ev['bytes'])} at its {ev['moment']} (eval batch {ev['rows']})"
        + (f"; its {others}" if others else "")
        + ("; the run's peak: an evaluation holds more than a training step" if peak else "")
    ]
    static = ("weights", "quant_constants", "reference_model", "lora_params", "optimizer_states")
    if not peak:  # at the peak the table above lists its terms
        lines += [
            f"  {n:<24}{b:>16,}  {gib(b, width=7)}" for n, b in ev["components"].items() if n not in static
        ]
    if not est.generation:  # the generation lines list every phase already
        lines.append("phases (tensors): " + ", ".join(f"{name} {gib(b)}" for name, b in est.phases.items()))
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=command("estimate"), description="Estimate GPU memory of a fine-tune.")
    d = Plan()
    p.add_argument(
        "--model",
        default=None,
        help="a preset, a local model folder, or a Hub id ORG/NAME[@REVISION] (no weights read)",
    )
    p.add_argument("--list-models", action="store_true", help="print the bundled preset ids and exit")
    method_flags(p, d)
    p.add_argument(
        "--reference", "--dpo-reference", default=d.reference, help="preference methods: auto | copy"
    )
    p.add_argument(
        "--precompute-ref",
        "--dpo-precompute-ref",
        action="store_true",
        help="DPO/KTO: the reference's log-probs computed before training (precompute_ref_log_probs)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=RUN_DEFAULTS["per_device_train_batch_size"],
        help="rows per step per GPU (default %(default)s: a run config's, as on the Estimate page)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=RUN_DEFAULTS["max_length"],
        help="tokens per row (default %(default)s: a run config's max_length, as on the Estimate page)",
    )
    p.add_argument("--lora-r", type=int, default=d.lora_r)
    p.add_argument("--lora-alpha", type=int, default=d.lora_alpha)
    p.add_argument("--lora-dropout", type=float, default=d.lora_dropout)
    p.add_argument("--target-modules", default=d.target_modules, help="all-linear or e.g. q_proj,v_proj")
    p.add_argument(
        "--target-parameters",
        default=d.target_parameters,
        help="parameters LoRA wraps (peft target_parameters), e.g. a MoE's mlp.experts.gate_up_proj,mlp.experts.down_proj",
    )
    p.add_argument(
        "--quantize-experts",
        action=argparse.BooleanOptionalAction,
        default=d.quantize_experts,
        help="QLoRA of a MoE: its experts quantized on load too (a plan only: the engine cannot yet)",
    )
    p.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=d.gradient_checkpointing
    )
    p.add_argument("--optim", default=d.optim, help="TrainingArguments optim name")
    p.add_argument("--attn", default=d.attn, help="sdpa | eager")
    p.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=d.double_quant)
    p.add_argument("--quant-type", default=d.quant_type, help="nf4 | fp4")
    p.add_argument(
        "--prepare-kbit",
        action=argparse.BooleanOptionalAction,
        default=d.prepare_kbit,
        help="QLoRA: peft.prepare_model_for_kbit_training (plain Trainer); off: TRL's bf16 adapters",
    )
    p.add_argument(
        "--fused-lm-head",
        action=argparse.BooleanOptionalAction,
        default=d.fused_lm_head,
        help="TRL SFTTrainer's fused LM head (tiles); off: plain cross-entropy over the full logits",
    )
    levers = p.add_argument_group("memory levers (docs/planner.md, 'Fitting more on the same card')")
    for flag, text in (
        ("padding-free", "rows concatenated into one sequence (SFTConfig.padding_free)"),
        ("packing", "SFTConfig.packing"),
        ("activation-offloading", "saved activations to pinned CPU RAM (CUDA; modelled, not yet measured)"),
        ("liger", "Liger's fused RMSNorm/SwiGLU/RoPE (use_liger_kernel; CUDA; modelled, not yet measured)"),
    ):
        name = flag.replace("-", "_")
        levers.add_argument(
            f"--{flag}", action=argparse.BooleanOptionalAction, default=getattr(d, name), help=text
        )
    levers.add_argument("--packing-strategy", default=d.packing_strategy, help="bfd | bfd_split | wrapped")
    levers.add_argument(
        "--batch-tokens",
        type=int,
        default=d.batch_tokens,
        help="tokens in the largest batch your data forms (0: batch size x seq len, the bound)",
    )
    p.add_argument(
        "--config",
        help="plan a run config (run.yaml) through the engine's own mapping, on this machine's card unless "
        "--gpu-gb / --device say otherwise; --expandable-segments, --batch-tokens and --model (another model's "
        "shapes) still apply",
    )
    p.add_argument(
        "--data-lengths",
        action="store_true",
        help="with --config: tokenize the config's data (its model's tokenizer) and also plan the largest batch "
        "its real rows can form",
    )
    p.add_argument("--load-dtype", default=d.load_dtype, help="fp32 | bf16 | fp16")
    p.add_argument("--compute-dtype", default=d.compute_dtype, help="fp32 | bf16 | fp16")
    p.add_argument("--eval-kv-tokens", type=int, default=d.eval_kv_tokens)
    p.add_argument(
        "--gpu-gb",
        type=float,
        help=f"card capacity in GiB (default {d.gpu_gb:g}; with --config: this machine's card, as the trainer plans). "
        f"Cards as nvidia-smi reports them: {cards.help_line()}",
    )
    p.add_argument(
        "--expandable-segments", action=argparse.BooleanOptionalAction, default=d.expandable_segments
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help=f"default {d.device}; with --config: the device this machine trains on, as the trainer plans (a GPU "
        "when --gpu-gb is given)",
    )
    _multi_gpu_flags(p, d)
    _rollout_flags(p)
    vlm_flags(p, d)
    recurrent_flags(p)
    ev = p.add_argument_group("the evaluation (default: none; with --config: the config's)")
    ev.add_argument("--eval-batch-size", type=int, help="per_device_eval_batch_size of a run that evaluates")
    ev.add_argument(
        "--eval-samples", type=int, help="training.eval_samples: greedy answers at each evaluation"
    )
    ev.add_argument(
        "--eval-generations", type=int, help="GRPO's num_generations_eval (default num_generations)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, no usage dump
        raise _ArgError(message)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    parser.__class__ = _Parser
    try:
        args = parser.parse_args(argv)
    except _ArgError as exc:
        print(f"error: {exc} (see {command('estimate')} --help)", file=sys.stderr)
        return 2
    if args.list_models:
        print("\n".join(preset_ids()))
        return 0
    said = [
        f
        for f, v in (
            ("--tuning", args.tuning),
            ("--method", args.method),
            ("--objective", args.objective),
            ("--dpo", args.shorthand),
        )
        if v
    ]
    if args.config and said:  # the run config is the run: a flag beside it would be silently another plan
        print(
            f"error: {' and '.join(said)} cannot change a run config's plan: with --config the config says the "
            "tuning (lora.enabled, quantization.load_in_4bit) and the method; edit it, or plan with --model.",
            file=sys.stderr,
        )
        return 2
    try:
        method_values(args)  # --tuning and --method, their older spellings read with a note
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.model and not args.config:
        print(
            "error: --model is required: a preset id (see --list-models) or a local model folder "
            "(or --config run.yaml).",
            file=sys.stderr,
        )
        return 2
    if not args.config:
        args.gpu_gb = Plan.gpu_gb if args.gpu_gb is None else args.gpu_gb
        args.device = args.device or Plan.device
        for name in ("gpus", "strategy", "cpu_offload", *EVAL_FIELDS):
            if getattr(args, name) is None:
                setattr(args, name, getattr(Plan, name))
    skip = (
        "list_models",
        "json",
        "config",
        "data_lengths",
        "recurrent_kernels",
        *ROLLOUT_FIELDS,
        *VLM_FIELDS,
    )
    values = (
        {k: v for k, v in vars(args).items() if k not in skip}
        | _rollout_values(args)
        | recurrent_values(args)
    )
    if args.data_lengths and not args.config:
        print("error: --data-lengths reads a run config's data: give --config run.yaml too.", file=sys.stderr)
        return 2
    try:
        cfg = _load_run_config(args.config) if args.config else None
        here = cfg is not None and args.gpu_gb is None  # planned on this machine's own card(s)
        plan = _plan_from_config(cfg, args) if cfg else Plan.from_dict(values | vlm_values(args))
        est = estimate(plan)
        data_batch = _data_batch(cfg, plan) if args.data_lengths else None
        fit = fit_search(plan)
        advice = what_would_fit(plan) if est.verdict != "fits" else []
    except (PlanError, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for w in est.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for busy in busy_gpus(cfg, est.device_total_bytes) if here and plan.device == "cuda" else ():
        print(f"warning: {busy}", file=sys.stderr)
    note = modelled_note(plan)
    every = with_every_lever(plan)
    fit_every = fit_search(every) if every != plan else fit
    if args.json:
        out = {k: v for k, v in est.to_dict().items() if k != "phase_components"}
        out["fit_search"] = fit
        out["fit_search_every_lever"] = fit_every
        out["what_would_fit"] = advice
        out["levers"] = lever_savings(plan)
        out["data_batch"] = data_batch
        out["modelled_not_measured"] = note
        out["model_source"] = source_line(plan.model)
        print(json.dumps(out))
    else:
        print(format_table(est, fit, advice))
        print(source_line(plan.model))
        if data_batch:
            print(
                f"with the data's real lengths ({data_batch['rows']} rows): the largest batch holds "
                f"{data_batch['batch_tokens']:,} tokens -> device total {gib(data_batch['device_total_bytes'], width=7)}, "
                f"{data_batch['verdict']}"
            )
        if every != plan:
            longest = (
                f"longest completion {fit_every['max_completion_len']}"
                if "max_completion_len" in fit_every
                else f"largest seq len {fit_every['max_seq_len']}"
            )
            print(f"with every lever on: largest batch size {fit_every['max_batch_size']}, {longest}")
        if note:
            print(f"note: {note}")
    return 0


def _data_batch(cfg: dict, plan: Plan) -> dict:
    """The largest batch the config's data can form (its rows tokenized as a run tokenizes them) and its plan."""
    method = methods.get(cfg)
    if method.traits.reference or method.traits.generates:
        bound = "prompt + completion" if method.traits.generates else "max_length"
        raise PlanError(
            f"--data-lengths plans SFT rows; a {method.label} run's rows are planned at the {bound} bound."
        )
    try:
        tokenizer, _ = load_tokenizer_and_config(cfg["model"])
        # a mix of data.sources: the rows its draw takes (core.recipe.mix_preview)
        preview = data_preview(cfg, tokenizer, n=0, length_rows=100_000, max_length=plan.seq_len)
    except (DataError, OSError, ValueError) as exc:
        raise PlanError(
            f"--data-lengths: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    tokens, est = estimate_for_lengths(plan, preview["lengths"])
    return {
        "rows": len(preview["lengths"]),
        "batch_tokens": tokens,
        "device_total_bytes": est.device_total_bytes,
        "tensor_peak_bytes": est.tensor_peak_bytes,
        "verdict": est.verdict,
    }


def _load_run_config(path: str) -> dict:
    try:
        return load_config(path)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def _plan_from_config(cfg: dict, args) -> Plan:
    """The plan of a run config, through core.estimate.from_config (the engine's one mapping), on this machine's
    card unless --gpu-gb / --device name another: the plan the trainer writes to plan.json."""
    if args.device is None and args.gpu_gb is not None:
        args.device = "cuda"  # a card's size names a GPU: plan that card
    if args.gpu_gb is None or args.device is None:
        card = card_for(cfg)
        args.gpu_gb = card.gpu_gb if args.gpu_gb is None else args.gpu_gb
        args.device = args.device or card.device
    plan = plan_for_config(
        cfg,
        gpu_gb=args.gpu_gb,
        device=args.device,
        expandable_segments=args.expandable_segments,
        model=args.model,
    )
    given = {
        k: getattr(args, k)
        for k in ("gpus", "strategy", "cpu_offload", *EVAL_FIELDS)
        if getattr(args, k) is not None
    }
    given |= _rollout_values(args) | vlm_values(args) | recurrent_values(args)
    if args.batch_tokens:
        given["batch_tokens"] = args.batch_tokens
    return replace(plan, **given) if given else plan


if __name__ == "__main__":
    sys.exit(main())
