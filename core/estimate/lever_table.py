"""The table of the engine's memory levers: each one a Plan field with the value that turns it on, what it saves
(which term of the bill), what it costs, where it runs, and the library code its planner term is derived from.
core.estimate.levers reads it (per-lever savings, "What would make it fit", the "Fitting more" table of docs/planner.md).

`measured` says whether benchmarks/estimator_accuracy.py measures its term on the CPU; GPU-only levers are
modelled from their code ("modelled, not yet measured").
"""

from __future__ import annotations

from dataclasses import dataclass

from core.estimate.plan import OPTIMIZERS, Plan


@dataclass(frozen=True)
class Lever:
    field: str  # the Plan field
    on: object  # its value with the lever on
    off: object  # its value with the lever off (the comparison)
    label: str
    config_key: str | None  # where a run config sets it; None: the engine always has it on
    saves: str
    costs: str
    runs_on: str  # "CPU and GPU" | "CUDA GPU"
    measured: bool  # measured on the CPU by benchmarks/estimator_accuracy.py
    source: str  # the library code the planner term follows

    def applies(self, plan: Plan) -> bool:
        if self.field == "prepare_kbit":
            return plan.tuning == "qlora"
        if self.field == "lora_dropout":
            return plan.tuning != "full"
        if self.field == "expandable_segments":
            return plan.device == "cuda"
        return True

    def off_value(self, plan: Plan):
        """The value with the lever off: the plan's own where it has one (its dropout, its optimizer)."""
        value = getattr(plan, self.field)
        if self.field in ("lora_dropout", "optim") and not self.is_on(plan):
            return value
        return self.off

    def is_on(self, plan: Plan) -> bool:
        value = getattr(plan, self.field)
        if self.field == "optim":
            return OPTIMIZERS.get(value, (0, 0, ""))[2].startswith("bnb8")
        return value == self.on

    @property
    def setting(self) -> str:
        """How a user turns it on, as they would write it."""
        if self.config_key is None:
            return "the engine's default (TRL's SFTTrainer)"
        if self.config_key == "PYTORCH_CUDA_ALLOC_CONF":
            return "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        value = ("true" if self.on else "false") if isinstance(self.on, bool) else self.on
        return f"{self.config_key}: {value}"

    @property
    def term(self) -> str:
        """How far its planner term is checked."""
        return "measured on CPU" if self.measured else "modelled, not yet measured"


LEVERS: tuple[Lever, ...] = (
    Lever(
        "gradient_checkpointing",
        True,
        False,
        "Gradient checkpointing",
        "training.gradient_checkpointing",
        "saved activations: one input per layer, one layer recomputed at a time in backward",
        "each layer's forward runs twice (~20-30% slower)",
        "CPU and GPU",
        True,
        "torch.utils.checkpoint (non-reentrant) via transformers' gradient_checkpointing_enable",
    ),
    Lever(
        "fused_lm_head",
        True,
        False,
        "Fused LM head (tiled loss)",
        None,
        "the (tokens x vocab) logits, their fp32 copy and gradient: the loss is computed in tiles",
        "none measurable; always on in the engine (TRL's SFTTrainer); off = plain Trainer, for comparison",
        "CPU and GPU",
        True,
        "trl.trainer.utils.add_fused_lm_head, trl.kernels.chunked_logprob",
    ),
    Lever(
        "prepare_kbit",
        False,
        True,
        "QLoRA without the fp32 upcast",
        None,
        "embeddings, lm_head and norms stay 16-bit (no fp32 copies), a 16-bit residual stream",
        "none; always so in the engine (TRL casts the adapters to bf16); on = peft's "
        "prepare_model_for_kbit_training, for comparison",
        "CPU and GPU",
        True,
        "trl SFTTrainer.__init__ (quantized models) vs peft.prepare_model_for_kbit_training",
    ),
    Lever(
        "padding_free",
        True,
        False,
        "Padding-free batches",
        "training.padding_free",
        "padding: every per-token term follows the tokens really in the batch (plan with the data's lengths)",
        "needs flash_attention_2 on the GPU: on sdpa a (tokens x tokens) mask is built and copied per layer",
        "CPU and GPU",
        True,
        "trl DataCollatorForLanguageModeling(padding_free), transformers masking_utils packed sequences",
    ),
    Lever(
        "packing",
        True,
        False,
        "Packing (BFD)",
        "training.packing",
        "nothing per step (packed rows are full); fewer steps per epoch: faster",
        "BFD packing turns padding-free on (same attention needs); documents share rows",
        "CPU and GPU",
        True,
        "trl.data_utils.pack_dataset",
    ),
    Lever(
        "activation_offloading",
        True,
        False,
        "Activation offloading",
        "training.activation_offloading",
        "saved activations move to pinned CPU memory during forward, back for backward",
        "pinned CPU RAM about the size of what it moves; PCIe copies (overlapped on a stream, ~5-15% slower)",
        "CUDA GPU",
        False,
        "trl.models.activation_offloading.OffloadActivations",
    ),
    Lever(
        "liger",
        True,
        False,
        "Liger kernels",
        "training.use_liger_kernel",
        "RMSNorm saves no fp32 copy, SwiGLU no silu(gate); SwiGLU gradients written in place",
        "needs liger-kernel and Triton (pip install liger-kernel)",
        "CUDA GPU",
        False,
        "liger_kernel.ops.rms_norm, liger_kernel.ops.swiglu",
    ),
    Lever(
        "lora_dropout",
        0.0,
        0.05,
        "LoRA dropout 0",
        "lora.lora_dropout",
        "each adapted module's dropout output and mask",
        "no dropout regularisation of the adapter",
        "CPU and GPU",
        True,
        "peft.tuners.lora.layer.Linear.forward",
    ),
    Lever(
        "optim",
        "adamw_8bit",
        "adamw_torch",
        "8-bit AdamW",
        "training.optim",
        "optimizer states: 2 x 1 byte per trainable parameter instead of 2 x 4",
        "none measurable",
        "CPU and GPU",
        True,
        "bitsandbytes.optim.AdamW8bit (blockwise 8-bit states)",
    ),
    Lever(
        "expandable_segments",
        True,
        False,
        "Expandable segments",
        "PYTORCH_CUDA_ALLOC_CONF",
        "allocator fragmentation (reserved minus allocated)",
        "none",
        "CUDA GPU",
        False,
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch caching allocator)",
    ),
)
BY_FIELD = {lever.field: lever for lever in LEVERS}


# Levers that lower the bound without changing what is trained (padding-free and packing change the batch's
# shape, not its bound; LoRA dropout is part of the training recipe)
BOUND_LEVERS = (
    "gradient_checkpointing",
    "fused_lm_head",
    "prepare_kbit",
    "activation_offloading",
    "liger",
    "optim",
    "expandable_segments",
)
