"""The GPU memory planner: every term of shared/design/memory-model.md in bytes for one training step.

    python -m core.estimate --model meta-llama/Llama-2-7b-hf --method lora --batch-size 4 --seq-len 2048 --json

Input is one `Plan` (serialisable with dataclasses.asdict / Plan.from_dict, so the Train page can take it over);
output is an `Estimate`: the components at the peak, the three totals (tensor peak = max_memory_allocated,
reserved peak = max_memory_reserved, device total = what nvidia-smi shows), the phase of the peak, a verdict,
and hints. Exact terms (weights, quantization constants, LoRA parameters, optimizer states, KV cache) are
counted from the real module tree (core.estimate.specs); activations follow what autograd saves in the real HF module
code, one named tensor at a time (`layer_saved_tensors`), so each term can be checked against a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields, replace

from core.estimate.specs import ModelSpec, SpecError, load_spec, lora_targets, normalize_targets, preset_ids

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
METHODS = ("full", "lora", "qlora")
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
    method: str = "lora"  # full | lora | qlora
    dpo: bool = False  # chosen + rejected sequence per example, plus a reference model
    dpo_reference: str = "auto"  # auto | copy (an explicit second model); auto = adapter disabled for LoRA
    # DPOConfig.precompute_ref_log_probs: the reference's log-probs computed once before training (no reference
    # forward inside a step)
    dpo_precompute_ref: bool = False
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
    batch_size: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = True  # the engine's default (TRL's): what makes long sequences fit
    attn: str = "sdpa"
    optim: str = "adamw_torch"
    eval_kv_tokens: int = 0  # tokens held in a KV cache during eval/generation (batch x (prompt + new))
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

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(
                f"Unknown plan setting(s) {', '.join(unknown)}; valid ones: {', '.join(sorted(known))}."
            )
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_gb * GiB)


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
    dpo_reference: str | None
    # Pinned CPU RAM that activation offloading holds (not on the card; the machine must have it spare)
    cpu_pinned_bytes: int = 0
    batch_rows: int = 0  # the shape the model sees: rows x length (padding-free: one row)
    batch_length: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.device_total_bytes / self.gpu_bytes

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------------------
# validation


def validate(plan: Plan) -> list[str]:
    """Raise PlanError for a plan that cannot run; return warnings for one that can but is questionable."""
    choices = {
        "method": (plan.method, METHODS),
        "load_dtype": (plan.load_dtype, tuple(DTYPE_BYTES)),
        "compute_dtype": (plan.compute_dtype, tuple(DTYPE_BYTES)),
        "attn": (plan.attn, ATTN),
        "quant_type": (plan.quant_type, QUANT_TYPES),
        "dpo_reference": (plan.dpo_reference, ("auto", "copy")),
        "device": (plan.device, ("cuda", "cpu")),
        "packing_strategy": (plan.packing_strategy, PACKING_STRATEGIES),
    }
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
    if not (isinstance(plan.gpu_gb, (int, float)) and plan.gpu_gb > 0 and math.isfinite(plan.gpu_gb)):
        raise PlanError(f"gpu_gb must be a positive number of GiB, got {plan.gpu_gb!r}.")
    if not (0 <= plan.lora_dropout < 1):
        raise PlanError(f"lora_dropout must be in [0, 1), got {plan.lora_dropout!r}.")
    warnings = []
    if plan.method == "full" and plan.load_dtype == "fp16":
        warnings.append("Full fine-tuning with fp16 weights is numerically fragile; load in fp32 or bf16.")
    if plan.device == "cpu":
        for name, on in (("activation_offloading", plan.activation_offloading), ("liger", plan.liger)):
            if on:
                warnings.append(f"{name} works on a CUDA GPU only: a CPU run does without it (planned so).")
    if plan.dpo and (plan.padding_free or plan.packing):
        warnings.append(
            "DPO pads its chosen and rejected rows (DPOTrainer has no packing or padding-free): planned so."
        )
    if flat_batch(plan) and plan.attn == "sdpa" and packed_sequences(plan):
        warnings.append(
            "Padding-free batches on sdpa attention build a (tokens x tokens) mask, converted to the compute "
            "dtype in every layer; use attn_implementation flash_attention_2 on the GPU (no mask)."
        )
    return warnings


def flat_batch(plan: Plan) -> bool:
    """Does the collator concatenate the batch's rows into one sequence? TRL turns padding-free on for BFD
    packing whatever padding_free says (SFTTrainer.__init__); DPOTrainer 1.16 turns it off (it pads)."""
    if plan.dpo:
        return False
    return plan.padding_free or (plan.packing and plan.packing_strategy in ("bfd", "bfd_split"))


def packed_sequences(plan: Plan) -> bool:
    """Does one sequence of the batch hold several documents (position_ids restart inside it)? Then transformers
    derives a block-diagonal mask from position_ids (masking_utils.find_packed_sequence_indices)."""
    return flat_batch(plan) and (plan.packing or plan.batch_size > 1)  # (never DPO: it pads)


def batch_shape(plan: Plan) -> tuple[int, int]:
    """(rows, length) of the tensors the model sees in one step. Padded: every row padded to the longest in
    the batch; padding-free: one row of all the batch's tokens; DPO: a chosen and a rejected row per example."""
    rows = plan.batch_size * (2 if plan.dpo else 1)
    tokens = (plan.batch_tokens or plan.batch_size * plan.seq_len) * (2 if plan.dpo else 1)
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


def estimate_for_lengths(plan: Plan, lengths, spec: ModelSpec | None = None) -> tuple[int, Estimate]:
    """(tokens in the largest batch rows of these `lengths` can form, the estimate for that batch): the peak of
    the real data next to the max_length bound `plan` describes."""
    tokens = largest_batch_tokens(lengths, plan)
    return tokens, estimate(replace(plan, batch_tokens=tokens), spec)


def _check_against_spec(spec: ModelSpec, plan: Plan, targets) -> list[str]:
    warnings = []
    if spec.max_position_embeddings and plan.seq_len > spec.max_position_embeddings:
        warnings.append(
            f"seq_len {plan.seq_len} is longer than the model's max_position_embeddings "
            f"({spec.max_position_embeddings}); quality degrades beyond it unless you extend RoPE."
        )
    if plan.method != "full":
        smallest = min(targets, key=lambda s: min(s.in_features, s.out_features))
        if plan.lora_r > min(smallest.in_features, smallest.out_features):
            raise PlanError(
                f"LoRA rank {plan.lora_r} is larger than the layer {smallest.name} "
                f"({smallest.in_features} -> {smallest.out_features}); use r <= "
                f"{min(smallest.in_features, smallest.out_features)}."
            )
    return warnings


# ----------------------------------------------------------------------------------------------------------
# static terms: weights, quantization constants, LoRA parameters, gradients, optimizer states


def quantized_bytes(numel: int, double_quant: bool) -> tuple[int, int]:
    """(packed 4-bit weight bytes, quantization-constant bytes) of one weight as bitsandbytes stores it."""
    packed = (numel + 1) // 2
    blocks = math.ceil(numel / NF4_BLOCK)
    code = 16 * 4  # the 16-entry NF4/FP4 code book, fp32, per weight
    if not double_quant:
        return packed, blocks * 4 + code
    # absmax re-quantized to uint8 + one fp32 absmax per 256 blocks + its 256-entry code + the fp32 offset
    return packed, blocks + math.ceil(blocks / DQ_BLOCK) * 4 + 256 * 4 + 4 + code


