"""Verification of a written export: structure, merged rows re-read from disk, and logits against
base+adapter (peft, unmerged) with dtype-aware tolerances."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from core.fmt import disk
from core.merge.delta import recompute_rows
from core.merge.errors import load_json
from core.merge.mapping import MergePlan
from core.merge.model_files import auto_model_class, load_tokenizer
from core.merge.shards import DTYPE_NAMES, read_safetensors_header

# Relative to the logits of the fp32 oracle; bf16 keeps 8 mantissa bits, so a merged bf16 model drifts by ~1e-2.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 2e-2)}
DEFAULT_PROMPTS = ("Hello! How are you today?", "The capital of France is", "def add(a, b):\n    return")


@dataclass
class Verification:
    mode: str  # full or quick
    passed: bool
    dtype: str
    messages: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None  # merged vs base+adapter (peft, unmerged), logits
    tolerance: float | None = None
    adapter_effect: float | None = None  # base+adapter vs base, logits
    merged_vs_base: float | None = None
    argmax_agreement: float | None = None
    spot_check_max_diff: float | None = None
    model_loads: bool | None = None
    tokenizer_loads: bool | None = None
    qlora_deviation: float | None = (
        None  # merged vs the adapter on the NF4-quantized base (what training saw)
    )

    def lines(self) -> list[str]:
        out = [f"verification ({self.mode}): {'PASSED' if self.passed else 'FAILED'}"]
        if self.max_abs_diff is not None:
            out.append(
                f"max |logits merged - base+adapter| = {self.max_abs_diff:.3g} (tolerance {self.tolerance:.3g}, "
                f"{self.dtype}); adapter effect max |Δ| = {self.adapter_effect:.3g}; merged vs base = "
                f"{self.merged_vs_base:.3g}; argmax agreement {self.argmax_agreement:.1%}"
            )
        if self.qlora_deviation is not None:
            out.append(
                f"QLoRA: max |logits merged - adapter on the 4-bit base| = {self.qlora_deviation:.3g} (expected, "
                "not an error: training saw NF4-rounded weights, the export holds the full-precision base)"
            )
        if self.spot_check_max_diff is not None:
            out.append(
                f"spot check of merged rows re-read from disk: max |Δ| = {self.spot_check_max_diff:.3g}"
            )
        return out + self.messages


def _prompt_ids(tokenizer, vocab_size: int) -> list[torch.Tensor]:
    ids = []
    for p in DEFAULT_PROMPTS:
        if tokenizer is not None:
            t = tokenizer(p, return_tensors="pt")["input_ids"]
        else:
            t = torch.tensor([[(ord(c) * 7) % vocab_size for c in p]])
        ids.append(t.clamp(max=vocab_size - 1))
    return ids


@torch.no_grad()
def _logits(model, prompts, device) -> list[torch.Tensor]:
    return [model(input_ids=p.to(device)).logits.float().cpu() for p in prompts]


def verify_export(
    plan: MergePlan, out_dir: Path, mode: str = "full", device: str = "cpu", qlora: bool = False
) -> Verification:
    """Check the written export. quick: every shard's header matches the plan, merged rows re-read and compared
    with a recomputation, config and tokenizer load. full: also logits of the merged model (loaded with
    AutoModelForCausalLM) against the base with the adapter applied by peft (unmerged), on fixed prompts."""
    v = Verification(mode=mode, passed=True, dtype=DTYPE_NAMES[plan.out_dtype])
    _check_structure(plan, out_dir, v)
    _spot_check_merged_rows(plan, out_dir, v)
    tokenizer = _check_config_and_tokenizer(out_dir, v)
    if mode != "full" or not v.passed:
        return v
    _compare_logits(plan, out_dir, tokenizer, device, qlora, v)
    return v


def _fail(v: Verification, message: str) -> None:
    v.passed = False
    v.messages.append(message)


def _check_structure(plan: MergePlan, out_dir: Path, v: Verification) -> None:
    """Every planned tensor is present in its shard with its shape and dtype."""
    for shard, tensors in plan.shards:
        header, _ = read_safetensors_header(out_dir / shard)
        if header.get("__metadata__", {}).get("format") != "pt":
            _fail(v, f"{shard} lacks the {{'format': 'pt'}} metadata.")
        for t in tensors:
            h = header.get(t.out_key)
            if h is None or tuple(h["shape"]) != tuple(t.shape) or h["dtype"] != t.out_code:
                _fail(v, f"{shard}: tensor {t.out_key} is missing or has the wrong shape/dtype.")


def _spot_check_merged_rows(plan: MergePlan, out_dir: Path, v: Verification) -> None:
    """The first and last rows of each merged tensor, re-read through safe_open, against a recomputation."""
    worst, worst_scale = 0.0, 0.0
    shard_of = {t.out_key: s for s, ts in plan.shards for t in ts}
    for t in plan.tensors:
        if not t.changed:
            continue
        with safe_open(str(out_dir / shard_of[t.out_key]), "pt") as f:
            sl = f.get_slice(t.out_key)
            rows = t.shape[0] if t.shape else 1
            for start in {0, max(0, rows - 2)}:
                stop = min(rows, start + 2)
                got = (sl[start:stop] if t.shape else f.get_tensor(t.out_key)).float()
                want = recompute_rows(t, plan.base, start, stop)
                if want.numel():
                    worst = max(worst, (got.reshape(want.shape) - want).abs().max().item())
                    worst_scale = max(worst_scale, want.abs().max().item())
    v.spot_check_max_diff = worst
    # A block matmul may differ from the full one in the last bit, then round one ulp apart; a corrupt write
    # (wrong offset, wrong dtype) is off by the size of the weights themselves.
    spot_tol = 4 * torch.finfo(plan.out_dtype).eps * (1 + worst_scale)
    if worst > spot_tol:
        _fail(v, "Merged rows read back from disk differ from their recomputation: the export is corrupt.")


def _check_config_and_tokenizer(out_dir: Path, v: Verification):
    """The export's config.json loads with AutoConfig and its tokenizer (if any) with AutoTokenizer; returns
    the tokenizer (None without one)."""
    from transformers import AutoConfig  # transformers takes seconds to import: only when a merge verifies

    try:
        AutoConfig.from_pretrained(str(out_dir))
    except Exception as e:
        _fail(v, f"config.json does not load with AutoConfig: {e}")
    if not (out_dir / "tokenizer_config.json").is_file():
        v.messages.append(
            "No tokenizer files were found in the adapter or base folder: the export has no tokenizer."
        )
        return None
    try:
        tokenizer = load_tokenizer(out_dir)
        v.tokenizer_loads = True
        return tokenizer
    except Exception as e:
        v.tokenizer_loads = False
        _fail(v, f"The tokenizer does not load with AutoTokenizer: {type(e).__name__}: {e}")
        return None


def _compare_logits(
    plan: MergePlan, out_dir: Path, tokenizer, device: str, qlora: bool, v: Verification
) -> None:
    """The full check: the merged model's logits against base+adapter (peft, unmerged) on fixed prompts, within
    the output dtype's tolerance, and visibly different from the base's."""
    prompts = _prompt_ids(tokenizer, plan.config.get("vocab_size") or 32)
    device = _logits_device(plan, device, v)
    reference = _reference_logits(plan, prompts, device, v)
    if reference is None:
        return
    ref, base_logits = reference
    got = _merged_logits(out_dir, prompts, device, v)
    if got is None:
        return
    if qlora:
        v.qlora_deviation = _qlora_deviation(plan, prompts, got, device, v)
    atol, rtol = TOLERANCES[plan.out_dtype]
    scale = max(r.abs().max().item() for r in ref)
    v.tolerance = atol + rtol * scale
    v.max_abs_diff = max((g - r).abs().max().item() for g, r in zip(got, ref, strict=True))
    v.adapter_effect = max((r - b).abs().max().item() for r, b in zip(ref, base_logits, strict=True))
    v.merged_vs_base = max((g - b).abs().max().item() for g, b in zip(got, base_logits, strict=True))
    agree = [(g.argmax(-1) == r.argmax(-1)).float().mean().item() for g, r in zip(got, ref, strict=True)]
    v.argmax_agreement = sum(agree) / len(agree)
    if v.max_abs_diff > v.tolerance:
        _fail(
            v,
            f"The merged model's logits differ from base+adapter by {v.max_abs_diff:.3g} (> {v.tolerance:.3g}): "
            "the merge is wrong. Please report this adapter/base pair.",
        )
    if v.merged_vs_base <= v.tolerance:
        _fail(
            v,
            f"The merged model is indistinguishable from the base (max |Δ| {v.merged_vs_base:.3g}): the adapter "
            "changes nothing (an untrained adapter, lora_B all zeros?).",
        )


def _reference_logits(
    plan: MergePlan, prompts, device: str, v: Verification
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """(base+adapter logits, base logits) from peft on the fp32 base; None (and a failure) when it cannot run."""
    # peft and transformers take seconds to import: only for the full check
    from peft import PeftModel

    try:
        base_model = _auto(plan.base_dir).from_pretrained(str(plan.base_dir), dtype=torch.float32).to(device)
        if plan.new_vocab_size:  # as in training: resized first, the adapter then brings the trained rows
            base_model.resize_token_embeddings(plan.new_vocab_size, mean_resizing=False)
        peft_model = PeftModel.from_pretrained(base_model, str(plan.adapter.dir)).to(device).eval()
        ref = _logits(peft_model, prompts, device)
        with peft_model.disable_adapter():
            base_logits = _logits(peft_model, prompts, device)
        del peft_model, base_model
    except Exception as e:
        _fail(v, f"Could not run the base with the adapter through peft: {type(e).__name__}: {e}")
        return None
    return ref, base_logits


def _merged_logits(out_dir: Path, prompts, device: str, v: Verification) -> list[torch.Tensor] | None:
    """The export's logits, loaded as any user loads it; None (and a failure) when it does not load."""
    try:
        merged = _auto(out_dir).from_pretrained(str(out_dir), dtype=torch.float32).to(device).eval()
        v.model_loads = True
        got = _logits(merged, prompts, device)
        del merged
    except Exception as e:
        v.model_loads = False
        _fail(v, f"The export does not load with transformers: {type(e).__name__}: {e}")
        return None
    return got


