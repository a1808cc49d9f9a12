"""The flag groups of `python -m core.estimate` (core.estimate.cli) that need more than one line: the tuning
and the method (with their older spellings), a generating method's rollouts, several GPUs, a vision-language
model's images."""

from __future__ import annotations

import argparse
import sys

from core.estimate.plan import RECURRENT_KERNELS, TUNINGS, VLLM_MODES, Plan, PlanError
from core.recipe import methods
from core.recipe.config_keys import STRATEGIES

EVAL_FIELDS = ("eval_batch_size", "eval_samples", "eval_generations")
ROLLOUT_FIELDS = (
    "completion_len",
    "num_generations",
    "generation_batch",
    "kl_beta",
    "old_logps",
    "vllm",
    "vllm_fraction",
    "vllm_sleep",
)


def method_flags(p: argparse.ArgumentParser, d: Plan) -> None:
    """--tuning full|lora|qlora and --method sft|dpo|kto|grpo (None unless given: method_values sets them).
    Older spellings still read: --method full|lora|qlora (the value sets are disjoint) and --objective; --dpo
    stays."""
    p.add_argument("--tuning", choices=TUNINGS, help=f"full | lora | qlora (default {d.tuning})")
    p.add_argument(
        "--method",
        help="the training method: sft, dpo (chosen + rejected + reference), kto (rated answers + "
        f"reference) or grpo (prompts + rewards; default {d.method})",
    )
    p.add_argument("--objective", help=argparse.SUPPRESS)  # the older name of --method
    p.add_argument(
        "--dpo", dest="shorthand", action="store_const", const="dpo", help="the same as --method dpo"
    )


def method_values(args) -> None:
    """args.tuning and args.method from the flags, older spellings read with a one-line note on stderr;
    PlanError where two flags disagree or a method is unknown."""
    if args.method in TUNINGS:
        print(
            f"note: --method {args.method} is the older spelling of --tuning {args.method} (--method is now "
            "sft, dpo, kto or grpo).",
            file=sys.stderr,
        )
        _one("--tuning", args.tuning, args.method)
        args.tuning, args.method = args.method, None
    if args.objective is not None:
        print(
            f"note: --objective is the older spelling of --method (--method {args.objective}).",
            file=sys.stderr,
        )
        _one("--method", args.method, args.objective)
        args.method = args.objective
    if args.shorthand:  # --dpo
        _one("--method", args.method, args.shorthand)
        args.method = args.shorthand
    if args.method is not None and args.method not in methods.NAMES:
        raise PlanError(f"--method {args.method!r} is not one of {', '.join((*methods.NAMES, *TUNINGS))}.")
    args.tuning = args.tuning or Plan.tuning
    args.method = args.method or Plan.method
    del args.objective, args.shorthand


def _one(flag: str, given, other) -> None:
    if given is not None and given != other:
        raise PlanError(f"{flag} {given} and {flag} {other} both given: give one.")


def _rollout_flags(p: argparse.ArgumentParser) -> None:
    """A generating method's rollouts (GRPO): None unless given (the method's defaults, or the config's)."""
    g = p.add_argument_group(
        "a generating method's rollouts (--method grpo: --seq-len is prompt + completion)"
    )
    g.add_argument("--completion-len", type=int, help="max_completion_length (default: the method's, 256)")
    g.add_argument("--num-generations", type=int, help="completions per prompt (default 8)")
    g.add_argument(
        "--generation-batch", type=int, help="completions generated at once per GPU (default: --batch-size)"
    )
    g.add_argument(
        "--kl-beta", type=float, help="beta; above 0 the reference's log-probs are taken (default 0)"
    )
    g.add_argument(
        "--old-logps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the old policy's log-probs (an update between two generations, or vLLM)",
    )
    g.add_argument("--vllm", choices=VLLM_MODES, help="off (transformers generate), colocate or server")
    g.add_argument("--vllm-fraction", type=float, help="vllm_gpu_memory_utilization (default 0.3)")
    g.add_argument(
        "--vllm-sleep", action=argparse.BooleanOptionalAction, default=None, help="vllm_enable_sleep_mode"
    )