def weight_bytes(spec: ModelSpec, plan: Plan) -> tuple[int, int]:
    """(weights, quantization constants)."""
    load = DTYPE_BYTES[plan.load_dtype]
    if plan.method != "qlora":
        return spec.total_params * load, 0
    packed = constants = 0
    for lin in spec.decoder_linears:
        p, c = quantized_bytes(lin.in_features * lin.out_features, plan.double_quant)
        packed += p
        constants += c
    # Everything else (embeddings, lm_head, norms, biases) stays in the load dtype;
    # prepare_model_for_kbit_training casts it to fp32.
    rest = spec.total_params - spec.linear_params
    return packed + rest * (4 if plan.prepare_kbit else load), constants


def _trainable_tensors(spec: ModelSpec, plan: Plan, targets) -> list[int]:
    if plan.method == "full":
        return list(spec.param_numels)
    r = plan.lora_r
    return [n for s in targets for n in (r * s.in_features, r * s.out_features)]


def _trl_qlora(plan: Plan) -> bool:
    """QLoRA prepared as TRL's SFTTrainer does (prepare_kbit False)."""
    return plan.method == "qlora" and not plan.prepare_kbit


def adapter_bytes(plan: Plan) -> int:
    """Bytes per LoRA parameter (and so per gradient and per parameter-dtype optimizer state).

    peft keeps adapter weights in fp32 (get_peft_model's autocast_adapter_dtype) whatever the base dtype; for
    a quantized model trl 1.16 SFTTrainer.__init__ then casts every trainable parameter to bfloat16
    (`param.data = param.data.to(torch.bfloat16)`, the QLoRA paper's recommendation)."""
    return 2 if _trl_qlora(plan) else 4


def _param_bytes(plan: Plan) -> int:
    return DTYPE_BYTES[plan.load_dtype] if plan.method == "full" else adapter_bytes(plan)


def optimizer_state_bytes(tensors: list[int], plan: Plan, embedding_numel: int = 0) -> tuple[int, int]:
    """(states inside torch's allocator, paged states in CUDA unified memory outside it).

    `embedding_numel`: a trainable nn.Embedding among `tensors`. With a bitsandbytes 8-bit optimizer
    transformers' Trainer.create_optimizer registers `optim_bits: 32` for every nn.Embedding weight
    (GlobalOptimManager.register_module_override): its states stay 32-bit."""
    states, state_bytes, kind = OPTIMIZERS[plan.optim]
    param_bytes = _param_bytes(plan)
    inside = paged = 0
    tensors = list(tensors)
    if kind.startswith("bnb8") and embedding_numel and embedding_numel in tensors:
        tensors.remove(embedding_numel)
        b = states * embedding_numel * 4
        if kind.endswith("paged") and embedding_numel >= PAGED_MIN_SIZE and plan.device == "cuda":
            paged += b
        else:
            inside += b
    for n in tensors:
        if kind == "factored":  # Adafactor: row + column second moments (shape unknown here: treat as sqrt)
            side = int(math.isqrt(n))
            b = (2 * side if side * side == n and n > 4096 else n) * 4
        elif kind.startswith("bnb8"):
            if n >= BNB8_MIN_SIZE:
                b = states * (n + math.ceil(n / BNB8_BLOCK) * 4)
            else:
                b = states * n * 4
        elif kind.startswith("bnb32"):
            b = states * n * 4
        else:
            b = states * n * (state_bytes or param_bytes)
        # bitsandbytes pages only on CUDA (unified memory, outside torch's allocator); on the CPU it falls back
        # to ordinary tensors.
        if kind.endswith("paged") and n >= PAGED_MIN_SIZE and plan.device == "cuda":
            paged += b
        else:
            inside += b
    return inside, paged


def optimizer_step_temporaries(tensors: list[int], plan: Plan) -> int:
    """Scratch memory inside optimizer.step()."""
    _, _, kind = OPTIMIZERS[plan.optim]
    if kind == "foreach" and tensors:
        # CUDA runs torch's foreach AdamW: `exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)` is one list shaped
        # like all trainable tensors (divided and added to in place). The CPU default loops per tensor:
        # `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds the sqrt and the quotient of
        # the largest tensor at once.
        if plan.device == "cpu":
            return 2 * max(tensors) * _param_bytes(plan)
        return sum(tensors) * _param_bytes(plan)
    return 0


# ----------------------------------------------------------------------------------------------------------
# activations: what autograd saves for backward, per token, named tensor by named tensor


@dataclass(frozen=True)
class _Dtypes:
    hidden: int  # residual stream / norm outputs
    proj: int  # MLP projections and their products
    attn: int  # q, k, v and the attention output
    logits: int
    autocast: bool  # Trainer bf16/fp16 runs forward under torch.autocast: Linear inputs get 16-bit copies


def _dtypes(plan: Plan) -> _Dtypes:
    compute = DTYPE_BYTES[plan.compute_dtype]
    load = DTYPE_BYTES[plan.load_dtype]
    autocast = plan.autocast and compute != 4
    if plan.method == "qlora":
        # bnb 4-bit Linear returns its input's dtype; prepare_kbit makes embeddings/norms fp32, so the residual
        # stream and the MLP become fp32 too, while autocast hands sdpa 16-bit copies.
        hidden = 4 if plan.prepare_kbit else load
        return _Dtypes(
            hidden, hidden, compute if autocast else hidden, compute if autocast else hidden, autocast
        )
    proj = compute if autocast else load
    return _Dtypes(load, proj, proj, proj, autocast)


def _liger(plan: Plan) -> bool:
    """Liger's kernels run (Triton, CUDA only); on a CPU the run does without them."""
    return plan.liger and plan.device == "cuda"


def _offloading(plan: Plan) -> bool:
    """TRL's activation offloading runs: it moves only tensors on the accelerator (OffloadActivations)."""
    return plan.activation_offloading and plan.device == "cuda"


def _mask_bytes(plan: Plan) -> int:
    return 1 if plan.device == "cuda" else 4  # CUDA saves a bool mask; the CPU kernel a float one


