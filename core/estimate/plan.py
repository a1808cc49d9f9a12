"""The planner's input and output: a `Plan` (one training configuration, serialisable, built from a run config by
core.estimate.from_config), its validation, the shape of the batch it trains on, and the `Estimate` the bill
returns. The constants of the memory model live here too (docs/design/memory-model.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from core.precision import BYTES
from core.recipe import methods
from core.recipe.config_keys import STRATEGIES

GiB = 2**30
DTYPE_BYTES = BYTES  # core.precision's one dtype table
TUNINGS = ("full", "lora", "qlora")  # what trains: every weight, a LoRA adapter, one on a 4-bit base
ATTN = ("sdpa", "eager", "flash")  # flash: flash_attention_2/3 (varlen kernels: no mask, no score matrix)
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # trl SFTConfig.packing_strategy
# trl 1.16 OffloadActivations: saved tensors of at least 1024 bytes go to pinned CPU memory; the last five stay
# on the GPU while their copies are in flight (max_fwd_stash_size=5)
OFFLOAD_STASH = 5
QUANT_TYPES = ("nf4", "fp4")
FIT_LIMIT = 0.90  # at most 90% of the card: >=10% headroom for estimate error and allocator spikes
TARGET_LOW = 0.85  # the fit search aims at 85-90% of the card
CUDA_CONTEXT_BYTES = 400 * 2**20  # 300-450 MB with lazy module loading (torch>=1.13, CUDA>=11.7)
# Reserved minus allocated, as a share of the bytes that come and go within a step (activations, logits).
FRAGMENTATION = 0.20
FRAGMENTATION_EXPANDABLE = 0.05  # expandable_segments maps pages into one segment: little is stranded
NF4_BLOCK = 64  # bitsandbytes 4-bit blocksize used by transformers
DQ_BLOCK = 256  # double quantization: 8-bit absmax, one fp32 scale per 256 blocks
BNB8_MIN_SIZE = 4096  # bitsandbytes 8-bit optimizers keep smaller tensors in 32-bit
BNB8_BLOCK = 256  # blockwise 8-bit optimizer states: one fp32 absmax per 256 values
PAGED_MIN_SIZE = 100_000  # bitsandbytes pages only state tensors with at least 1e5 elements

# TrainingArguments optim name -> (states per element, bytes per state or None = parameter dtype, kind)
OPTIMIZERS = {
    "adamw_torch": (2, None, "foreach"),
    "adamw_torch_fused": (2, None, "fused"),
    "adamw_torch_xla": (2, None, "foreach"),
    "adamw_apex_fused": (2, 4, "fused"),
    "adamw_8bit": (2, 1, "bnb8"),
    "adamw_bnb_8bit": (2, 1, "bnb8"),
    "paged_adamw_8bit": (2, 1, "bnb8_paged"),
    "paged_adamw_32bit": (2, 4, "bnb32_paged"),
    "paged_adamw": (2, 4, "bnb32_paged"),
    "lion_8bit": (1, 1, "bnb8"),
    "paged_lion_8bit": (1, 1, "bnb8_paged"),
    "lion_32bit": (1, 4, "bnb32"),
    "paged_lion_32bit": (1, 4, "bnb32_paged"),
    "adafactor": (1, 4, "factored"),
    "sgd": (0, None, "plain"),
    "adagrad": (1, None, "plain"),
    "rmsprop": (1, None, "plain"),
}


class PlanError(ValueError):
    """A plan that cannot be estimated; the message says which setting is wrong and how to fix it."""


@dataclass
class Plan:
    """One training configuration, as the Estimate page edits it and the Train page receives it."""

    model: str = "meta-llama/Llama-2-7b-hf"
    tuning: str = "lora"  # full | lora | qlora (the run config's lora.enabled and quantization.load_in_4bit)
    # the run config's method (sft | dpo | kto | grpo): core.recipe.methods says what its step holds
    method: str = "sft"
    reference: str = "auto"  # preference methods: auto (adapter disabled for LoRA) | copy (a second model)
    # precompute_ref_log_probs (DPO, KTO): the reference's log-probs computed once before training (no reference
    # forward inside a step)
    precompute_ref: bool = False
    load_dtype: str = "bf16"  # dtype the weights are loaded in (non-quantized parts for QLoRA)
    compute_dtype: str = "bf16"  # activations: the Trainer's bf16/fp16 flag, bnb_4bit_compute_dtype
    quant_type: str = "nf4"
    double_quant: bool = True
    # QLoRA only. False (the engine, TRL's SFTTrainer): no fp32 upcast; input grads for checkpointing and the
    # trainable adapters cast to bf16. True: peft.prepare_model_for_kbit_training (the plain-Trainer path).
    prepare_kbit: bool = False
    # SFTTrainer's trl.trainer.utils.add_fused_lm_head: the loss from (token x vocab) tiles, never the full
    # logits. False: the plain causal-LM cross-entropy over b*s*V logits (Trainer without TRL).
    fused_lm_head: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: str = "all-linear"
    # peft's target_parameters (the run config's lora.target_parameters): parameters LoRA wraps directly, e.g. a
    # mixture-of-experts model's fused experts "mlp.experts.gate_up_proj,mlp.experts.down_proj"
    target_parameters: str = ""
    # QLoRA of a mixture-of-experts model: its fused experts quantized to 4-bit on load too (bitsandbytes alone
    # leaves them in the load dtype). A plan only: the engine cannot do it yet (core.estimate.moe_terms).
    quantize_experts: bool = False
    batch_size: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = True  # the engine's default (TRL's): what makes long sequences fit
    attn: str = "sdpa"
    optim: str = "adamw_torch"
    eval_kv_tokens: int = 0  # tokens held in a KV cache during eval/generation (batch x (prompt + new))
    # The evaluation phase (core.estimate.eval_terms): per_device_eval_batch_size when the run evaluates (0: it
    # does not), GRPO's num_generations_eval (0: num_generations), the samples callback's prompts (eval_samples)
    eval_batch_size: int = 0
    eval_generations: int = 0
    eval_samples: int = 0
    gpu_gb: float = 24.0  # card capacity in GiB
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    device: str = "cuda"  # cuda | cpu (cpu: no context/allocator terms, float dropout masks)
    autocast: bool = True  # Trainer bf16/fp16=True: forward under torch.autocast (ignored for fp32 compute)
    # Memory levers (core.estimate.levers has the table: what each saves and costs, where it runs, its source).
    # SFTConfig.padding_free: the batch's rows concatenated into one sequence (position_ids), no padding.
    padding_free: bool = False
    # SFTConfig.packing: rows filled up to max_length ("bfd" also turns padding-free on)
    packing: bool = False
    packing_strategy: str = "bfd"
    # SFTConfig.activation_offloading: saved activations to pinned CPU RAM
    activation_offloading: bool = False
    liger: bool = False  # SFTConfig.use_liger_kernel: fused RMSNorm / SwiGLU / RoPE (Triton, CUDA)
    # Tokens in the largest batch the sampler can form from the data (0: the bound, batch_size x seq_len).
    # Padded batches: batch_size x the longest row; padding-free: the sum of the longest rows.
    batch_tokens: int = 0
    # Several GPUs (the run config's distributed section, core.estimate.shard_terms): the number of processes over
    # every machine, how they share the model (auto: DDP when the plan fits one card, else FSDP), and whether the
    # sharded terms live in CPU RAM. gpu_gb is then each card's size and the verdict is per GPU.
    gpus: int = 1
    strategy: str = "auto"
    cpu_offload: bool = False
    # A generating method's rollouts (GRPO; core.recipe.methods traits.generates): seq_len is a prompt and its
    # completion, the last completion_len tokens generated (max_completion_length); generation_batch completions
    # are generated at once per device (per_device_train_batch_size x steps_per_generation; 0: batch_size), in
    # groups of num_generations. kl_beta > 0 takes the reference's log-probs, old_logps the old policy's (a no-grad
    # forward each). vllm: "off" (transformers generate on the training card), "colocate" (a vLLM engine in the
    # process holding vllm_fraction of the card; released outside generation with vllm_sleep) or "server".
    completion_len: int = 0
    num_generations: int = 0
    generation_batch: int = 0
    kl_beta: float = 0.0
    old_logps: bool = False
    vllm: str = "off"
    vllm_fraction: float = 0.3
    vllm_sleep: bool = False
    # A vision-language model (core.estimate.vlm): each row's images, of image_width x image_height pixels, resized
    # by the family's processor (Qwen-VL: into max_pixels, 0 = the processor's default); the vision tower and its
    # projector frozen (LoRA on the language model only; a full fine-tune leaves them as they are) or trained.
    image_width: int = 1024
    image_height: int = 1024
    max_pixels: int = 0
    images_per_row: int = 1
    vision_frozen: bool = True
    pan_and_scan: bool = False  # Gemma 3's processor crops a wide or tall image too (do_pan_and_scan)
    # A hybrid's recurrent layers (Gated DeltaNet, Mamba-2, short convolutions; core.estimate.layer_kinds): "auto"
    # plans the path this machine would run (CUDA kernels when flash-linear-attention / mamba-ssm + causal-conv1d
    # import, else transformers' torch code), "kernels" / "torch" the target machine's
    recurrent_kernels: str = "auto"

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """A plan from its dict (plan.json's "plan", --json, a page's); older records' names read too."""
        data = upgraded(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(
                f"Unknown plan setting(s) {', '.join(unknown)}; valid ones: {', '.join(sorted(known))}."
            )
        return cls(**data)

    def to_dict(self) -> dict:
        d = asdict(self)
        # a one-GPU plan's record stays what it was before multi-GPU planning (plan.json, --json, the snapshots)
        trimmed = {
            **(ONE_GPU if self.gpus == 1 else {}),
            **({} if generates(self) else NO_ROLLOUTS),
            **DENSE,
            **NO_EVAL,
            **TEXT_ONLY,
            **AUTO_KERNELS,
        }
        for name, default in trimmed.items():
            if d[name] == default:
                del d[name]
        return d

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_gb * GiB)