def _auto(folder: Path):
    """The auto class the model in `folder` loads with (a VLM's, or a causal LM's: core.merge.model_files)."""
    return auto_model_class(load_json(Path(folder) / "config.json", "export the model again."))


def _logits_device(plan: MergePlan, device: str, v: Verification) -> str:
    """Where the logits check runs. It loads the whole model in float32 (4 bytes a parameter), which the merge
    itself never does: on a GPU that cannot hold it (a 7B model is ~28 GB, an RTX 4090 has 24) it runs on
    the CPU instead of failing the merge with CUDA out of memory. The preflight sized it for the RAM."""
    if device != "cuda":
        return device
    need = sum(math.prod(t.shape) for t in plan.tensors) * 4 + plan.adapter.nbytes
    try:
        torch.cuda.empty_cache()  # blocks the merge's deltas left cached count as taken in mem_get_info
        free, _total = torch.cuda.mem_get_info()
    except Exception:  # no figure: trust the GPU
        return device
    if need * 1.2 < free:  # activations and the allocator's rounding on top of the weights
        return device
    v.messages.append(
        f"The logits check needs ~{disk(need)} of GPU memory in float32 but {disk(free)} is free: it ran on the CPU."
    )
    return "cpu"


def _qlora_deviation(plan: MergePlan, prompts, merged_logits, device: str, v: Verification) -> float | None:
    """How far the export is from what QLoRA training saw: the adapter on the NF4-quantized base. A figure to
    report, not a pass/fail check (the usual merge into the full-precision base is never bit-identical)."""
    # peft, transformers and bitsandbytes take seconds to import (bitsandbytes may be missing): only for QLoRA
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        q = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(plan.base_dir), quantization_config=q, dtype=torch.float32, device_map={"": device}
        )
        model = PeftModel.from_pretrained(model, str(plan.adapter.dir)).eval()
        ref = _logits(model, prompts, device)
        del model
    except Exception as e:  # bitsandbytes missing or unsupported here: the figure is optional
        v.messages.append(f"QLoRA deviation not measured ({type(e).__name__}: {e}).")
        return None
    return max((g - r).abs().max().item() for g, r in zip(merged_logits, ref, strict=True))
