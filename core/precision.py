"""The one precision resolver: which dtypes a run config trains in on a given device.

The planner (core.estimate.from_config), the trainer (core.train) and the tracker (core.measure) all ask this
module, so a plan and the run it describes can never disagree about precision. Light: torch is imported only to
look at the local GPU (`Device.local`) or to hand out a torch dtype (`torch_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The one dtype table: run-config name -> the planner's short name, and bytes per element
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LONG = {short: name for name, short in SHORT.items()}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Levers that need a CUDA GPU (TRL's offloading looks up the accelerator; Liger's kernels are Triton): a CPU run
# goes without them, and its plan does too.
CUDA_ONLY = ("activation_offloading", "use_liger_kernel")


# bitsandbytes' settings: made for a CUDA GPU. On a CPU they run (slowly), so a plan made for a card must not bring
# them to a CPU run unasked: path -> what it does there, said where the Train page keeps them off.
BNB_OPTIMIZERS = (
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "paged_lion_8bit",
)  # fmt: skip
ON_CPU = {
    "quantization.load_in_4bit": "4-bit loading (QLoRA) runs bitsandbytes' CPU kernels there: many times slower "
    "than the plain model, and bitsandbytes itself warns that they may give silently incorrect results",
    "training.optim": "a paged or 8-bit optimizer (bitsandbytes) pages its states out of GPU memory, and a CPU has "
    "none to save; its 8-bit states run slower CPU code",
}


def gpu_settings(cfg: dict) -> list[str]:
    """The keys of `cfg` (ON_CPU) set to what only a CUDA GPU gains from: 4-bit loading, a bitsandbytes optimizer."""
    found = []
    if (cfg.get("quantization") or {}).get("load_in_4bit"):
        found.append("quantization.load_in_4bit")
    if (cfg.get("training") or {}).get("optim") in BNB_OPTIMIZERS:
        found.append("training.optim")
    return found


class PrecisionError(ValueError):
    """The config asks for a precision the device cannot do; the message says what to set instead."""


@dataclass(frozen=True)
class Device:
    """Where a run trains. kind "cpu" or "cuda"; a planned CUDA card is a bf16-capable one (Ampere and newer:
    RTX 30xx/40xx, A6000, L40), which is what the planner's presets describe."""

    kind: str = "cuda"
    name: str = ""  # what the trainer prints and status.json records, e.g. "cuda:0 (NVIDIA RTX 4090)"
    bf16_native: bool = True  # bf16 in hardware: what "auto" wants
    bf16_supported: bool = True  # including torch's slow emulation

    @classmethod
    def of(cls, kind: str) -> Device:
        """The device a plan assumes for "cpu" or "cuda" (a bf16-capable card)."""
        return (
            cls(kind) if kind == "cuda" else cls("cpu", name="cpu", bf16_native=False, bf16_supported=False)
        )

    @classmethod
    def local(cls) -> Device:
        """This machine's training device, as torch sees it (the first visible GPU, else the CPU)."""
        import torch

        if not torch.cuda.is_available():
            return cls.of("cpu")
        return cls(
            "cuda",
            name=f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})",
            bf16_native=torch.cuda.is_bf16_supported(including_emulation=False),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )

    @property
    def label(self) -> str:
        return self.name or self.kind


@dataclass(frozen=True)
class Precision:
    """How a run config trains on a device. Dtype names are the run config's (float32, bfloat16, float16)."""

    device: Device
    dtype: str  # the weights' load dtype (non-quantized parts for QLoRA)
    compute: str  # activations: the autocast dtype, else the load dtype (QLoRA: bnb_4bit_compute_dtype)
    autocast: bool  # Trainer bf16/fp16 flag: forward under torch.autocast
    bf16: bool
    fp16: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def on_cpu(self) -> bool:
        return self.device.kind == "cpu"

    @property
    def quant_compute(self) -> str:
        """bnb_4bit_compute_dtype for QLoRA ("auto" resolved): the 4-bit matmuls' dtype."""
        return self.compute


def resolve(cfg: dict, device: Device) -> Precision:
    """The precision of a validated run config on `device`.

    CPU: never autocast; model.dtype "auto" loads float32, and float16 weights are loaded as float32 (CPU training
    cannot use them). CUDA: training.bf16 "auto" = native bf16; the Trainer's bf16/fp16 flag is the autocast dtype
    and model.dtype "auto" loads in it; without a flag the step computes in the load dtype. QLoRA's 4-bit matmuls
    compute in bnb_4bit_compute_dtype ("auto": the load dtype) when nothing autocasts."""
    t, m, q = cfg["training"], cfg["model"], cfg["quantization"]
    notes = []
    if device.kind == "cpu":
        if t.get("bf16") is True or t.get("fp16"):
            notes.append("bf16/fp16 requested but there is no CUDA GPU: training in float32 on the CPU")
        bf16 = fp16 = False
        dtype = m["dtype"] if m["dtype"] != "auto" else "float32"
        if dtype == "float16":
            notes.append("float16 weights are not supported for CPU training: loading float32")
            dtype = "float32"
        notes += [
            f"training.{key} works on a CUDA GPU only: this CPU run goes without it"
            for key in CUDA_ONLY
            if t.get(key)
        ]
    else:
        bf16 = device.bf16_native if t.get("bf16") == "auto" else bool(t.get("bf16"))
        if bf16 and t.get("fp16"):
            notes.append(
                "training.fp16 is true but training.bf16 is auto on a bf16 GPU: training in bf16 "
                "(set bf16: false to train in fp16)"
            )
        if bf16 and not device.bf16_supported:
            raise PrecisionError(
                "training.bf16 is true but this GPU has no bfloat16 support: set bf16: false, fp16: true."
            )
        fp16 = bool(t.get("fp16")) and not bf16
        mixed = "bfloat16" if bf16 else "float16" if fp16 else None
        dtype = m["dtype"] if m["dtype"] != "auto" else (mixed or "float32")
    autocast = bf16 or fp16
    compute = "bfloat16" if bf16 else "float16" if fp16 else dtype
    if q.get("load_in_4bit") and q.get("bnb_4bit_compute_dtype", "auto") != "auto" and not autocast:
        compute = q["bnb_4bit_compute_dtype"]
    return Precision(device, dtype, compute, autocast, bf16, fp16, tuple(notes))


def torch_dtype(name: str):
    """torch's dtype for a run-config or short name (float32/bfloat16/float16 or fp32/bf16/fp16)."""
    import torch

    return getattr(torch, LONG.get(name, name))
