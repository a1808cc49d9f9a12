"""The generation phase of a method that generates its own completions before its training steps (GRPO: trl 1.16
GRPOTrainer._generate_and_score_completions), and what those rollouts keep alive through the training step.

Each moment sits next to the step's static terms (weights, a reference copy, the adapter, the optimizer states of a
steady step; no gradients: the optimizer step frees them). The generation batch is G = generation_batch
completions of P prompt + C completion tokens (L = P + C), trained on B = batch_size at a time.

- prefill (transformers `generate`, TRL's default): the prompts through the model with a KV cache: one layer's
  transients over G x P tokens next to the cache of P tokens.
- generate: the last decoding step: the KV cache of G x (L - 1) tokens, one layer's K or V being re-concatenated
  (DynamicLayer.update: torch.cat), the growing ids and attention mask, the sampling's fp32 (G x vocab) copies.
- logprob forward: the old policy's log-probs (an update falls between two generations, or vLLM's sampling is
  corrected) and the reference's (beta > 0: the adapter disabled, or the frozen copy of a full fine-tune), each
  a no-grad forward over B rows at a time through TRL's fused LM head: a layer's transients or the head's tiles.
- vllm: colocated, its engine holds vllm_fraction of the card while awake (its weights and KV cache; asleep
  outside generation with sleep mode, else all along) and the adapter is merged into the weights to sync them
  (one Linear's delta at a time). In server mode the engine is on another GPU: only the merge stays here.

Measured on the CPU (benchmarks/grpo_accuracy.py): prefill, generate and the logprob forward, LoRA and full.
vLLM's terms are modelled from its code (a CUDA GPU only), not yet measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.estimate.activation_terms import step_dtypes
from core.estimate.head_terms import FUSED_TOKEN_CHUNK, FUSED_VOCAB_CHUNK
from core.estimate.plan import DTYPE_BYTES, GiB, Plan, generation_batch
from core.estimate.specs import ModelSpec
from core.estimate.static_terms import adapter_bytes

# the generation phase's own components (the training phases get rollout_batch and, awake, vllm_pool)
ROLLOUT_COMPONENTS = (
    "kv_cache",
    "generation_activations",
    "logprob_forward",
    "rollout_batch",
    "vllm_pool",
    "vllm_weight_sync",
)
MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Rollouts:
    """A step's rollouts: the generation phase at its largest, and what the training phases hold of them."""

    moment: str  # prefill | generate | logprob forward | vllm
    phase: dict  # the generation phase's components (static terms included)
    moments: dict  # every moment's tensor bytes, static terms included
    held: int  # rollout_batch through the training step: the buffered ids, masks, advantages, log-probs
    step_inputs: int  # the training step's own inputs next to them (forward and backward)
    pool: int  # vLLM's pool in the training phases (colocated without sleep mode), else 0
    sequences: int
    tokens: int
    warnings: tuple[str, ...] = ()

    def record(self) -> dict:
        return {
            "bytes": int(sum(self.phase.values())),
            "moment": self.moment,
            "moments": dict(self.moments),
            "sequences": self.sequences,
            "tokens": self.tokens,
            "components": {k: int(v) for k, v in self.phase.items() if v},
        }


def _generation_dtype(plan: Plan) -> int:
    """Bytes per element of what `generate` computes: a peft model's generate reaches the base model's own
    forward, outside accelerate's autocast (the model's dtype); a full fine-tune's model keeps autocast."""
    d = step_dtypes(plan)
    return d.attn if plan.tuning == "full" else d.hidden


def nograd_layer_bytes(spec: ModelSpec, plan: Plan, targets, proj: int) -> float:
    """Per token: a decoder layer's largest moment without autograd (measured on the CPU): the embeddings'
    output, the residual, the layer's input and its norm output, rotary cos and sin, and in the MLP gate, act(gate)
    (or a LoRA-adapted projection's base output next to its scaled lora_B output), up and their product."""
    hidden = step_dtypes(plan).hidden
    adapted = {s.name.rsplit(".", 1)[-1] for s in targets}
    mlp = 4 if adapted & set(MLP) else 3
    return 4 * spec.hidden_size * hidden + mlp * spec.intermediate_size * proj + 2 * spec.head_dim * hidden