def layer_saved_tensors(spec: ModelSpec, plan: Plan, targets=()) -> dict[str, float]:
    """Bytes per token that one decoder layer leaves saved for backward, by tensor (LLaMA-style layer).

    Derived from LlamaDecoderLayer & co in transformers: RMSNorm upcasts to fp32 and saves that input and
    rstd; the norm weight multiply saves its input only when the weight trains; a frozen Linear (bf16 or
    bnb 4-bit) saves nothing, a trainable one its input; SDPA saves q, k, v, output and logsumexp, eager
    the fp32 softmax and its cast; SwiGLU saves gate, act(gate), up; LoRA saves its (fp32 or autocast)
    input copy per adapted module, its dropout output + mask when dropout > 0, and lora_A's output.
    """
    d = _dtypes(plan)
    h, inter = spec.hidden_size, spec.intermediate_size
    q_width = spec.num_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    full = plan.method == "full"
    adapted = {s.name.rsplit(".", 1)[-1] for s in targets if ".0." in s.name or "layers.0." in s.name}
    if not adapted:
        adapted = {s.name.rsplit(".", 1)[-1] for s in targets}
    linear_names = {s.name.rsplit(".", 1)[-1] for s in spec.decoder_linears}
    fused_qkv = "qkv_proj" in linear_names
    fused_gate_up = "gate_up_proj" in linear_names
    r = plan.lora_r
    compute = DTYPE_BYTES[plan.compute_dtype]
    ad = adapter_bytes(plan)
    lora_bytes = compute if d.autocast else ad
    saved: dict[str, float] = {}

    liger = _liger(plan)

    def norm(name: str) -> None:
        if liger:  # LigerRMSNormFunction saves its input as it comes and rstd; the weight grad needs no more
            saved[f"{name}.input"] = h * d.hidden
            saved[f"{name}.rstd"] = 4
            return
        saved[f"{name}.fp32_input"] = 4 * h
        saved[f"{name}.rstd"] = 4
        if full:
            saved[f"{name}.normed"] = h * d.hidden

    def linear_input(module: str, width: int, in_bytes: int, shared_key: str) -> None:
        """What one Linear (base + LoRA) saves of its input."""
        if full:
            if d.autocast and in_bytes != d.proj:
                saved[f"{module}.autocast_input"] = width * d.proj
            else:
                saved[shared_key] = width * in_bytes
        if module not in adapted:
            return
        # peft casts x to the adapter dtype (fp32, or bf16 after TRL's QLoRA cast); under autocast lora_A
        # then saves a 16-bit copy of it unless the adapter is already in the compute dtype.
        autocast_copy = d.autocast and ad != compute
        copy_bytes = compute if autocast_copy else ad
        if plan.lora_dropout > 0:
            saved[f"{module}.lora_dropout_mask"] = width * _mask_bytes(plan)
            saved[f"{module}.lora_dropout_out"] = width * copy_bytes
        elif autocast_copy or in_bytes != ad:
            saved[f"{module}.lora_input_copy"] = width * copy_bytes
        else:
            saved[shared_key] = width * in_bytes
        saved[f"{module}.lora_A_out"] = r * lora_bytes

    # attention block
    norm("input_layernorm")
    for m in ("qkv_proj",) if fused_qkv else ("q_proj", "k_proj", "v_proj"):
        linear_input(m, h, d.hidden, "attn_norm_out")
    p = d.attn
    if plan.attn == "sdpa" and packed_sequences(plan) and kv_width < q_width:
        # With a mask transformers does grouped-query attention by repeat_kv (use_gqa_in_sdpa is False):
        # k and v are copied out to every query head, and sdpa saves the copies.
        saved["q_rotary"] = q_width * p
        saved["k_repeated"] = q_width * p
        saved["v_repeated"] = q_width * p
        saved["attn_out"] = q_width * p
        saved["attn_logsumexp"] = spec.num_heads * 4
        o_key = "attn_out"
    elif plan.attn != "eager":  # sdpa and flash attention save the same tensors
        saved["q_rotary"] = q_width * p
        saved["k_rotary"] = kv_width * p
        # fused qkv: v is a view of the whole qkv output, which then stays alive
        saved["v"] = (q_width + 2 * kv_width) * p if fused_qkv else kv_width * p
        saved["attn_out"] = q_width * p
        saved["attn_logsumexp"] = spec.num_heads * 4
        o_key = "attn_out"
    else:
        s = plan.seq_len
        saved["q_rotary"] = q_width * p
        saved["k_repeated"] = q_width * p
        saved["v_repeated"] = q_width * p
        saved["attn_probs_fp32"] = spec.num_heads * s * 4
        if p != 4:
            saved["attn_probs_cast"] = spec.num_heads * s * p
        o_key = "attn_out_contiguous"
    linear_input("o_proj", q_width, p, o_key)
    p = d.proj
    for _ in range(max(spec.norms_per_layer - 2, 0) // 2):  # Gemma-2 post-attention / post-MLP norms
        norm(f"post_norm_{_}a")
        norm(f"post_norm_{_}b")

    # MLP block
    norm("post_attention_layernorm")
    for m in ("gate_up_proj",) if fused_gate_up else ("gate_proj", "up_proj"):
        linear_input(m, h, d.hidden, "mlp_norm_out")
    if fused_gate_up:
        saved["gate_up"] = 2 * inter * p
    else:
        saved["gate"] = inter * p
        saved["up"] = inter * p
    if not liger:  # LigerSiLUMulFunction saves gate and up only and recomputes silu(gate) in backward
        saved["act_gate"] = inter * p
    linear_input("down_proj", inter, p, "gated_product")
    return saved


def layer_activation_bytes(spec: ModelSpec, plan: Plan, targets=()) -> float:
    """Saved bytes per token for one decoder layer (sum of `layer_saved_tensors`)."""
    return sum(layer_saved_tensors(spec, plan, targets).values())


def head_saved_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Per token: what the final norm's weight multiply and the lm_head save when their weights train (full
    fine-tuning): the normed input of the weight multiply and the lm_head input."""
    if plan.method != "full":
        return 0
    d = _dtypes(plan)
    if plan.fused_lm_head:  # the fused head saves its own input (fused_head_bytes), no lm_head module call
        return spec.hidden_size * d.hidden
    return spec.hidden_size * (d.hidden + (d.proj if d.autocast else d.hidden))


def outside_layers_saved_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Per token: final norm, the lm_head input (when it trains), token ids and labels."""
    return 4 * spec.hidden_size + 4 + 16 + head_saved_bytes(spec, plan)


def _embedding_output_requires_grad(plan: Plan) -> bool:
    """Does the first decoder layer get an input that requires grad? Only when the embedding trains (full
    fine-tuning) or the run engine calls enable_input_require_grads (LoRA with gradient checkpointing)."""
    return plan.method == "full" or (plan.method == "lora" and _checkpointing(plan))


def first_layer_unsaved(saved: dict[str, float], targets) -> float:
    """Per token: what the first layer does not save when its input (the frozen embedding's output) needs no
    grad. Autograd saves an op's input only to compute a gradient that someone needs: the input RMSNorm saves
    nothing, LoRA dropout on the layer input keeps no mask (its output, lora_A's input, is still saved);
    when no attention projection is adapted, nothing in the attention block requires grad either."""
    adapted = {s.name.rsplit(".", 1)[-1] for s in targets}
    attn_in = {"q_proj", "k_proj", "v_proj", "qkv_proj"}
    skip = ("input_layernorm.",) + tuple(f"{m}.lora_dropout_mask" for m in attn_in)
    if not adapted & attn_in:
        skip += ("q_rotary", "k_", "v", "attn_", "o_proj.lora_dropout_mask")
        if "o_proj" not in adapted:
            skip += ("post_attention_layernorm.", "gate_proj.lora_dropout_mask", "up_proj.lora_dropout_mask")
            skip += ("gate_up_proj.lora_dropout_mask",)
    return sum(v for k, v in saved.items() if k.startswith(skip))