def upgraded(data: dict) -> dict:
    """A plan dict in today's names. Before issue #48 a plan said full / lora / qlora as `method` and the run
    config's method as `objective`: a `method` of full / lora / qlora (the two value sets are disjoint) is the
    tuning, and an `objective` the method."""
    if "objective" not in data and data.get("method") not in TUNINGS:
        return data
    out = dict(data)
    if out.get("method") in TUNINGS and "tuning" not in out:
        out["tuning"] = out.pop("method")
    if "objective" in out:
        if "method" in out:
            raise PlanError(
                f"objective {out['objective']!r} and method {out['method']!r} both given: objective is the "
                "older name of method (sft | dpo | kto | grpo); give method only."
            )
        out["method"] = out.pop("objective")
    return out


ONE_GPU = {"gpus": 1, "strategy": "auto", "cpu_offload": False}
# ... and the record of a method that generates nothing stays as it was before GRPO
NO_ROLLOUTS = {
    "completion_len": 0,
    "num_generations": 0,
    "generation_batch": 0,
    "kl_beta": 0.0,
    "old_logps": False,
    "vllm": "off",
    "vllm_fraction": 0.3,
    "vllm_sleep": False,
}
VLLM_MODES = ("off", "colocate", "server")
# ... and a plan without LoRA on parameters or expert quantization keeps the record it had before MoE planning
DENSE = {"target_parameters": "", "quantize_experts": False}
# ... and a plan's without an evaluation phase as it was before that phase
NO_EVAL = {"eval_batch_size": 0, "eval_generations": 0, "eval_samples": 0}
# ... and a plan that leaves the recurrent layers' path to the machine keeps the record it had before hybrids
AUTO_KERNELS = {"recurrent_kernels": "auto"}
RECURRENT_KERNELS = ("auto", "kernels", "torch")
# ... and a plan's image settings at their defaults (a language model has none: its record stays as it was)
TEXT_ONLY = {
    "image_width": 1024,
    "image_height": 1024,
    "max_pixels": 0,
    "images_per_row": 1,
    "vision_frozen": True,
    "pan_and_scan": False,
}