def _rollout_values(args) -> dict:
    """The rollout fields given on the command line, over the method's defaults (its run-config defaults through
    its own mapping) for a generating method."""
    given = {k: getattr(args, k) for k in ROLLOUT_FIELDS if getattr(args, k) is not None}
    method = methods.get(args.method)
    if not method.traits.generates or args.config:
        return given
    training = {"gradient_accumulation_steps": 1, **method.defaults}
    return {**method.plan_shape({"training": training}, args.batch_size, 1, False), **given}


def _multi_gpu_flags(p: argparse.ArgumentParser, d: Plan) -> None:
    """--gpus, --strategy, --cpu-offload: None unless given, so that --config keeps its distributed section."""
    multi = p.add_argument_group("several GPUs (the run config's distributed section)")
    multi.add_argument(
        "--gpus",
        type=int,
        help=f"processes (GPUs) over every machine; the figures are then per GPU (default {d.gpus}; with "
        "--config: the config's)",
    )
    multi.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help=f"how they share the model: auto (DDP when one card holds the plan, else FSDP), ddp, fsdp, "
        f"deepspeed_zero3 (default {d.strategy}; with --config: the config's)",
    )
    multi.add_argument(
        "--cpu-offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fsdp / deepspeed_zero3: parameters, gradients and optimizer states in CPU RAM",
    )


def vlm_flags(p: argparse.ArgumentParser, d: Plan) -> None:
    """A vision-language model's images (ignored for a language model)."""
    g = p.add_argument_group(
        "a vision-language model's images (Qwen2/2.5/3-VL, Qwen3.5, Gemma 3, Idefics3, SmolVLM, LLaVA)"
    )
    g.add_argument(
        "--image-size",
        help=f"WxH pixels of each image before the processor resizes it (default {d.image_width}x{d.image_height})",
    )
    g.add_argument(
        "--max-pixels",
        type=int,
        help="Qwen-VL: the processor's max_pixels (default: the processor's own, 12,845,056 for Qwen2/2.5-VL)",
    )
    g.add_argument("--images-per-row", type=int, help=f"images in each row (default {d.images_per_row})")
    g.add_argument(
        "--pan-and-scan",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Gemma 3: the processor also crops a wide or tall image (do_pan_and_scan; default off)",
    )
    g.add_argument(
        "--vision-frozen",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the vision tower and projector frozen (default; LoRA on the language model only) or trained",
    )


def recurrent_flags(p: argparse.ArgumentParser) -> None:
    """Which path a hybrid's recurrent layers run on the target machine (ignored for a model without them)."""
    p.add_argument(
        "--recurrent-kernels",
        choices=RECURRENT_KERNELS,
        help="Gated DeltaNet / Mamba-2 / short-conv layers: their CUDA kernels (flash-linear-attention, mamba-ssm, "
        "causal-conv1d installed on the target machine), transformers' torch code, or auto (default: what is "
        "installed here, kernels on CUDA only)",
    )


def recurrent_values(args) -> dict:
    return {"recurrent_kernels": args.recurrent_kernels} if args.recurrent_kernels else {}


def vlm_values(args) -> dict:
    """The image fields given on the command line; PlanError for a size that is not WxH."""
    out = {}
    if args.image_size:
        try:
            w, h = (int(x) for x in args.image_size.lower().split("x"))
        except ValueError:
            raise PlanError(
                f"--image-size '{args.image_size}' is not WxH in pixels, e.g. 1024x768."
            ) from None
        out.update(image_width=w, image_height=h)
    for name in ("max_pixels", "images_per_row", "vision_frozen", "pan_and_scan"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


VLM_FIELDS = ("image_size", "max_pixels", "images_per_row", "vision_frozen", "pan_and_scan")