def activation_bytes(spec: ModelSpec, plan: Plan, targets, tokens: int) -> tuple[int, int]:
    """(saved activations alive at the end of forward, one layer recomputed in backward with checkpointing)."""
    saved = layer_saved_tensors(spec, plan, targets)
    per_layer = sum(saved.values())
    outside = outside_layers_saved_bytes(spec, plan)
    if _checkpointing(plan):
        layer_inputs = spec.num_layers * spec.hidden_size * _dtypes(plan).hidden
        # Liger's input norm saves the layer input itself, which the checkpoint holds already
        if _liger(plan):
            per_layer -= saved.get("input_layernorm.input", 0)
        return int(tokens * (layer_inputs + outside)), int(tokens * per_layer)
    first = 0 if _embedding_output_requires_grad(plan) else first_layer_unsaved(saved, targets)
    return int(tokens * (spec.num_layers * per_layer - first + outside)), 0


def last_layer_forward_temporaries(spec: ModelSpec, plan: Plan, targets=()) -> float:
    """Per token: what is alive but not saved for backward while the last decoder layer runs its down_proj.

    With a small vocabulary (or a short sequence of a wide model) forward peaks here, not at the loss. Alive
    then, from the module code: LlamaModel keeps `inputs_embeds` (one more tensor when it is not also the
    layer input), the decoder loop the layer input, the layer its `residual`, and the MLP its input (the
    post-attention norm output) and the gated product; the base down_proj's output; and for a LoRA
    down_proj, peft's `x = x.to(lora_A.weight.dtype)` (a local alive until forward returns; saved, so
    already counted, only without dropout and autocast), and `result + lora_B(lora_A(x)) * scaling`: the
    lora_B output and its scaled copy (or the scaled copy and the sum, promoted to fp32 when the base is
    16-bit and the adapter fp32; TRL's bf16 QLoRA adapters need no cast). Tensors a full fine-tune saves
    anyway are not counted twice.
    Not used with gradient checkpointing: there the recompute moments of backward bound the step."""
    saved = layer_saved_tensors(spec, plan, targets)
    d = _dtypes(plan)
    h, inter = spec.hidden_size, spec.intermediate_size
    adapted = {s.name.rsplit(".", 1)[-1] for s in targets}
    # A 32-bit residual stream needs no upcast in RMSNorm, so the norms save the stream tensors themselves:
    # the layer input (input_layernorm's) and `residual` (post_attention_layernorm's) are counted already,
    # and so is `inputs_embeds` when layer 0 saves it (its input needs grad).
    stream_saved = d.hidden == 4
    needs_grad = _embedding_output_requires_grad(plan)
    stream = 0 if stream_saved else 2  # the layer input and `residual`
    if spec.num_layers > 1 and not (stream_saved and needs_grad):
        stream += 1  # `inputs_embeds`, a tensor of its own once the first layer has run
    elif spec.num_layers == 1 and stream_saved and not needs_grad:
        stream += 1  # the one layer's input is `inputs_embeds`, which layer 0 leaves unsaved
    if "mlp_norm_out" not in saved:
        stream += 1  # the post-attention norm output, the MLP's input
    b = stream * h * d.hidden
    if "gated_product" not in saved:
        b += inter * d.proj
    b += h * d.proj  # the base down_proj output
    if "down_proj" in adapted:
        ad, compute = adapter_bytes(plan), DTYPE_BYTES[plan.compute_dtype]
        lora = compute if d.autocast else ad
        if d.proj != ad and (plan.lora_dropout > 0 or (d.autocast and ad != compute)):
            b += inter * ad  # peft's cast of the input to the adapter dtype, not itself saved
        b += h * lora + h * max(lora, d.proj)
    return b


# Families whose final norm is nn.LayerNorm: its backward is one fused kernel, without RMSNorm's fp32 chain.
LAYERNORM_MODELS = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi")


def final_norm_backward_temporaries(spec: ModelSpec) -> float:
    """Per token: the fp32 temporaries of the final RMSNorm's backward (its input was upcast to fp32), alive
    next to every saved activation once the logits' gradients are gone. Through `x * rsqrt(mean(x^2) + eps)`:
    the gradient g * rstd (kept until the two paths into x are summed), the mean's expanded gradient, pow's
    x^1 and 2 * x^1, and their product with the gradient: five fp32 tensors as wide as the hidden state."""
    return 5 * spec.hidden_size * 4


def _checkpointing(plan: Plan) -> bool:
    # The run engine calls prepare_model_for_kbit_training(use_gradient_checkpointing=<this flag>), so
    # checkpointing follows the plan's setting for QLoRA too (peft's own default would turn it on).
    return plan.gradient_checkpointing


def logits_bytes(spec: ModelSpec, plan: Plan, tokens: int) -> tuple[int, int]:
    """(peak inside the forward's cross-entropy, peak at the start of backward) for b*s*V logits.

    Forward: lm_head logits + their fp32 upcast + log_softmax output (saved). Backward: the saved
    log_softmax + the dense fp32 gradient of the loss + the log_softmax gradient (12 B per logit).
    """
    n = tokens * spec.vocab_size
    p = _dtypes(plan).logits
    forward = n * (p + (4 if p != 4 else 0) + 4)
    backward = n * 12
    config = json.loads(spec.config_json)
    if config.get("final_logit_softcapping"):  # Gemma-2: tanh(logits / cap) * cap saves two more copies
        forward += 2 * n * p
        backward += 2 * n * p
    return forward, backward


# trl 1.16: trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE and trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
FUSED_TOKEN_CHUNK = 4096
FUSED_VOCAB_CHUNK = 32768


@dataclass(frozen=True)
class FusedHead:
    """TRL's fused LM head + SFTTrainer.compute_loss: bytes next to the saved activations at each moment."""

    held: int  # saved by the fused loss for backward (its hidden input, per-token statistics)
    forward: int  # held + the forward's tile temporaries, at its largest
    backward: int  # held + the backward's tile temporaries and fp32 gradient accumulators, at its largest
    end: int  # as the loss backward returns: the fp32 accumulators and their casts to the input dtypes
    outputs: int  # its per-token outputs (log-probs, entropy, ...), alive until the loss is taken from them


