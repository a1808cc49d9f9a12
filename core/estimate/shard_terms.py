"""The per-GPU terms of a plan trained by several processes (docs/design/multi-gpu.md, "Per-GPU memory"): what
each strategy divides by the number of processes N, what it adds, and the load-time peak.

- DDP replicates everything; its gradient buckets are a second copy of the trainable gradients (accelerate's
  DistributedDataParallel keeps gradient_as_bucket_view off), alive for the whole run.
- FSDP full shard (FSDP1 and FSDP2) and DeepSpeed ZeRO-3 divide the frozen weights, the LoRA parameters, their
  gradients, the optimizer states and the optimizer step's scratch by N -- not the 4-bit quantization constants:
  bitsandbytes keeps them in each weight's QuantState, not a parameter, so no strategy shards or offloads them and
  every rank holds them whole (tests/test_distributed_sharding.py measures it on FSDP1). In forward and
  backward they hold gathered (unsharded) units next to the shards: the current decoder layer and the prefetched
  one (FSDP2 keeps two all-gather outputs alive, pytorch PR #128884; FSDP1's limit_all_gathers allows two;
  ZeRO-3 prefetches the next layer), and the root unit -- embeddings, lm_head, final norm: FSDP does not reshard
  the root after forward, ZeRO-3 gathers lm_head for the loss, when the peak falls. Gradients of one unit exist
  unsharded until their reduce-scatter (the communication buffer).
- Activations, logits and the loss are NOT divided: every process runs its own micro-batch.
- Each process pays a CUDA context (core.estimate.plan) and NCCL's buffers (NCCL_CONTEXT_BYTES, outside torch).
- Load: every rank first holds the whole 4-bit model on its GPU. transformers quantizes a model where its
  device_map points (core.train.model.load_model: the rank's GPU) and since transformers 5 loads it whole on every
  rank under FSDP too (no rank-0-only loading: cpu_ram_efficient_loading only broadcasts what each rank already
  holds); under ZeRO-3 it skips zero.Init for a quantized model (deepspeedai/DeepSpeed#5660). FSDP / ZeRO-3 shard
  it afterwards. A 16-bit base loads on the CPU (FSDP) or sharded (zero.Init): no GPU peak beyond the step's.
  DDP holds the full model anyway.
- cpu_offload (FSDP offload_params, ZeRO-3 offload_param + offload_optimizer): the shards, their gradients and the
  optimizer states live in CPU RAM; the gathered units still come to the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.estimate.plan import DTYPE_BYTES, Plan
from core.estimate.specs import ModelSpec
from core.estimate.static_terms import quantized_bytes

# NCCL's per-process buffers and kernels (NCCL_BUFFSIZE 4 MiB per channel and peer, a few channels, plus the
# communicator's own allocations). No source gives a number (docs/design/multi-gpu.md): modelled,
# to be calibrated on a multi-GPU machine (benchmarks/gpu_truth.py).
NCCL_CONTEXT_BYTES = 256 * 2**20
# Terms the sharded strategies divide by N
DIVIDED = ("weights", "reference_model", "lora_params", "optimizer_states")
DISTRIBUTED_COMPONENTS = ("gathered_params", "comm_buffers", "nccl_context")
# benchmarks/multi_gpu_published.py: what a multi-GPU verdict can be trusted to, until a GPU calibrates it
ACCURACY_NOTE = (
    "Per-GPU figures are checked against published multi-GPU runs only (median 15%, mostly below them: FSDP's "
    "allocator caching is not modelled yet); keep more headroom than on one GPU."
)

# When the load moment is the peak: what the user reads, with the sizes filled in
LOAD_NOTE = (
    "Every GPU first loads the whole 4-bit model ({load}) before {strategy} shards it, above the training step "
    "({step}): more GPUs do not lower this moment; a card that holds the 4-bit model does."
)


@dataclass
class Sharding:
    """How one process's bill differs from a single GPU's."""

    strategy: str  # ddp | fsdp | deepspeed_zero3
    world: int
    static: dict  # the step's static terms as one process holds them
    grads: int
    opt_temp: int
    persistent: dict = field(default_factory=dict)  # in every moment (DDP's gradient buckets)
    inflight: dict = field(default_factory=dict)  # in forward and backward (gathered units, reduce-scatter)
    load: dict | None = None  # the load-time moment, when it can outgrow the step
    cpu_offload_bytes: int = 0  # moved to CPU RAM by cpu_offload
    nccl: int = 0

    def record(self) -> dict:
        return {
            "gpus": self.world,
            "strategy": self.strategy,
            "cpu_offload_bytes": int(self.cpu_offload_bytes),
            "load_peak_bytes": int(sum(self.load.values())) if self.load else 0,
        }


def unit_bytes(spec: ModelSpec, plan: Plan) -> tuple[int, int]:
    """(one decoder layer, the root unit: embeddings + lm_head + final norm) in bytes as they are gathered: 4-bit
    layers in their packed storage, everything else in the load dtype."""
    load = DTYPE_BYTES[plan.load_dtype]
    norms = spec.norms_per_layer * spec.hidden_size * load
    if plan.tuning == "qlora":
        packed = sum(
            sum(quantized_bytes(s.in_features * s.out_features, plan.double_quant))
            for s in spec.decoder_linears
        )
        layer = packed // spec.num_layers + norms
    else:
        layer = spec.linear_params // spec.num_layers * load + norms
    root = (spec.embedding_params + spec.lm_head_params + spec.hidden_size) * load
    return layer, root


def shard(
    plan: Plan, spec: ModelSpec, static: dict, grads: int, opt_temp: int, trainable: int, param_bytes: int
) -> Sharding:
    """One process's share of a step's static terms under `plan.strategy` (resolved: ddp | fsdp |
    deepspeed_zero3) on `plan.gpus` processes."""
    n, strategy = plan.gpus, plan.strategy
    nccl = NCCL_CONTEXT_BYTES if plan.device == "cuda" else 0
    if strategy == "ddp":
        return Sharding(
            strategy, n, dict(static), grads, opt_temp, persistent={"comm_buffers": grads}, nccl=nccl
        )
    divided = {k: (-(-v // n) if k in DIVIDED else v) for k, v in static.items()}
    grads_n, temp_n = -(-grads // n), -(-opt_temp // n)
    layer, root = unit_bytes(spec, plan)
    layer_grads = (
        trainable // spec.num_layers * param_bytes
    )  # one unit's LoRA gradients before reduce-scatter
    if strategy == "deepspeed_zero3":
        # ZeRO-3's reduce bucket (HF "auto": hidden^2 elements) holds gradients on their way to their owners
        comm = min(trainable, spec.hidden_size**2) * param_bytes
    else:
        comm = 2 * layer_grads
    inflight = {"gathered_params": root + 2 * layer, "comm_buffers": comm}
    out = Sharding(strategy, n, divided, grads_n, temp_n, inflight=inflight, nccl=nccl)
    if plan.cpu_offload:
        moved = sum(divided[k] for k in DIVIDED if k in divided) + grads_n
        out.cpu_offload_bytes = moved
        out.static = {k: (0 if k in DIVIDED else v) for k, v in divided.items()}
        out.grads, out.opt_temp = 0, 0  # the optimizer steps on the CPU
    if plan.tuning == "qlora":
        out.load = {"weights": static["weights"], "quant_constants": static["quant_constants"]}
    return out


def apply(sharding: Sharding, phase_components: dict) -> dict:
    """The moments of the step with the per-process terms added, and the load moment."""
    out = {}
    for phase, moment in phase_components.items():
        extra = dict(sharding.persistent)
        # generation and eval: forwards too, layer by layer
        if phase in ("forward", "backward", "generation", "eval"):
            for k, v in sharding.inflight.items():
                extra[k] = extra.get(k, 0) + v
        out[phase] = {**moment, **{k: moment.get(k, 0) + v for k, v in extra.items()}}
    if sharding.load:
        out["load"] = dict(sharding.load)
    return out
