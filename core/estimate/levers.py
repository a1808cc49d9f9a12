"""Every memory lever the engine has: what it saves (which term of the bill), what it costs, where it runs, and the
library code its planner term is derived from. The Estimate page's toggles, `python -m core.estimate`'s flags and
per-lever savings, "What would make it fit" and the README's "Fitting more" table all read this one list.

A lever is a Plan field with the value that turns it on. `measured` says whether benchmarks/estimator_accuracy.py
measures its term on the CPU; GPU-only levers are modelled from their code ("modelled, not yet measured").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.estimate.bill import estimate
from core.estimate.fit import largest
from core.estimate.plan import OPTIMIZERS, Plan, PlanError
from core.estimate.specs import ModelSpec, SpecError, load_spec


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
            return plan.method == "qlora"
        if self.field == "lora_dropout":
            return plan.method != "full"
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


def with_every_lever(plan: Plan) -> Plan:
    """`plan` with every lever of BOUND_LEVERS on that applies to it ("every lever on")."""
    changes = {}
    for field in BOUND_LEVERS:
        lever = BY_FIELD[field]
        if lever.applies(plan) and not lever.is_on(plan):
            changes[field] = lever.on
    return replace(plan, **changes)


def lever_savings(plan: Plan, spec: ModelSpec | None = None) -> list[dict]:
    """For each lever that applies to `plan`: the device-total bytes it saves (its plan off minus its plan on,
    everything else as `plan` has it), whether it is on now, and what it costs."""
    spec = spec or load_spec(plan.model)
    out = []
    for lever in LEVERS:
        if not lever.applies(plan):
            continue
        try:
            on = estimate(replace(plan, **{lever.field: lever.on}), spec)
            off = estimate(replace(plan, **{lever.field: lever.off_value(plan)}), spec)
        except (PlanError, SpecError):
            continue
        out.append(
            {
                "lever": lever.field,
                "label": lever.label,
                "on": lever.is_on(plan),
                "saves_bytes": int(off.device_total_bytes - on.device_total_bytes),
                "cpu_pinned_bytes": int(on.cpu_pinned_bytes),
                "config_key": lever.config_key,
                "costs": lever.costs,
                "runs_on": lever.runs_on,
                "measured": lever.measured,
                "term": lever.term,
                "source": lever.source,
            }
        )
    return out


def _candidates(plan: Plan, spec: ModelSpec) -> list[tuple[str, dict, str, bool]]:
    """(label, plan change, cost, keeps what is trained) for every single change that could lower the bill. A
    smaller batch or length is the largest that fits (not a halving that gives away what would fit)."""
    out = []
    for lever in LEVERS:
        if lever.applies(plan) and not lever.is_on(plan):
            out.append((f"{lever.label} ({lever.setting})", {lever.field: lever.on}, lever.costs, True))
    if plan.method == "full":
        out.append(
            (
                "train a LoRA adapter instead of all weights",
                {"method": "lora"},
                "an adapter, not all weights",
                False,
            )
        )
    if plan.method == "lora":
        out.append(
            (
                "QLoRA: the base in 4-bit NF4",
                {"method": "qlora", "quant_type": "nf4"},
                "slower matmuls (dequantized on the fly); a 4-bit base",
                False,
            )
        )
    if plan.method == "qlora" and not plan.double_quant:
        out.append(("double quantization of the 4-bit constants", {"double_quant": True}, "none", True))
    if plan.optim != "paged_adamw_8bit" and plan.device == "cuda":
        out.append(
            (
                "paged 8-bit AdamW (paged_adamw_8bit)",
                {"optim": "paged_adamw_8bit"},
                "states can be evicted to CPU RAM under pressure",
                True,
            )
        )
    out += _sharding(plan, spec)
    if plan.batch_size > 1:
        batch = largest(plan, spec, "batch_size", plan.batch_size - 1) or plan.batch_size // 2
        steps = -(-plan.batch_size // batch)
        effective = (
            "same effective batch"
            if batch * steps == plan.batch_size
            else f"effective batch {batch * steps} for {plan.batch_size}"
        )
        out.append(
            (
                f"batch size {batch} with gradient_accumulation_steps x{steps} ({effective})",
                {"batch_size": batch, "batch_tokens": 0},
                "more, smaller steps (slower on a GPU with room to spare)",
                True,
            )
        )
    if plan.seq_len > 64:
        seq = largest(plan, spec, "seq_len", plan.seq_len - 1, step=64) or max(64, plan.seq_len // 2)
        out.append(
            (
                f"shorter sequences: {seq} tokens",
                {"seq_len": seq, "batch_tokens": 0},
                "longer rows truncated",
                False,
            )
        )
    return out


SHARDING_COST = (
    "every layer is all-gathered each step (DDP is faster when one card holds the model); the effective batch "
    "grows with the GPUs (or lower gradient_accumulation_steps)"
)


def _other_cards(change: dict) -> bool:
    """Does this change ask for other hardware (more GPUs, or sharding them) rather than a setting of this card?"""
    return "gpus" in change or "strategy" in change


def _sharding(plan: Plan, spec: ModelSpec) -> list[tuple[str, dict, str, bool]]:
    """FSDP on the GPUs the plan has (when it asks for DDP), and more GPUs with FSDP: the fewest of 2x, 4x, 8x
    that fits, else 8x (what one card cannot hold, FSDP spreads: shared/design/multi-gpu.md)."""
    if plan.device != "cuda" or plan.strategy == "deepspeed_zero3":
        return []
    out = []
    if plan.gpus > 1 and plan.strategy == "ddp":
        out.append(
            (
                f"FSDP over the {plan.gpus} GPUs (distributed.strategy: fsdp)",
                {"strategy": "fsdp"},
                SHARDING_COST,
                True,
            )
        )
    counts = [plan.gpus * k for k in (2, 4, 8)]
    chosen = counts[-1]
    for n in counts:
        try:
            if estimate(replace(plan, gpus=n, strategy="fsdp"), spec).verdict == "fits":
                chosen = n
                break
        except (PlanError, SpecError):
            return out
    machine = "" if chosen <= 8 else " (several machines: distributed.num_machines)"
    out.append(
        (
            f"{chosen} GPUs with FSDP (distributed.gpus: {chosen}, strategy: fsdp){machine}",
            {"gpus": chosen, "strategy": "fsdp"},
            f"needs {chosen} GPUs; " + SHARDING_COST,
            True,
        )
    )
    return out


def what_would_fit(plan: Plan, spec: ModelSpec | None = None) -> list[dict]:
    """Changes that lower the device total, each re-estimated with the bytes it saves and what it costs, largest
    saving first. When no single change that keeps what is trained fits, the first entry combines them: the levers that keep what is trained
    (largest saving first), then smaller batches, then shorter sequences, until the plan fits."""
    spec = spec or load_spec(plan.model)
    base = estimate(plan, spec)
    out = []
    for label, change, cost, keeps in _candidates(plan, spec):
        try:
            new = estimate(replace(plan, **change), spec)
        except (PlanError, SpecError):
            continue
        saved = base.device_total_bytes - new.device_total_bytes
        if saved > 0:
            out.append(_advice(label, change, cost, saved, new, keeps))
    out.sort(key=lambda c: -c["saves_bytes"])
    # no single change that keeps what is trained fits: lead with a combination of them (a shorter length
    # alone may fit, but it truncates the data)
    # (more GPUs fitting does not spare a one-card recipe: they are offered beside it)
    if base.verdict != "fits" and not any(
        c["verdict"] == "fits" and c["keeps_training"] and not _other_cards(c["settings"]) for c in out
    ):
        combo = _combined(plan, spec, base)
        if combo:
            out.insert(0, combo)
    return out


def _advice(label, change, cost, saved, new, keeps, combined=False) -> dict:
    return {
        "change": label,
        "settings": change,
        "saves_bytes": int(saved),
        "device_total_bytes": new.device_total_bytes,
        "cpu_pinned_bytes": new.cpu_pinned_bytes,
        "verdict": new.verdict,
        "costs": cost,
        "keeps_training": keeps,
        "combined": combined,
    }


def _combined(plan: Plan, spec: ModelSpec, base) -> dict | None:
    """Greedy: add the keeping change that saves most, re-estimate, repeat; then halve the batch, then the length;
    then drop every change the plan still fits without (the last added, smallest, first): a short list to act on."""

    def total(steps):
        p = plan
        for _, change, _ in steps:
            p = replace(p, **change)
        return estimate(p, spec)

    steps: list[tuple[str, dict, str]] = []
    current, est = plan, base

    def apply(label, change, cost) -> bool:
        nonlocal current, est
        try:
            new = estimate(replace(current, **change), spec)
        except (PlanError, SpecError):
            return False
        if new.device_total_bytes >= est.device_total_bytes:
            return False
        current, est = replace(current, **change), new
        steps.append((label, change, cost))
        return True

    while est.verdict != "fits":
        scored = []
        for label, change, cost, keeps in _candidates(current, spec):
            if not keeps or "batch_size" in change or _other_cards(change):
                continue  # more GPUs are offered on their own, never folded into a one-card recipe
            try:
                scored.append((estimate(replace(current, **change), spec), label, change, cost))
            except (PlanError, SpecError):
                continue
        scored = [s for s in scored if s[0].device_total_bytes < est.device_total_bytes]
        if not scored:
            break
        est, label, change, cost = min(scored, key=lambda s: s[0].device_total_bytes)
        current = replace(current, **change)
        steps.append((label, change, cost))
    while est.verdict != "fits" and current.batch_size > 1:
        if not apply("", {"batch_size": current.batch_size // 2, "batch_tokens": 0}, "more steps"):
            break
    while est.verdict != "fits" and current.seq_len > 64:
        if not apply(
            "", {"seq_len": max(64, current.seq_len // 2), "batch_tokens": 0}, "longer rows truncated"
        ):
            break
    if est.verdict != "fits":
        return None
    # halvings collapse into the final size, named once
    final = {}
    for name, text in (
        ("batch_size", "batch size {} (accumulate gradients)"),
        ("seq_len", "{}-token sequences"),
    ):
        halved = [s for s in steps if name in s[1]]
        if halved:
            final[name] = (text.format(halved[-1][1][name]), halved[-1][1], halved[-1][2])
    steps = [s for s in steps if "batch_size" not in s[1] and "seq_len" not in s[1]] + list(final.values())
    for i in reversed(range(len(steps))):
        trial = steps[:i] + steps[i + 1 :]
        if trial and total(trial).verdict == "fits":
            steps = trial
    if len(steps) < 2:
        return None
    est = total(steps)
    settings = {k: v for _, change, _ in steps for k, v in change.items()}
    keeps = not any(k in settings for k in ("seq_len", "method"))
    return _advice(
        " + ".join(label for label, _, _ in steps),
        settings,
        "; ".join(dict.fromkeys(cost for _, _, cost in steps)),
        base.device_total_bytes - est.device_total_bytes,
        est,
        keeps,
        combined=True,
    )


def modelled_note(plan: Plan) -> str | None:
    """One sentence naming the levers of `plan` whose terms are modelled from their code but not yet measured."""
    names = [lv.label for lv in LEVERS if not lv.measured and lv.applies(plan) and lv.is_on(plan)]
    if not names:
        return None
    return f"{', '.join(names)}: modelled from the library code, not yet measured on a GPU."


def readme_table() -> str:
    """The README's "Fitting more" table (tests/test_levers.py keeps the README in step with it)."""
    rows = [
        "| lever | run config | saves | costs | runs on | planner term (modelled from) |",
        "|---|---|---|---|---|---|",
    ]
    for lv in LEVERS:
        key = f"`{lv.config_key}`" if lv.config_key else "always on in the engine"
        rows.append(
            f"| {lv.label} | {key} | {lv.saves} | {lv.costs} | {lv.runs_on} | {lv.term} (`{lv.source}`) |"
        )
    return "\n".join(rows)


__all__ = [
    "LEVERS",
    "BY_FIELD",
    "Lever",
    "lever_savings",
    "modelled_note",
    "readme_table",
    "what_would_fit",
    "with_every_lever",
]