def fused_head_bytes(spec: ModelSpec, plan: Plan, rows: int) -> FusedHead:
    """The loss through trl.trainer.utils.add_fused_lm_head (SFTTrainer adds it with outputs log_probs,
    entropy, is_top1) and trl.kernels.chunked_logprob.ChunkedLogProbFunction, from their code (trl 1.16).

    `_fused_forward` scores hidden_states[:, :-1]: N = rows x (seq_len - 1) positions. On CUDA with Triton
    (`compact = _use_triton(device)`) only positions whose label is not -100 are gathered (`hidden[mask]`, a
    copy, saved); planned as all positions valid. Elsewhere (the CPU) every position is scored through
    `hidden.reshape(-1, H)`: a view of the final norm's output for one row (which the save then keeps alive),
    a saved copy for more. The Function saves the hidden input, the clamped targets (int64), log_z and the
    entropy (fp32 per token).

    Both passes project min(N, 4096) tokens x 32768 vocabulary columns at a time into `mm_buf`, allocated
    full width in the compute dtype (the autocast dtype, else the hidden dtype) even when the vocabulary is
    smaller; `hidden_chunk = hidden[..].to(compute)` and the weight chunk `.to(compute)` are copies only when
    the dtypes differ. Forward keeps seven fp32 per-token statistics. Backward allocates the fp32 grad_hidden
    (N x H) and, when the head trains, the fp32 grad_weight (V x H), then returns both cast to their inputs'
    dtypes.

    Triton branch (modelled from the code, not measured here): the fold and the gradient are written in place
    into the tile, and `_addmm_fp32` accumulates with `torch.addmm(out_dtype=float32)`: no tile temporaries.
    CPU branch (measured): `_forward_tile` holds z, exp(z - max), e * z (entropy) and the top-1 bool mask: 13
    B per tile element; `_backward_tile` holds y, z, log_p, p, grad, the bool and float target masks, and
    `is_target.float() - p` with its product: 29 B per element; `_addmm_fp32` then makes fp32 copies of the
    tile and of the weight chunk (or of the hidden chunk for grad_weight) when the compute dtype is 16-bit.
    """
    d = _dtypes(plan)
    h, vocab = spec.hidden_size, spec.vocab_size
    n_all = rows * (plan.seq_len - 1)
    n = min(n_all, FUSED_TOKEN_CHUNK)
    cols = min(vocab, FUSED_VOCAB_CHUNK)
    tile = n * cols
    hd = d.hidden
    cd = DTYPE_BYTES[plan.compute_dtype] if d.autocast else hd
    if plan.method == "full" or not (plan.method == "qlora" and plan.prepare_kbit):
        wd = DTYPE_BYTES[plan.load_dtype]
    else:
        wd = 4  # prepare_model_for_kbit_training upcast the lm_head
    triton = plan.device == "cuda"
    head_trains = plan.method == "full"
    final_norm_out = rows * plan.seq_len * h * hd  # last_hidden_state
    mm_buf = n * FUSED_VOCAB_CHUNK * cd
    hidden_chunk = n * h * cd if hd != cd else 0
    weight_chunk = cols * h * cd if wd != cd else 0
    # the saved hidden: a gathered (Triton) or reshaped (CPU, several rows) copy, or the norm output itself
    hidden_own = n_all * h * hd if (triton or rows > 1) else 0
    per_token_saved = n_all * (8 + 4 + 4 + 1)  # targets, log_z, entropy, masked_fill's mask
    held = hidden_own + (0 if hidden_own else final_norm_out) + per_token_saved
    stats = 7 * n_all * 4
    outputs = n_all * (4 + 4 + 1 + 1)  # log_probs, entropy, is_top1, label mask
    if plan.dpo:
        outputs += n_all * 4  # DPOTrainer also asks for mean_logits (its logits/* metrics)
    if triton:
        fold_fwd = weight_chunk  # the transient weight-chunk copy inside torch.mm
        fold_bwd = 0
    else:
        fold_fwd = max(13 * tile, weight_chunk)
        addmm = 0 if cd == 4 else 4 * tile + 4 * max(cols * h, n * h if head_trains else 0)
        fold_bwd = max(29 * tile, addmm)
    # forward: the norm output stays alive until the loss returns, next to the saved copy
    forward = (
        held + (final_norm_out if hidden_own else 0) + stats + outputs + mm_buf + hidden_chunk + fold_fwd
    )
    grad_weight = vocab * h * 4 if head_trains else 0
    grad_in = n_all * 4  # the incoming gradient of log_probs (masked_fill's backward)
    backward = held + grad_in + n_all * h * 4 + grad_weight + mm_buf + hidden_chunk + weight_chunk + fold_bwd
    # `.to(dtype)` of an fp32 accumulator is the same tensor when the input is fp32; the head's returned
    # gradient becomes its .grad (counted under gradients), so only a separate fp32 accumulator adds here.
    end = held + n_all * h * (4 + (hd if hd != 4 else 0)) + (grad_weight if wd != 4 else 0)
    return FusedHead(held, forward, backward, end, outputs)


def attention_mask_bytes(spec: ModelSpec, plan: Plan, tokens: int) -> tuple[int, int]:
    """(held for the whole step, saved per layer call) of the attention mask of a padding-free batch that holds
    several sequences. transformers (masking_utils) derives a block-diagonal boolean (T x T) mask from
    position_ids, alive until the step's backward is done; torch's scaled_dot_product_attention converts a
    boolean mask to the query dtype in every call (convert_boolean_attn_mask) and saves that copy for backward.
    Eager attention gets the float mask once (no per-layer copy). Flash attention takes the sequence bounds
    (cu_seq_lens) instead: no mask. Measured on the CPU (sdpa)."""
    if plan.attn == "flash" or not packed_sequences(plan):
        return 0, 0
    t2 = tokens * tokens
    if plan.attn == "eager":
        return t2 * _dtypes(plan).attn, 0
    return t2, t2 * _dtypes(plan).attn


def offloaded_activations(
    spec: ModelSpec, plan: Plan, targets, tokens: int, saved: int, recompute: int
) -> tuple[int, int, int]:
    """(GPU bytes at the end of forward, GPU bytes while one layer's backward runs, pinned CPU bytes) with TRL's
    activation offloading (trl.models.activation_offloading.OffloadActivations, use_streams=True): every saved
    tensor of at least 1 KiB on the accelerator is copied to pinned CPU memory during forward, the last five
    stay on the GPU while their copies are in flight, and backward brings each one back just before its node
    runs (the next one prefetched). With checkpointing the saved tensors are the layer inputs (the checkpoint
    saves them through the same hooks) and the recomputed layer stays on the GPU (backward runs outside the
    offloading context). Modelled from the code, not yet measured (it moves nothing on a CPU)."""
    if _checkpointing(plan):
        unit = tokens * spec.hidden_size * _dtypes(plan).hidden  # one layer input
        in_flight = min(OFFLOAD_STASH, spec.num_layers) * unit
        return in_flight, recompute + 2 * unit, saved
    layer = layer_saved_tensors(spec, plan, targets)
    largest = sorted(layer.values(), reverse=True)[:OFFLOAD_STASH]
    in_flight = int(tokens * sum(largest))
    per_layer = int(tokens * sum(layer.values()))
    # backward holds the layer being differentiated and the prefetched one: two layers' saved tensors
    return in_flight, 2 * per_layer, saved


def kv_cache_bytes_per_token(spec: ModelSpec, plan: Plan) -> int:
    return spec.kv_cache_bytes_per_token_per_byte * DTYPE_BYTES[plan.compute_dtype]