def generates(plan: Plan) -> bool:
    """Does the plan's method generate its own completions before each step (GRPO)?"""
    return methods.get(plan.method).traits.generates


def eval_generations(plan: Plan) -> int:
    """Completions per prompt a generating method's evaluation asks for."""
    return plan.eval_generations or plan.num_generations


def generation_batch(plan: Plan) -> int:
    """Completions generated at once per device."""
    return plan.generation_batch or plan.batch_size


@dataclass
class Estimate:
    plan: dict
    model_id: str
    components: dict[str, int]  # name -> bytes at the peak phase; sums to device_total_bytes
    phases: dict[str, int]  # phase -> tensor bytes
    phase_components: dict[str, dict[str, int]]
    tensor_peak_bytes: int
    reserved_peak_bytes: int
    device_total_bytes: int
    peak_phase: str
    gpu_bytes: int
    fits: bool
    verdict: str  # fits | tight | does not fit
    trainable_params: int
    total_params: int
    kv_cache_bytes_per_token: int
    activation_bytes_per_token_per_layer: float
    reference: str | None
    # Pinned CPU RAM that activation offloading holds (not on the card; the machine must have it spare)
    cpu_pinned_bytes: int = 0
    batch_rows: int = 0  # the shape the model sees: rows x length (padding-free: one row)
    batch_length: int = 0
    warnings: list[str] = field(default_factory=list)
    # Several GPUs: {gpus, strategy (auto resolved), cpu_offload_bytes, load_peak_bytes}; the totals are per GPU
    distributed: dict | None = None
    # A generating method (GRPO): its generation phase, whatever the peak phase is -- {bytes, components,
    # sequences, tokens, moment (the largest: "generate", "prefill", "logprob forward", "vllm")}
    generation: dict | None = None
    # A mixture-of-experts model: its experts, their dtype and why, and the bill's expert terms (core.estimate.
    # moe_terms.moe_record)
    moe: dict | None = None
    # A run that evaluates: its evaluation phase, whatever the peak phase is -- {bytes, components, moments,
    # moment (the largest: "forward", GRPO's "prefill" / "generate" / ..., "samples generate", "kv cache"), rows}
    evaluation: dict | None = None
    # A vision-language model: its images, their tokens and where that number comes from, the vision terms
    # (core.estimate.vlm_terms.vlm_record)
    vlm: dict | None = None

    @property
    def fraction(self) -> float:
        return self.device_total_bytes / self.gpu_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("distributed", "generation", "moe", "evaluation", "vlm"):
            if d[name] is None:
                del d[
                    name
                ]  # a one-GPU estimate's record stays as it was, and so does a method's without rollouts
        return d


