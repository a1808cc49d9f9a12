"""The one mapping from a run config to the planner's input (a core.estimate Plan).

Everything that plans or measures a run goes through `plan_for_config`: the Train page's estimate, the launcher's
plan.json, the smoke test, the tracker and the benchmarks. Its dtypes follow core.train.trainer.choose_precision
for the device, and its memory switches follow what the engine (TRL's SFTTrainer) really does.
"""

from __future__ import annotations

from core.estimate.bill import Plan
from core.train.config import checkpointing

# The planner models sdpa, eager and flash (varlen kernels: no mask); flex attention keeps no score matrix
# either, like sdpa.
PLAN_ATTN = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flex_attention": "sdpa"}
PLAN_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def method_of(cfg: dict) -> str:
    if not cfg["lora"]["enabled"]:
        return "full"
    return "qlora" if cfg["quantization"]["load_in_4bit"] else "lora"


def plan_dtypes(cfg: dict, device: str) -> tuple[str, str, bool]:
    """(load, compute, autocast) as choose_precision sets them up on `device` (a bf16-capable GPU for "cuda").

    CPU: never autocast; "auto" loads float32 and float16 weights are loaded as float32 (CPU training cannot use
    them), so the step computes in the load dtype. GPU: the Trainer's bf16/fp16 flag is the autocast dtype, and
    model.dtype "auto" loads in it; without a flag the step computes in the load dtype. QLoRA's 4-bit matmuls
    compute in bnb_4bit_compute_dtype ("auto": the load dtype)."""
    model_dtype, t, q = cfg["model"]["dtype"], cfg["training"], cfg["quantization"]
    if device == "cpu":
        load = "fp32" if model_dtype in ("auto", "float16") else PLAN_DTYPE[model_dtype]
        compute, autocast = load, False
    else:
        mixed = "bf16" if t.get("bf16") in (True, "auto") else ("fp16" if t.get("fp16") else None)
        load = (mixed or "fp32") if model_dtype == "auto" else PLAN_DTYPE[model_dtype]
        compute, autocast = mixed or load, mixed is not None
    if q.get("load_in_4bit") and q.get("bnb_4bit_compute_dtype", "auto") != "auto" and not autocast:
        compute = PLAN_DTYPE[q["bnb_4bit_compute_dtype"]]
    return load, compute, autocast


def plan_for_config(
    cfg: dict,
    gpu_gb: float = 24.0,
    device: str = "cuda",
    batch_size: int | None = None,
    expandable_segments: bool = False,
    model: str | None = None,
    smoke: bool = False,
) -> Plan:
    """The Plan that describes training `cfg` (a validated run config) on a `gpu_gb` card.

    `batch_size` overrides the config's (the smoke test runs at 1); `model` overrides model.path (a preset id
    or a folder with config.json, for planning a config against another model's shapes). `smoke`: the smoke
    test's step: one full row at batch size 1, without padding-free batching or packing (core.train.engine_args
    turns them off there: one full row is the same tensor either way)."""
    lo, t = cfg["lora"], cfg["training"]
    load, compute, autocast = plan_dtypes(cfg, device)
    targets = lo["target_modules"]
    dpo = cfg.get("method") == "dpo"
    fields = dict(
        model=model or cfg["model"]["path"],
        method=method_of(cfg),
        dpo=dpo,
        # DPOTrainer: the base with the adapter disabled, or a second model (full fine-tune, model.reference_path)
        dpo_reference="copy" if dpo and cfg["model"].get("reference_path") else "auto",
        dpo_precompute_ref=dpo and bool(t.get("precompute_ref_log_probs")),
        load_dtype=load,
        compute_dtype=compute,
        autocast=autocast,
        quant_type=cfg["quantization"]["bnb_4bit_quant_type"],
        double_quant=cfg["quantization"]["bnb_4bit_use_double_quant"],
        lora_r=lo["r"],
        lora_alpha=lo["lora_alpha"],
        # DPOConfig.disable_dropout (default on) sets every nn.Dropout to p=0, LoRA's too: an identity then
        lora_dropout=0.0 if dpo and t.get("disable_dropout", True) else lo["lora_dropout"],
        target_modules=targets if isinstance(targets, str) else ",".join(targets),
        batch_size=1 if smoke else (batch_size or t["per_device_train_batch_size"]),
        seq_len=t["max_length"],
        gradient_checkpointing=checkpointing(cfg),
        attn=PLAN_ATTN.get(cfg["model"]["attn_implementation"], cfg["model"]["attn_implementation"]),
        optim=t["optim"],
        gpu_gb=float(gpu_gb),
        expandable_segments=expandable_segments,
        device=device,
        # what SFTTrainer does: no prepare_model_for_kbit_training, the tiled (fused) LM head
        prepare_kbit=False,
        fused_lm_head=True,
        # DPOTrainer 1.16 turns padding_free off (it warns and pads)
        padding_free=bool(t.get("padding_free")) and not smoke and not dpo,
        packing=bool(t.get("packing")) and not smoke,
        packing_strategy=t.get("packing_strategy") or "bfd",
        activation_offloading=bool(t.get("activation_offloading")),
        liger=bool(t.get("use_liger_kernel")),
    )
    return Plan(**fields)


def estimate_for_config(cfg: dict, gpu_gb: float = 24.0, device: str = "cuda", batch_size=None, **kw):
    """core.estimate.estimate of plan_for_config(...); raises PlanError/SpecError with the planner's sentence."""
    from core.estimate.bill import estimate

    return estimate(plan_for_config(cfg, gpu_gb, device, batch_size, **kw))


def plan_record(est) -> dict:
    """What goes into a run's plan.json: the estimate's totals and the plan it was made for."""
    d = est.to_dict()
    d.pop("phase_components", None)  # per-phase detail: large and read by nobody downstream
    return d


def local_card() -> tuple[str, float]:
    """("cuda", the first GPU's GiB) when NVML sees one, else ("cpu", 24.0): what a run started here trains on."""
    from core.monitor.gpu import detect_gpus

    gpus, _ = detect_gpus()
    if gpus and gpus[0].memory_total:
        return "cuda", gpus[0].memory_total / 2**30
    return "cpu", 24.0


def plan_json(
    cfg: dict, gpu_gb: float | None = None, device: str | None = None, batch_size=None, smoke: bool = False
) -> dict:
    """The object a run's plan.json holds for `cfg` on this machine's card (or the one given); batch_size 1 for
    a smoke test's."""
    here, gb = local_card()
    return plan_record(estimate_for_config(cfg, gpu_gb or gb, device or here, batch_size, smoke=smoke))