def _autocast_weight_copies(spec: ModelSpec, plan: Plan, trainable: int) -> tuple[int, int]:
    """(alive at the end of forward, alive at the start of backward): 16-bit copies of fp32 weights that
    matmuls make under bf16/fp16 autocast.

    Which weights are fp32: all of them for an fp32 load; the LoRA adapters (peft keeps them fp32) unless
    TRL cast them to bf16 (QLoRA); with QLoRA and prepare_model_for_kbit_training the lm_head (or the tied
    embedding it reuses) -- but only on the plain path: TRL's fused head casts its weight chunks itself
    (`weight[start:end].to(compute_dtype)`), outside autocast's cache.
    bitsandbytes 4-bit Linears dequantize straight to the compute dtype: no copy.
    How long a copy lives: autocast caches the casts of trainable leaf weights until forward leaves the
    autocast region, and a matmul saves its weight copy for backward unless the layer is checkpointed. So
    inside checkpointed layers the copies are gone when backward starts; the lm_head, outside the layers,
    keeps its copy until its own backward.
    """
    if not _dtypes(plan).autocast:
        return 0, 0
    head = spec.lm_head_params or spec.embedding_params
    fp32_load = DTYPE_BYTES[plan.load_dtype] == 4
    head_copy = head if (fp32_load or (plan.method == "qlora" and plan.prepare_kbit)) else 0
    if plan.fused_lm_head:
        head_copy = 0
    c = DTYPE_BYTES[plan.compute_dtype]
    if plan.method != "full":
        trainable_in_layers = trainable if adapter_bytes(plan) != c else 0
    else:
        trainable_in_layers = spec.linear_params if fp32_load else 0
    frozen_in_layers = spec.linear_params if (plan.method == "lora" and fp32_load) else 0
    if _checkpointing(plan):
        return (head_copy + trainable_in_layers) * c, head_copy * c
    both = (head_copy + trainable_in_layers + frozen_in_layers) * c
    return both, both


# ----------------------------------------------------------------------------------------------------------
# the estimate


def estimate(plan: Plan, spec: ModelSpec | None = None) -> Estimate:
    """The whole memory bill of one training step of `plan`. Raises PlanError / SpecError on bad input."""
    warnings = validate(plan)
    spec = spec or load_spec(plan.model)
    targets = (
        lora_targets(spec.model_id, normalize_targets(plan.target_modules)) if plan.method != "full" else ()
    )
    warnings += _check_against_spec(spec, plan, targets)

    # The tensors' shape: padding-free concatenates the rows, real data may be shorter than the bound.
    batch, length = batch_shape(plan)
    tokens = batch * length
    asked = plan
    plan = replace(plan, seq_len=length)  # the per-row length the terms below see (score matrix, head tiles)
    weights, quant_constants = weight_bytes(spec, plan)
    tensors = _trainable_tensors(spec, plan, targets)
    trainable = sum(tensors)
    param_bytes = _param_bytes(plan)
    lora_params = trainable * param_bytes if plan.method != "full" else 0
    grads = trainable * param_bytes
    opt_inside, opt_paged = optimizer_state_bytes(
        tensors, plan, spec.embedding_params if plan.method == "full" else 0
    )
    opt_temp = optimizer_step_temporaries(tensors, plan)
    saved, recompute = activation_bytes(spec, plan, targets, tokens)
    mask_held, mask_per_layer = attention_mask_bytes(spec, plan, tokens)
    if _checkpointing(plan):
        recompute += mask_per_layer  # the recomputed layer converts the mask again
        saved += mask_held
    else:
        saved += mask_held + spec.num_layers * mask_per_layer
    pinned = 0
    if _offloading(plan):
        saved, recompute, pinned = offloaded_activations(spec, plan, targets, tokens, saved, recompute)
    logits_fwd, logits_bwd = logits_bytes(spec, plan, tokens)
    autocast_fwd, autocast_bwd = _autocast_weight_copies(spec, plan, trainable)
    kv_per_token = kv_cache_bytes_per_token(spec, plan)
    kv_cache = plan.eval_kv_tokens * kv_per_token

    dpo_reference = None
    reference = 0
    if plan.dpo:
        if plan.method == "full" or plan.dpo_reference == "copy":
            dpo_reference = (
                "a second, frozen copy of the model (full fine-tuning or an explicit reference model)"
            )
            reference = weights + quant_constants
        else:
            dpo_reference = (
                "the base model with the adapter disabled: no second copy, one more forward without grad"
            )

    static = {
        "weights": weights,
        "quant_constants": quant_constants,
        "reference_model": reference,
        "lora_params": lora_params,
        "optimizer_states": opt_inside,
    }
    hidden_grad = 2 * tokens * spec.hidden_size * _dtypes(plan).hidden
    head_grad = (spec.lm_head_params or spec.embedding_params) * param_bytes if plan.method == "full" else 0
    # The loss: full logits and cross-entropy (plain Trainer) or TRL's fused head (tiles, never the logits).
    fused = fused_head_bytes(spec, plan, batch) if plan.fused_lm_head else None
    loss_fwd = {"lm_head_loss": fused.forward} if fused else {"logits_loss": logits_fwd}
    loss_bwd = {"lm_head_loss": fused.backward} if fused else {"logits_loss": logits_bwd}
    phase_components = {
        "forward": {
            **static,
            "autocast_weight_copies": autocast_fwd,
            "activations": saved,
            **loss_fwd,
        },
        "optimizer": {**static, "gradients": grads, "optimizer_temporaries": opt_temp},
    }
    if plan.dpo and not plan.dpo_precompute_ref and fused:
        # DPOTrainer._compute_loss runs the reference forward (no grad; the adapter off or the reference model)
        # after the policy's: the policy's saved tensors and log-prob outputs wait next to the reference's
        # transients: one layer at a time (stream, norm output, gate/up/product) or its head's tiles.
        d = _dtypes(plan)
        ref_layer = tokens * (3 * spec.hidden_size * d.hidden + 3 * spec.intermediate_size * d.proj)
        reference_moment = {
            **static,
            "autocast_weight_copies": autocast_fwd,
            "activations": saved,
            "lm_head_loss": fused.held + fused.outputs + max(ref_layer, fused.forward - fused.held),
        }
        if sum(reference_moment.values()) > sum(phase_components["forward"].values()):
            phase_components["forward"] = reference_moment
    # Backward: gradients fill up while activations drain; the worst case is the early part (all saved
    # tensors + logit gradients) or the end (all gradients). Model the two ends and keep the larger.
    early = {
        **static,
        "autocast_weight_copies": autocast_bwd,
        "activations": saved,
        **loss_bwd,
        "gradients": 0,
    }
    if fused:
        # As the fused loss's backward returns: its fp32 accumulators and their casts, the head's gradient.
        head_moment = {**early, "lm_head_loss": fused.end, "gradients": head_grad}
    else:
        # The lm_head's weight gradient appears only after the cross-entropy backward has freed its 12 B per
        # logit; then just the 16-bit gradient of the logits is left next to it.
        head_moment = {
            **early,
            "logits_loss": tokens * spec.vocab_size * _dtypes(plan).logits,
            "gradients": head_grad,
        }
    if sum(head_moment.values()) > sum(early.values()):
        early = head_moment
    # Later in backward the activations drain while gradients pile up. Two moments bound it:
    # - the last decoder layer backward meets (layer 0): with checkpointing its recomputed activations
    #   next to the gradients of everything above it (taken as all gradients but the embedding's: an upper
    #   bound, some of layer 0's own come only after its activations are freed);
    # - the tail, the embedding's backward: all gradients, the gradient reaching the embedding, and for a
    #   tied embedding trained in full its two gradients (lm_head's, the embedding's) and their out-of-place
    #   sum (AccumulateGrad) alive at once.
    tied = spec.tie_word_embeddings and plan.method == "full"
    embedding_grad = spec.embedding_params * param_bytes if (plan.method == "full" and not tied) else 0
    last_layer = {
        **static,
        "autocast_weight_copies": 0,  # released with the activations they were saved for
        "activations": recompute,
        "gradients": grads - embedding_grad,
        "logits_loss": hidden_grad,
    }
    tail = {
        **static,
        "autocast_weight_copies": 0,
        "activations": 0,
        "gradients": grads + (2 * spec.embedding_params * param_bytes if tied else 0),
        "logits_loss": tokens * spec.hidden_size * _dtypes(plan).hidden,
    }
    # The first decoder layer backward meets (the last one): its saved tensors (recomputed ones with
    # checkpointing) next to the gradients flowing through its SwiGLU MLP: the gradient of the gated product
    # and of its two factors (3 x tokens x intermediate) plus the one of the residual stream. It outgrows the
    # start of backward only when the vocabulary is small.
    # Liger's SwiGLU backward writes the two factors' gradients into the saved gate and up (in place).
    factors = 1 if _liger(plan) else 3
    flowing = tokens * (
        factors * spec.intermediate_size * _dtypes(plan).proj + spec.hidden_size * _dtypes(plan).hidden
    )
    first_layer = {
        **static,
        "autocast_weight_copies": autocast_bwd,
        "activations": saved + recompute,
        "logits_loss": flowing,
        "gradients": head_grad,
    }
    # The final norm's backward, after the cross-entropy's and lm_head's: the saved activations (less what
    # lm_head and the norm's weight multiply saved, freed by their backward) next to its fp32 temporaries.
    # It outgrows the start of backward only when the vocabulary is small.
    final_norm = {
        **static,
        "autocast_weight_copies": autocast_bwd,
        "activations": max(0, saved - int(tokens * head_saved_bytes(spec, plan))),
        "logits_loss": int(tokens * final_norm_backward_temporaries(spec)),
        "gradients": head_grad,
    }
    moments = (early, first_layer, last_layer, tail)
    if spec.model_type not in LAYERNORM_MODELS:
        moments += (final_norm,)
    phase_components["backward"] = max(moments, key=lambda c: sum(c.values()))
    if not _checkpointing(plan):
        # Inside the last layer's down_proj: everything saved but the final norm's and the loss's tensors,
        # next to that layer's unsaved temporaries.
        in_layer = {
            **static,
            "autocast_weight_copies": autocast_fwd,
            "activations": max(0, saved - int(tokens * outside_layers_saved_bytes(spec, plan))),
            "logits_loss": int(tokens * last_layer_forward_temporaries(spec, plan, targets)),
        }
        if sum(in_layer.values()) > sum(phase_components["forward"].values()):
            phase_components["forward"] = in_layer
    if kv_cache:
        phase_components["eval"] = {**static, "kv_cache": kv_cache}
    phases = {name: sum(c.values()) for name, c in phase_components.items()}
    peak_phase = max(phases, key=phases.get)
    tensor_peak = phases[peak_phase]

    static_total = sum(static.values())
    if plan.device == "cpu":
        allocator = context = 0
    else:
        share = FRAGMENTATION_EXPANDABLE if plan.expandable_segments else FRAGMENTATION
        allocator = int(share * (tensor_peak - static_total))
        context = CUDA_CONTEXT_BYTES
    reserved = tensor_peak + allocator
    device_total = reserved + context + opt_paged

    components = {k: v for k, v in phase_components[peak_phase].items()}
    components.update(
        {"allocator_overhead": allocator, "cuda_context": context, "paged_optimizer_states": opt_paged}
    )
    for name in (
        "gradients",
        "activations",
        "logits_loss",
        "lm_head_loss",
        "kv_cache",
        "autocast_weight_copies",
        "optimizer_temporaries",
        "reference_model",
    ):
        components.setdefault(name, 0)
    components = {k: int(components[k]) for k in COMPONENT_ORDER}

    gpu = plan.gpu_bytes
    frac = device_total / gpu
    verdict = "fits" if frac <= FIT_LIMIT else ("tight" if frac <= 1.0 else "does not fit")
    return Estimate(
        plan=asked.to_dict(),
        model_id=spec.model_id,
        components=components,
        phases={k: int(v) for k, v in phases.items()},
        phase_components={k: {n: int(b) for n, b in c.items()} for k, c in phase_components.items()},
        tensor_peak_bytes=int(tensor_peak),
        reserved_peak_bytes=int(reserved),
        device_total_bytes=int(device_total),
        peak_phase=peak_phase,
        gpu_bytes=gpu,
        fits=verdict == "fits",
        verdict=verdict,
        trainable_params=trainable,
        total_params=spec.total_params,
        kv_cache_bytes_per_token=kv_per_token,
        activation_bytes_per_token_per_layer=layer_activation_bytes(spec, plan, targets),
        dpo_reference=dpo_reference,
        cpu_pinned_bytes=int(pinned),
        batch_rows=batch,
        batch_length=length,
        warnings=warnings,
    )