# ----------------------------------------------------------------------------------------------------------
# validation


def validate(plan: Plan) -> list[str]:
    """Raise PlanError for a plan that cannot run; return warnings for one that can but is questionable."""
    choices = {
        "tuning": (plan.tuning, TUNINGS),
        "load_dtype": (plan.load_dtype, tuple(DTYPE_BYTES)),
        "compute_dtype": (plan.compute_dtype, tuple(DTYPE_BYTES)),
        "attn": (plan.attn, ATTN),
        "quant_type": (plan.quant_type, QUANT_TYPES),
        "reference": (plan.reference, ("auto", "copy")),
        "method": (plan.method, methods.NAMES),
        "device": (plan.device, ("cuda", "cpu")),
        "packing_strategy": (plan.packing_strategy, PACKING_STRATEGIES),
        "strategy": (plan.strategy, STRATEGIES),
        "recurrent_kernels": (plan.recurrent_kernels, RECURRENT_KERNELS),
    }
    if plan.method in TUNINGS:  # the name a plan gave full / lora / qlora before issue #48
        raise PlanError(
            f"method '{plan.method}' is a tuning: set tuning '{plan.method}'; method is the run config's "
            f"({', '.join(methods.NAMES)})."
        )
    for name, (value, valid) in choices.items():
        if value not in valid:
            raise PlanError(f"{name} '{value}' is not one of {', '.join(valid)}.")
    if plan.optim not in OPTIMIZERS:
        raise PlanError(
            f"Unknown optimizer '{plan.optim}'; use a TrainingArguments optim name: {', '.join(OPTIMIZERS)}."
        )
    for name in ("batch_size", "seq_len", "lora_r", "lora_alpha"):
        value = getattr(plan, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PlanError(f"{name} must be a whole number above zero, got {value!r}.")
    if not isinstance(plan.batch_tokens, int) or isinstance(plan.batch_tokens, bool) or plan.batch_tokens < 0:
        raise PlanError(
            f"batch_tokens must be zero (the bound) or a whole number, got {plan.batch_tokens!r}."
        )
    if plan.batch_tokens > plan.batch_size * plan.seq_len:
        raise PlanError(
            f"batch_tokens {plan.batch_tokens} is more than batch_size x seq_len "
            f"({plan.batch_size * plan.seq_len}); rows are truncated to seq_len, so use at most that."
        )
    if not isinstance(plan.eval_kv_tokens, int) or plan.eval_kv_tokens < 0:
        raise PlanError(
            f"eval_kv_tokens must be zero or a positive whole number, got {plan.eval_kv_tokens!r}."
        )
    for name in ("image_width", "image_height", "max_pixels", "images_per_row"):
        value = getattr(plan, name)
        if not _whole(value) or value < (0 if name in ("max_pixels", "images_per_row") else 1):
            raise PlanError(
                f"{name} must be a whole number{' above zero' if name.startswith('image_') else ''}, got {value!r}."
            )
    for name in NO_EVAL:
        value = getattr(plan, name)
        if not _whole(value) or value < 0:
            raise PlanError(f"{name} must be zero (none) or a whole number, got {value!r}.")
    if not (isinstance(plan.gpu_gb, (int, float)) and plan.gpu_gb > 0 and math.isfinite(plan.gpu_gb)):
        raise PlanError(f"gpu_gb must be a positive number of GiB, got {plan.gpu_gb!r}.")
    if not isinstance(plan.gpus, int) or isinstance(plan.gpus, bool) or plan.gpus < 1:
        raise PlanError(f"gpus must be a whole number of at least 1, got {plan.gpus!r}.")
    if plan.cpu_offload and plan.gpus > 1 and plan.strategy in ("ddp", "auto"):
        raise PlanError(
            f"cpu_offload needs a sharding strategy (fsdp or deepspeed_zero3): DDP keeps everything on every GPU "
            f"(strategy {plan.strategy})."
        )
    if not (0 <= plan.lora_dropout < 1):
        raise PlanError(f"lora_dropout must be in [0, 1), got {plan.lora_dropout!r}.")
    if generates(plan):
        _validate_rollouts(plan)
    warnings = []
    if plan.tuning == "full" and plan.load_dtype == "fp16":
        warnings.append("Full fine-tuning with fp16 weights is numerically fragile; load in fp32 or bf16.")
    if plan.device == "cpu":
        for name, on in (("activation_offloading", plan.activation_offloading), ("liger", plan.liger)):
            if on:
                warnings.append(f"{name} works on a CUDA GPU only: a CPU run does without it (planned so).")
    method = methods.get(plan.method)
    if not method.traits.flat_batches and (plan.padding_free or plan.packing):
        warnings.append(
            f"{method.label} pads its rows ({method.trainer_name} has no packing or padding-free): planned so."
        )
    if flat_batch(plan) and plan.attn == "sdpa" and packed_sequences(plan):
        warnings.append(
            "Padding-free batches on sdpa attention build a (tokens x tokens) mask, converted to the compute "
            "dtype in every layer; use attn_implementation flash_attention_2 on the GPU (no mask)."
        )
    return warnings


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_rollouts(plan: Plan) -> None:
    """What trl.GRPOConfig / GRPOTrainer would refuse, in the plan's words."""
    if not _whole(plan.completion_len) or not 0 < plan.completion_len < plan.seq_len:
        raise PlanError(
            f"completion_len must be a whole number above zero and below seq_len {plan.seq_len} (seq_len is the "
            f"prompt plus its completion), got {plan.completion_len!r}."
        )
    if not _whole(plan.num_generations) or plan.num_generations < 2:
        raise PlanError(
            f"num_generations must be at least 2 (got {plan.num_generations!r}): each completion is compared with "
            "the others of its prompt's group."
        )
    if not _whole(plan.generation_batch) or plan.generation_batch < 0:
        raise PlanError(
            f"generation_batch must be zero (batch_size) or a whole number, got {plan.generation_batch!r}."
        )
    g = generation_batch(plan)
    if g % plan.batch_size:
        raise PlanError(
            f"generation_batch {g} must be a multiple of batch_size {plan.batch_size}: the generated completions "
            "are trained on batch_size at a time."
        )
    if (g * plan.gpus) % plan.num_generations:
        raise PlanError(
            f"The generation batch ({g * plan.gpus} completions) must divide by num_generations "
            f"{plan.num_generations}: every prompt's group is generated whole."
        )
    if not (isinstance(plan.kl_beta, (int, float)) and math.isfinite(plan.kl_beta) and plan.kl_beta >= 0):
        raise PlanError(f"kl_beta must be zero or a positive number, got {plan.kl_beta!r}.")
    if plan.vllm not in VLLM_MODES:
        raise PlanError(f"vllm '{plan.vllm}' is not one of {', '.join(VLLM_MODES)}.")
    if plan.vllm != "off" and plan.device != "cuda":
        raise PlanError(
            "vllm needs a CUDA GPU: on a CPU the completions are generated by transformers (vllm off)."
        )
    if not (isinstance(plan.vllm_fraction, (int, float)) and 0 < plan.vllm_fraction <= 1):
        raise PlanError(f"vllm_fraction must be in (0, 1], got {plan.vllm_fraction!r}.")
    groups = eval_generations(plan)
    if plan.eval_batch_size and (plan.eval_batch_size * plan.gpus) % groups:
        raise PlanError(
            f"The eval batch ({plan.eval_batch_size * plan.gpus} completions) must divide by the completions per "
            f"prompt in an evaluation ({groups}: num_generations_eval, else num_generations)."
        )


def flat_batch(plan: Plan) -> bool:
    """Does the collator concatenate the batch's rows into one sequence? TRL turns padding-free on for BFD
    packing whatever padding_free says (SFTTrainer.__init__); DPOTrainer and KTOTrainer 1.16 pad."""
    if not methods.get(plan.method).traits.flat_batches:
        return False
    return plan.padding_free or (plan.packing and plan.packing_strategy in ("bfd", "bfd_split"))


def packed_sequences(plan: Plan) -> bool:
    """Does one sequence of the batch hold several documents (position_ids restart inside it)? Then transformers
    derives a block-diagonal mask from position_ids (masking_utils.find_packed_sequence_indices)."""
    return flat_batch(plan) and (plan.packing or plan.batch_size > 1)  # (never DPO: it pads)


def batch_shape(plan: Plan) -> tuple[int, int]:
    """(rows, length) of the tensors the model sees in one step. Padded: every row padded to the longest in
    the batch; padding-free: one row of all the batch's tokens; DPO: a chosen and a rejected row per example."""
    per_example = methods.get(plan.method).traits.rows_per_example
    rows = plan.batch_size * per_example
    tokens = (plan.batch_tokens or plan.batch_size * plan.seq_len) * per_example
    if flat_batch(plan):
        return 1, tokens
    return rows, -(-tokens // rows)


def largest_batch_tokens(lengths, plan: Plan) -> int:
    """Tokens in the largest batch the sampler can form from rows of these token `lengths` (each truncated to
    seq_len): what `batch_tokens` should be for this dataset. Packed rows are full, so packing keeps the bound."""
    rows = sorted((min(int(n), plan.seq_len) for n in lengths if n), reverse=True)
    if not rows or plan.packing:
        return plan.batch_size * plan.seq_len
    if flat_batch(plan):
        return sum(rows[: plan.batch_size])
    return plan.batch_size * rows[0]
