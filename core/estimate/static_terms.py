"""The static terms of the bill: weights, quantization constants, LoRA parameters, gradients, optimizer states
and the optimizer step's temporaries -- counted from the real module tree (core.estimate.specs)."""

from __future__ import annotations

import math

from core.estimate.moe import moe_of
from core.estimate.plan import (
    BNB8_BLOCK,
    BNB8_MIN_SIZE,
    DQ_BLOCK,
    DTYPE_BYTES,
    NF4_BLOCK,
    OPTIMIZERS,
    PAGED_MIN_SIZE,
    Plan,
)
from core.estimate.specs import ModelSpec

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
    if plan.tuning != "qlora":
        return spec.total_params * load, 0
    packed = constants = 0
    for lin in spec.decoder_linears:
        p, c = quantized_bytes(lin.in_features * lin.out_features, plan.double_quant)
        packed += p
        constants += c
    # Everything else (embeddings, lm_head, norms, biases, a MoE model's fused experts: not nn.Linear) stays in
    # the load dtype; prepare_model_for_kbit_training casts it to fp32.
    rest = spec.total_params - spec.linear_params
    # A VLM's vision tower and projector stay in `rest`: the engine keeps them out of bitsandbytes
    # (core.recipe.vision.quantization: llm_int8_skip_modules), so they load in the load dtype.
    facts = moe_of(spec)
    if facts and plan.quantize_experts:  # quantized on load (a plan: core.estimate.moe_terms.expert_dtype)
        rest -= facts.expert_params
        experts, expert_constants = expert_weight_bytes(spec, plan)
        packed, constants = packed + experts, constants + expert_constants
    return packed + rest * (4 if plan.prepare_kbit else load), constants


def expert_weight_bytes(spec: ModelSpec, plan: Plan) -> tuple[int, int]:
    """(bytes, quantization-constant bytes) of a MoE model's experts as loaded: the load dtype, or each expert's
    matrices quantized to 4-bit one by one when the plan quantizes them on load (QLoRA)."""
    facts = moe_of(spec)
    load = DTYPE_BYTES[plan.load_dtype]
    if not (plan.tuning == "qlora" and plan.quantize_experts):
        upcast = (
            plan.tuning == "qlora" and plan.prepare_kbit
        )  # peft's kbit preparation: non-4-bit weights to fp32
        return facts.expert_params * (4 if upcast else load), 0
    per_matrix = spec.hidden_size * facts.width
    matrices = facts.moe_layers * facts.experts * (3 if facts.gated else 2)
    packed, constants = quantized_bytes(per_matrix, plan.double_quant)
    biases = facts.expert_params - matrices * per_matrix
    return matrices * packed + biases * load, matrices * constants


def trainable_tensors(spec: ModelSpec, plan: Plan, targets) -> list[int]:
    if plan.tuning == "full":
        return list(spec.param_numels)
    # peft's ParamWrapper gives each expert its own rank-r pair (lora_A: r*experts x in, lora_B: out x r*experts)
    return [n for s in targets for n in _pair(s, plan.lora_r)]


def _pair(s, r: int) -> tuple[int, int]:
    units = r * s.rank * max(s.experts, 1)
    return units * s.in_features, units * s.out_features


def linear_trainable(targets, plan: Plan) -> int:
    """Trainable LoRA parameters on nn.Linear layers (what autocast copies; peft casts a wrapped parameter's
    factors itself)."""
    return sum(sum(_pair(s, plan.lora_r)) for s in targets if not s.experts)


def _trl_qlora(plan: Plan) -> bool:
    """QLoRA prepared as TRL's SFTTrainer does (prepare_kbit False)."""
    return plan.tuning == "qlora" and not plan.prepare_kbit


def adapter_bytes(plan: Plan) -> int:
    """Bytes per LoRA parameter (and so per gradient and per parameter-dtype optimizer state).

    peft keeps adapter weights in fp32 (get_peft_model's autocast_adapter_dtype) whatever the base dtype; for
    a quantized model trl 1.16 SFTTrainer.__init__ then casts every trainable parameter to bfloat16
    (`param.data = param.data.to(torch.bfloat16)`, the QLoRA paper's recommendation)."""
    return 2 if _trl_qlora(plan) else 4


def trainable_param_bytes(plan: Plan) -> int:
    return DTYPE_BYTES[plan.load_dtype] if plan.tuning == "full" else adapter_bytes(plan)


def optimizer_state_bytes(tensors: list[int], plan: Plan, embedding_numel: int = 0) -> tuple[int, int]:
    """(states inside torch's allocator, paged states in CUDA unified memory outside it).

    `embedding_numel`: a trainable nn.Embedding among `tensors`. With a bitsandbytes 8-bit optimizer
    transformers' Trainer.create_optimizer registers `optim_bits: 32` for every nn.Embedding weight
    (GlobalOptimManager.register_module_override): its states stay 32-bit."""
    states, state_bytes, kind = OPTIMIZERS[plan.optim]
    param_bytes = trainable_param_bytes(plan)
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
            return 2 * max(tensors) * trainable_param_bytes(plan)
        return sum(tensors) * trainable_param_bytes(plan)
    return 0