def nograd_head_bytes(spec: ModelSpec, plan: Plan, rows: int, top1: bool = False) -> int:
    """TRL's fused LM head without autograd (a log-prob forward): the norm output and its reshaped or gathered
    copy, the per-token targets, mask and seven fp32 statistics, the (4096 x 32768) projection buffer and, on the
    CPU, the tile's three fp32 temporaries (z, exp, and e*z or z - max), with `top1` (SFT, DPO) its bool top-1
    mask, and three per-token reductions. On CUDA (Triton) only the labelled positions are gathered (a generating
    method's completion; planned as every position otherwise) and the fold runs in place."""
    d = step_dtypes(plan)
    h, hd = spec.hidden_size, d.hidden
    triton = plan.device == "cuda"
    positions = rows * (plan.seq_len - 1)
    scored = rows * plan.completion_len if (triton and plan.completion_len) else positions
    n = min(scored, FUSED_TOKEN_CHUNK)
    cols = min(spec.vocab_size, FUSED_VOCAB_CHUNK)
    cd = DTYPE_BYTES[plan.compute_dtype] if d.autocast else hd
    wd = DTYPE_BYTES[plan.load_dtype]
    weight_chunk = cols * h * cd if wd != cd else 0
    held = rows * plan.seq_len * h * hd + (scored * h * hd if (triton or rows > 1) else 0)
    per_token = scored * (8 + 7 * 4) + positions + (0 if triton else scored * (8 + 3 * 4))
    buffers = n * FUSED_VOCAB_CHUNK * cd + (n * h * cd if hd != cd else 0)
    fold = weight_chunk if triton else max((13 if top1 else 12) * n * cols, weight_chunk)
    return int(held + per_token + buffers + fold)


def vllm_sync_bytes(spec: ModelSpec, plan: Plan) -> int:
    """The weight sync's transient (GRPOTrainer -> VLLMGeneration.sync_weights): peft's merge_adapter, one
    adapted Linear at a time: its fp32 delta (lora_B @ lora_A) and its cast into the weight; a 4-bit weight is
    dequantized, summed and quantized again. A full fine-tune's parameters are handed over as they are."""
    if plan.tuning == "full":
        return 0
    largest = max(s.in_features * s.out_features for s in spec.decoder_linears)
    compute = DTYPE_BYTES[plan.compute_dtype]
    if plan.tuning == "qlora":
        return largest * (adapter_bytes(plan) + 2 * compute)
    return largest * (adapter_bytes(plan) + DTYPE_BYTES[plan.load_dtype])


def vllm_need(spec: ModelSpec, plan: Plan) -> float:
    """The smallest share of the card (in steps of 0.05) that holds vLLM's copy of the weights (16-bit, or 4-bit
    for a QLoRA base: TRL loads it with bitsandbytes) and the 16-bit KV cache of one generation batch."""
    weights = spec.total_params * (0.55 if plan.tuning == "qlora" else 2)
    kv = generation_batch(plan) * plan.seq_len * spec.kv_cache_bytes_per_token_per_byte * 2
    return min(1.0, math.ceil((weights + kv) / plan.gpu_bytes * 20) / 20)


def _vllm_warning(spec: ModelSpec, plan: Plan) -> tuple[str, ...]:
    need = vllm_need(spec, plan)
    if plan.vllm != "colocate" or need <= plan.vllm_fraction:
        return ()
    return (
        f"vllm_gpu_memory_utilization {plan.vllm_fraction:g} ({plan.vllm_fraction * plan.gpu_gb:.1f} GiB) cannot "
        f"hold vLLM's copy of the weights and one generation batch's KV cache ({need * plan.gpu_bytes / GiB:.1f} "
        f"GiB): vLLM refuses to start. Give it {need:g}, or run it on another GPU (vllm_mode: server).",
    )


SAMPLING_COPIES = 3  # (sequences x vocab) fp32 tensors a sampling decoding step holds


def decoding_moments(
    spec: ModelSpec,
    plan: Plan,
    targets,
    g: int,
    p: int,
    length: int,
    copies: int,
    batch: str = "rollout_batch",
) -> dict[str, dict]:
    """transformers `generate` of `g` sequences of `p` prompt tokens up to `length`: the prefill and the last
    decoding step (their components, without the static terms). `copies`: the (g x vocab) fp32 tensors the
    decoding step turns the last logits into; `batch`: the component the ids and masks are counted under."""
    gd = _generation_dtype(plan)
    kv = spec.kv_cache_bytes_per_token_per_byte * gd
    layer = nograd_layer_bytes(spec, plan, targets, gd)
    q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    decode = g * ((3 * spec.hidden_size + q_width + 2 * kv_width) * gd + 2 * spec.head_dim * gd)
    return {
        "prefill": {
            "kv_cache": g * p * kv,
            "generation_activations": int(g * p * layer),
            batch: 32 * g * p,  # prompt ids, attention mask and their padded copies
        },
        "generate": {
            # the last step's cache, and one layer's K or V while torch.cat makes it one token longer
            "kv_cache": g * (length - 1) * kv + g * (length - 2) * kv // (2 * spec.num_layers),
            "generation_activations": decode + copies * g * spec.vocab_size * 4,
            batch: 8 * g * (3 * p + 2 * (length - 1)),  # the prompts, the growing ids and mask
        },
    }