COMPONENT_ORDER = (
    "weights",
    "quant_constants",
    "reference_model",
    "lora_params",
    "gradients",
    "optimizer_states",
    "optimizer_temporaries",
    "autocast_weight_copies",
    "activations",
    "logits_loss",
    "lm_head_loss",  # TRL's fused LM head + loss (fused_lm_head); logits_loss is the plain path's
    "kv_cache",
    "allocator_overhead",
    "cuda_context",
    "paged_optimizer_states",
)
# Terms outside torch's allocator stats (not in tensor/reserved peak, but on the card)
OUTSIDE_TORCH = ("cuda_context", "paged_optimizer_states")


# ----------------------------------------------------------------------------------------------------------
# fit search and advice


def _largest(plan: Plan, spec: ModelSpec, name: str, hi: int, step: int = 1, limit: float = FIT_LIMIT) -> int:
    """The largest value of `name` (a multiple of `step`, <= hi) whose device total stays within `limit` of the
    card; 0 if none."""

    def ok(v: int) -> bool:
        e = estimate(replace(plan, **{name: v, "batch_tokens": 0}), spec)
        return e.device_total_bytes <= limit * e.gpu_bytes

    lo_units, hi_units = 0, hi // step  # invariant: lo fits (0 = nothing), hi+1 does not
    if not ok(step):
        return 0
    lo_units = 1
    while lo_units < hi_units:
        mid = (lo_units + hi_units + 1) // 2
        if ok(mid * step):
            lo_units = mid
        else:
            hi_units = mid - 1
    return lo_units * step


def fit_search(plan: Plan, spec: ModelSpec | None = None, limit: float = FIT_LIMIT) -> dict:
    """The largest batch size (at this seq len) and seq len (at this batch size) that stay within `limit` of the
    card (90%: the verdict's "fits"), both at the max_length bound (every row full)."""
    validate(plan)
    spec = spec or load_spec(plan.model)
    max_seq = max(spec.max_position_embeddings or 0, plan.seq_len)
    batch = _largest(plan, spec, "batch_size", 4096, limit=limit)
    seq = _largest(plan, spec, "seq_len", max_seq, step=64 if max_seq >= 64 else 1, limit=limit)
    out = {"max_batch_size": batch, "max_seq_len": seq, "seq_len_cap": max_seq}
    for key, name, value in (("batch_fraction", "batch_size", batch), ("seq_fraction", "seq_len", seq)):
        out[key] = (
            estimate(replace(plan, **{name: value, "batch_tokens": 0}), spec).fraction if value else None
        )
    return out


