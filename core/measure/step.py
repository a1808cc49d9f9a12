"""Measure a training configuration for real: build the model the way a run builds it (transformers + peft +
bitsandbytes, gradient checkpointing, the optimizer Trainer would pick, and either TRL's SFTTrainer
preparation -- fused LM head, bf16 QLoRA adapters -- or the plain Trainer path with
`prepare_model_for_kbit_training`), run one step under the tracker, and compare with the planner.

- `measure_plan(config, plan, num_layers=...)`: one step of `plan` (a core.estimate Plan, core.measure.step_plan) on a
  model built from a transformers config (random weights; the memory of a step does not depend on their values).
- `measure_depths(config, plan)`: the real widths at 2 and 3 layers, extrapolated to the full depth per phase
  (per-layer term = m3 - m2, the rest is constant): how we measure 7B-70B models on a CPU.
- `measure_config(model_dir_or_config, plan_or_run_config)`: one step of the user's model, measured vs estimated.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from core.estimate.plan import Plan, batch_shape, flat_batch
from core.estimate.specs import decoder_layers
from core.measure.build import ENGINE_TRAINERS, build_model, build_optimizer, with_layers
from core.measure.step_plan import StepOptions, autocast_dtype, checked, estimate_for, plan_of_config
from core.recipe import methods
from core.tracker import StepMemory, TrackerError, main_phase, main_phase_peaks, track_live_tensors


def make_batch(config, plan: Plan, seed: int = 0) -> dict:
    """A full batch of random tokens with labels, of the shape the planner plans (core.estimate.plan.batch_shape):
    rows padded to the longest with an all-ones attention mask, as a padding collator gives for equal-length rows;
    or, padding-free (or BFD-packed), what TRL's collator makes of them: one row of every token with position_ids
    (two documents per packed row). `plan.batch_tokens` below the bound gives uneven rows: full rows of seq_len
    and one shorter row with the rest (512 + 320 for 832 tokens at batch 2 x 512)."""
    g = torch.Generator().manual_seed(seed)
    own = methods.get(plan.method).measure_batch(
        g, config.vocab_size, plan.batch_size, plan.seq_len, plan.precompute_ref
    )
    if own is not None:
        return own
    if not flat_batch(plan):
        ids = torch.randint(0, config.vocab_size, (plan.batch_size, batch_shape(plan)[1]), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = []
    for length in row_lengths(plan):
        row = torch.randint(0, config.vocab_size, (length,), generator=g).tolist()
        example = {"input_ids": row, "labels": row}
        if plan.packing:
            half = max(1, length // 2)
            example["seq_lengths"] = [half, length - half] if length > half else [length]
        rows.append(example)
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)


def row_lengths(plan: Plan) -> list[int]:
    """The rows of a flat batch: full rows of seq_len, then what is left of batch_tokens (0: the bound)."""
    tokens = plan.batch_tokens or plan.batch_size * plan.seq_len
    full, rest = divmod(tokens, plan.seq_len)
    return [plan.seq_len] * full + ([rest] if rest else [])


def _trainer_forward(model, plan: Plan, device_type: str = "cpu"):
    """Wrap forward as accelerate does under Trainer(bf16=True): autocast, outputs converted to fp32."""
    dt = autocast_dtype(plan)
    if dt is None:
        return contextlib.nullcontext()
    from accelerate.utils import convert_outputs_to_fp32

    original = model.forward
    model.forward = convert_outputs_to_fp32(torch.autocast(device_type, dtype=dt)(original))

    @contextlib.contextmanager
    def restore():
        try:
            yield
        finally:
            model.forward = original

    return restore()


def run_step(
    model, optimizer, batch, plan: Plan, options: StepOptions = StepOptions(), detail: bool = False
) -> StepMemory:
    """One Trainer-like step under the tracker: forward + loss, backward, grad clipping, optimizer step,
    zero_grad(set_to_none)."""
    model.train()
    device_type = batch["input_ids"].device.type
    with (
        _trainer_forward(model, plan, device_type),
        # On a GPU only GPU memory is the planner's business (torch keeps e.g. Adam's step counts on the CPU).
        track_live_tensors(
            model, optimizer, tensors=batch, device="cuda" if device_type == "cuda" else None, detail=detail
        ) as tr,
    ):
        hooks = _backward_landmarks(model, tr)
        # SFTTrainer.training_step runs compute_loss inside its activation-offloading context (a no-op when off)
        trainer = ENGINE_TRAINERS.get(model)
        offload = getattr(trainer, "maybe_activation_offload_context", None) or contextlib.nullcontext()
        with tr.phase("forward"), offload:
            loss = _loss(model, batch, plan)
        with tr.phase("backward"):
            loss.backward()
            del loss
        for h in hooks:
            h.remove()
        with tr.phase("optimizer"):
            if options.max_grad_norm:
                params = [p for p in model.parameters() if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result = tr.result()
    if detail:
        result.extra["peak_detail"] = tr.peak_detail
        result.extra["phase_detail"] = tr.phase_detail
    return result


def _backward_landmarks(model, tracker) -> list:
    """Name the moments of backward as sub-phases, so that each one's peak is linear in the depth:
    backward (loss, lm_head, final norm), :first-layer (the last decoder layer, met first), :middle,
    :last-layer (layer 0), :tail (the embedding). Where in backward the peak falls moves with the depth
    (activations drain while gradients pile up); within each of these moments it does not."""
    layers = _decoder_layers(model)
    n = len(layers)

    def landmark(name):
        def on_output(_module, _args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            # not during checkpoint recomputation (inside backward): that output is never backpropagated
            if torch.is_tensor(t) and t.requires_grad and torch._C._current_autograd_node() is None:
                t.register_hook(on_grad)

        def on_grad(_grad):  # the gradient w.r.t. this output is ready: its module's backward starts
            tracker.phase(name)

        return on_output

    hooks = []
    for i, layer in enumerate(layers):
        name = (
            "backward:first-layer" if i == n - 1 else "backward:last-layer" if i == 0 else "backward:middle"
        )
        hooks.append(layer.register_forward_hook(landmark(name)))
    hooks.append(model.get_input_embeddings().register_forward_hook(landmark("backward:tail")))
    return hooks


def _decoder_layers(model):
    layers = decoder_layers(model)  # the planner's own choice of blocks: what it plans is what is measured
    if layers is None:
        raise TrackerError(f"{type(model).__name__} has no decoder layers (no nn.ModuleList) to measure")
    return layers


def _loss(model, batch, plan: Plan | None = None):
    """The training loss as the trainer computes it; the outputs die here, before backward."""
    trainer = ENGINE_TRAINERS.get(model)
    if trainer is not None:
        return trainer.compute_loss(model, dict(batch))  # SFTTrainer's own (it edits the inputs: a copy)
    if plan is None or not plan.fused_lm_head:
        return model(**batch).loss  # Trainer.compute_loss: the (tokens x vocab) logits die with the outputs
    # SFTTrainer.compute_loss (trl 1.16, default loss_type "nll", no num_items_in_batch): per-token
    # log-probabilities from the fused head, then its logged metrics (entropy, mean_token_accuracy).
    outputs = model(**batch, use_cache=False, fused_lm_head=True)
    per_token_loss = -outputs.log_probs  # zero on ignored positions
    num_tokens = outputs.label_mask.sum()
    loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
    # the logged metrics: scalars, but the per-token outputs stay alive until they are taken
    num_valid = outputs.label_mask.sum().clamp(min=1)
    _ = (outputs.entropy.detach().sum() / num_valid, outputs.is_top1.sum() / num_valid)
    return loss


def measure_plan(
    config, plan: Plan, num_layers: int | None = None, cache_dir=None, options: StepOptions = StepOptions()
) -> StepMemory:
    """One measured step of `plan` on a model built from `config` (at `num_layers` when given)."""
    plan = checked(plan)
    if num_layers is not None:
        config = with_layers(config, num_layers)
    with tempfile.TemporaryDirectory() as tmp:
        model, cfg = build_model(config, plan, cache_dir or tmp, options=options)
        optimizer = build_optimizer(model, plan, options)
        return run_step(model, optimizer, make_batch(cfg, plan), plan, options)


# -- reduced depth ------------------------------------------------------------------------------------------
@dataclass
class DepthFit:
    """Per-phase peaks at two depths, extrapolated linearly in the number of layers."""

    layers: tuple[int, int]
    small: StepMemory
    large: StepMemory

    def _per_phase(self, which: str, num_layers: int) -> dict[str, int]:
        (l1, l2), out = self.layers, {}
        a, b = getattr(self.small, which), getattr(self.large, which)
        for p in a.keys() & b.keys():  # a "middle" layer exists only from 3 layers on: bounded by first/last
            per_layer = (b[p] - a[p]) // (l2 - l1)
            out[p] = a[p] + (num_layers - l1) * per_layer
        return out

    def phase_peaks_at(self, num_layers: int, steady: bool = True) -> dict[str, int]:
        """Extrapolated peak of each phase (sub-phases folded in)."""
        return main_phase_peaks(
            self._per_phase("steady_phase_peaks" if steady else "phase_peaks", num_layers)
        )

    def peak_at(self, num_layers: int, steady: bool = True) -> tuple[int, str]:
        """(bytes, phase) of the extrapolated peak. steady=True: a later step (optimizer state alive)."""
        peaks = self._per_phase("steady_phase_peaks" if steady else "phase_peaks", num_layers)
        phase = max(peaks, key=peaks.get)
        return peaks[phase], main_phase(phase)

    def saved_at(self, num_layers: int) -> int:
        (l1, l2), a, b = self.layers, self.small.saved_bytes, self.large.saved_bytes
        return a + (num_layers - l1) * ((b - a) // (l2 - l1))


def num_layers_of(config) -> int:
    n = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not n:
        raise TrackerError(f"{type(config).__name__} has no num_hidden_layers: not a decoder config")
    return int(n)


def measure_depths(
    config, plan: Plan, layers=(2, 3), seq_lens=None, cache_dir=None, options: StepOptions = StepOptions()
) -> dict[int, DepthFit]:
    """Measure `plan` at the real widths with layers[0] and layers[1] decoder layers, for each sequence length
    in `seq_lens` (default: the plan's). Returns {seq_len: DepthFit}; `fit.peak_at(num_layers_of(config))`.

    Why 2 and 3 layers by default, not 1 and 2: the first layer saves less (its input comes from a frozen
    embedding, so e.g. LoRA dropout keeps no mask there) and the last one differs too; a 1-layer model is both
    at once, so m(2) - m(1) is not a middle layer's bytes. From 2 layers on, each added layer is a middle one."""
    out = {}
    for s in seq_lens or [plan.seq_len]:
        p = replace(plan, seq_len=s)
        small, large = (measure_plan(config, p, n, cache_dir, options) for n in layers)
        out[s] = DepthFit(tuple(layers), small, large)
    return out


# -- the smoke-test hook ---------------------------------------------------------------------------------------
def measure_config(model_dir_or_spec, plan_or_run_config: Plan | dict, device: str = "cpu") -> dict:
    """One real step of the user's model under the tracker, next to the planner's estimate of the same Plan.
    `model_dir_or_spec`: a local model folder (its weights are loaded) or a transformers config.
    `plan_or_run_config`: a Plan (run on its own device) or a run config (planned for `device`).
    Returns {"measured": StepMemory as dict, "estimated": planner figures or None, "error": relative error}."""
    src = model_dir_or_spec
    if isinstance(src, (str, os.PathLike)) and not (Path(src) / "config.json").exists():
        raise TrackerError(
            f"{src} is not a model folder (no config.json); pass a local model folder or a config"
        )
    options = StepOptions()
    if isinstance(plan_or_run_config, Plan):
        plan = checked(plan_or_run_config)
    else:
        plan = plan_of_config(plan_or_run_config, device)
        grad_norm = (plan_or_run_config.get("training") or {}).get("max_grad_norm")
        options = StepOptions(max_grad_norm=1.0 if grad_norm is None else float(grad_norm))
    device = plan.device
    if device != "cpu" and not torch.cuda.is_available():
        raise TrackerError(f"device {device!r} asked for but CUDA is not available; use device='cpu'")
    with tempfile.TemporaryDirectory() as tmp:
        model, cfg = build_model(src, plan, tmp, options=options)
        optimizer = build_optimizer(model, plan, options)
        batch = {k: v.to(device) for k, v in make_batch(cfg, plan).items()}
        measured = run_step(model, optimizer, batch, plan, options)
        if not isinstance(src, (str, os.PathLike)):  # the planner reads a folder's config.json
            src = Path(tmp) / "planner-config"
            src.mkdir()
            cfg.to_json_file(str(src / "config.json"))
        estimated = estimate_for(str(src), plan)
    out = {"measured": measured.to_dict(), "estimated": estimated, "error": None}
    if estimated and estimated.get("tensor_peak_bytes"):
        # the planner predicts a steady step (optimizer state alive), which the first step's figures give
        out["error"] = estimated["tensor_peak_bytes"] / measured.steady_peak_bytes - 1
    return out


def to_json(result: dict) -> str:
    return json.dumps(result, indent=2, default=str)