def rollout_moments(spec: ModelSpec, plan: Plan, targets) -> dict[str, dict]:
    """Each moment of `plan`'s generation (its components, without the static terms): generation_batch
    completions generated at once, their no-grad log-prob forwards batch_size rows at a time."""
    d = step_dtypes(plan)
    g, b = generation_batch(plan), plan.batch_size
    p, c, length = plan.seq_len - plan.completion_len, plan.completion_len, plan.seq_len
    ref = plan.kl_beta > 0
    pool = int(plan.vllm_fraction * plan.gpu_bytes) if plan.vllm == "colocate" else 0
    moments: dict[str, dict] = {}
    if plan.vllm == "off":
        moments.update(decoding_moments(spec, plan, targets, g, p, length, SAMPLING_COPIES))
    else:
        moments["vllm"] = {"vllm_pool": pool, "vllm_weight_sync": vllm_sync_bytes(spec, plan)}
    if plan.old_logps or ref:
        # every chunk's log-probs stay alive (as wide as the labels) until they are concatenated; the reference's
        # forward follows the old policy's, whose result it keeps
        kept = (g // b - 1) * b * (length - 1) * 4 + (g * c * 4 if (plan.old_logps and ref) else 0)
        backbone = int(b * length * nograd_layer_bytes(spec, plan, targets, d.proj))
        moments["logprob forward"] = {
            "logprob_forward": kept + max(backbone, nograd_head_bytes(spec, plan, b)),
            # the generation batch's ids and masks (prompt, completion, both joined), one chunk's labels
            "rollout_batch": 32 * g * length + 8 * b * length + (g * c * 4 if plan.vllm != "off" else 0),
            "vllm_pool": 0 if plan.vllm_sleep else pool,
        }
    return moments


def rollout_held(plan: Plan, g: int) -> int:
    """What a generation of `g` completions keeps for the steps that train on it: prompt and completion ids and
    masks, advantages, the old / reference log-probs."""
    length, c = plan.seq_len, plan.completion_len
    return 16 * g * length + 4 * g + 8 + 4 * g * c * (int(plan.old_logps) + int(plan.kl_beta > 0))


def rollout_terms(spec: ModelSpec, plan: Plan, targets, static: dict) -> Rollouts:
    """The generation phase of `plan` (a generating method's) and its rollouts' bytes in the training phases."""
    g, b, length = generation_batch(plan), plan.batch_size, plan.seq_len
    pool = int(plan.vllm_fraction * plan.gpu_bytes) if plan.vllm == "colocate" else 0
    moments = rollout_moments(spec, plan, targets)
    totals = {k: int(sum(static.values()) + sum(m.values())) for k, m in moments.items()}
    name = max(totals, key=totals.get)
    phase = {**static, **dict.fromkeys(ROLLOUT_COMPONENTS, 0), **moments[name]}
    return Rollouts(
        moment=name,
        phase=phase,
        moments=totals,
        held=rollout_held(plan, g),
        step_inputs=8 * b * length,  # _compute_loss's attention mask (its ids and labels: activation_terms)
        pool=0 if plan.vllm_sleep else pool,
        sequences=g,
        tokens=g * length,
        warnings=_vllm_warning(spec, plan),
    )


def with_rollouts(phase_components: dict, rollouts: Rollouts) -> dict:
    """The training phases with the rollouts they hold (and an awake vLLM pool), and the generation phase."""
    out = {}
    for name, moment in phase_components.items():
        # an evaluation's own generation wakes vLLM (its pool is then in that moment already)
        extra = {"rollout_batch": rollouts.held, "vllm_pool": max(rollouts.pool, moment.get("vllm_pool", 0))}
        if name in ("forward", "backward"):
            extra["rollout_batch"] += rollouts.step_inputs
        out[name] = {**moment, **extra}
    return {"generation": rollouts.phase, **out}