def what_would_fit(plan: Plan, spec: ModelSpec | None = None) -> list[dict]:
    """Changes that lower the device total, with their savings and costs (core.estimate.levers)."""
    from core.estimate.levers import what_would_fit as advise

    return advise(plan, spec)


def memory_curve(plan: Plan, name: str, values: list[int], spec: ModelSpec | None = None) -> list[dict]:
    """Device total (and tensor peak) as `name` (batch_size or seq_len) takes each of `values`."""
    spec = spec or load_spec(plan.model)
    rows = []
    for v in values:
        e = estimate(replace(plan, **{name: v}), spec)
        rows.append(
            {name: v, "device_total_bytes": e.device_total_bytes, "tensor_peak_bytes": e.tensor_peak_bytes}
        )
    return rows


# ----------------------------------------------------------------------------------------------------------
# CLI


def _gb(b: float) -> str:
    return f"{b / GiB:7.2f} GiB"


def format_table(est: Estimate, fit: dict | None = None, advice: list[dict] | None = None) -> str:
    lines = [f"Model {est.model_id}: {est.total_params:,} params, {est.trainable_params:,} trainable"]
    lines.append(f"{'component':<26}{'bytes':>16}  {'size':>11}")
    for name, b in est.components.items():
        if b:
            outside = "  (outside torch)" if name in OUTSIDE_TORCH else ""
            lines.append(f"{name:<26}{b:>16,}  {_gb(b)}{outside}")
    lines.append("-" * 56)
    for label, b in (
        ("tensor peak", est.tensor_peak_bytes),
        ("reserved peak", est.reserved_peak_bytes),
        ("device total", est.device_total_bytes),
        ("GPU capacity", est.gpu_bytes),
    ):
        lines.append(f"{label:<26}{b:>16,}  {_gb(b)}")
    if est.cpu_pinned_bytes:
        b = est.cpu_pinned_bytes
        lines.append(f"{'pinned CPU RAM':<26}{b:>16,}  {_gb(b)}  (activation offloading; not on the card)")
    lines.append(f"peak phase: {est.peak_phase};  KV cache per token: {est.kv_cache_bytes_per_token:,} bytes")
    lines.append(f"verdict: {est.verdict} ({est.fraction:.0%} of the card; aim for 85-90%)")
    if est.dpo_reference:
        lines.append(f"DPO reference model: {est.dpo_reference}")
    if fit:
        lines.append(
            f"largest batch size at this seq len: {fit['max_batch_size']}; "
            f"largest seq len at this batch size: {fit['max_seq_len']}"
        )
    for a in advice or []:
        combined = "combined: " if a.get("combined") else ""
        lines.append(f"  - {combined}{a['change']}: saves {a['saves_bytes'] / GiB:.2f} GiB -> {a['verdict']}")
        if a.get("costs"):
            lines.append(f"      cost: {a['costs']}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m core.estimate", description="Estimate GPU memory of a fine-tune."
    )
    d = Plan()
    p.add_argument("--model", default=None, help="preset hub id or local model folder")
    p.add_argument("--list-models", action="store_true", help="print the bundled preset ids and exit")
    p.add_argument("--method", default=d.method, help="full | lora | qlora")
    p.add_argument("--dpo", action="store_true", help="plan a DPO run (chosen + rejected + reference)")
    p.add_argument("--dpo-reference", default=d.dpo_reference, help="auto | copy")
    p.add_argument(
        "--dpo-precompute-ref",
        action="store_true",
        help="DPO: the reference's log-probs computed before training (precompute_ref_log_probs)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lora-r", type=int, default=d.lora_r)
    p.add_argument("--lora-alpha", type=int, default=d.lora_alpha)
    p.add_argument("--lora-dropout", type=float, default=d.lora_dropout)
    p.add_argument("--target-modules", default=d.target_modules, help="all-linear or e.g. q_proj,v_proj")
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
    levers = p.add_argument_group("memory levers (see the README's 'Fitting more' table)")
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
        help="plan a run config (run.yaml) through the engine's own mapping; --gpu-gb, --device, "
        "--expandable-segments and --model (another model's shapes) still apply",
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
    p.add_argument("--gpu-gb", type=float, default=d.gpu_gb, help="card capacity in GiB")
    p.add_argument(
        "--expandable-segments", action=argparse.BooleanOptionalAction, default=d.expandable_segments
    )
    p.add_argument("--device", default=d.device, help="cuda | cpu")
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
        print(f"error: {exc} (see python -m core.estimate --help)", file=sys.stderr)
        return 2
    if args.list_models:
        print("\n".join(preset_ids()))
        return 0
    if not args.model and not args.config:
        print(
            "error: --model is required: a preset id (see --list-models) or a local model folder "
            "(or --config run.yaml).",
            file=sys.stderr,
        )
        return 2
    values = {
        k: v for k, v in vars(args).items() if k not in ("list_models", "json", "config", "data_lengths")
    }
    if args.data_lengths and not args.config:
        print("error: --data-lengths reads a run config's data: give --config run.yaml too.", file=sys.stderr)
        return 2
    try:
        cfg = _load_run_config(args.config) if args.config else None
        plan = _plan_from_config(cfg, args) if cfg else Plan.from_dict(values)
        est = estimate(plan)
        data_batch = _data_batch(cfg, plan) if args.data_lengths else None
        fit = fit_search(plan)
        advice = what_would_fit(plan) if est.verdict != "fits" else []
    except (PlanError, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for w in est.warnings:
        print(f"warning: {w}", file=sys.stderr)
    from core.estimate.levers import lever_savings, modelled_note, with_every_lever

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
        print(json.dumps(out))
    else:
        print(format_table(est, fit, advice))
        if data_batch:
            print(
                f"with the data's real lengths ({data_batch['rows']} rows): the largest batch holds "
                f"{data_batch['batch_tokens']:,} tokens -> device total {_gb(data_batch['device_total_bytes'])}, "
                f"{data_batch['verdict']}"
            )
        if every != plan:
            print(
                f"with every lever on: largest batch size {fit_every['max_batch_size']}, "
                f"largest seq len {fit_every['max_seq_len']}"
            )
        if note:
            print(f"note: {note}")
    return 0


def _data_batch(cfg: dict, plan: Plan) -> dict:
    """The largest batch the config's data can form (its rows tokenized as a run tokenizes them) and its plan."""
    from core.train.data import DataError, preview_dataset
    from core.train.preflight import load_tokenizer_and_config

    if cfg["method"] == "dpo":
        raise PlanError(
            "--data-lengths plans SFT rows; a DPO run's pairs are planned at the max_length bound."
        )
    try:
        tokenizer, _ = load_tokenizer_and_config(cfg["model"])
        preview = preview_dataset(cfg["data"], tokenizer, n=0, length_rows=100_000, max_length=plan.seq_len)
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
    from core.train.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def _plan_from_config(cfg: dict, args) -> Plan:
    """The plan of a run config, through core.estimate.from_config (the engine's one mapping)."""
    from core.estimate.from_config import plan_for_config

    return plan_for_config(
        cfg,
        gpu_gb=args.gpu_gb,
        device=args.device,
        expandable_segments=args.expandable_segments,
        model=args.model,
    )


if __name__ == "__main__":
    sys.exit(main())
