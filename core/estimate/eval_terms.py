"""The evaluation phase of the bill: what one evaluation (Trainer.evaluate, every eval_steps) holds at its largest
moment. It runs between two optimizer steps: next to the static terms (weights, a reference, the adapter and the
optimizer states; zero_grad has freed the gradients) and the last training batch, still referenced by the
training loop (on the CPU also the next one, which accelerate's loader has fetched already; on a GPU that one
waits in host memory). Every moment holds one eval batch of per_device_eval_batch_size examples (E).

- forward: the method's loss of the eval batch without autograd (prediction_step under torch.no_grad): one
  decoder layer's transients or TRL's fused head's tiles, whichever is larger. A preference method's reference
  forward follows the policy's, whose per-token outputs (log-probs, entropy, ...) it keeps alive.
- GRPO (traits.generates) generates its eval batch first (GRPOTrainer._prepare_inputs in eval mode: E completions
  at once, num_generations_eval per prompt, no buffering): the prefill, the last decoding step and the no-grad
  log-prob forwards of the generation phase at E, then the loss forward over them.
- samples: the samples callback (training.eval_samples) answers min(eval_samples, 32) held-out prompts greedily
  at each evaluation: a prompt as long as a row's prompt can be, then up to SAMPLES_MAX_TOKENS new tokens.
- kv cache: a KV cache of eval_kv_tokens (the Estimate page's figure for a generation of its own).

Not terms: the Trainer keeps each eval row's loss (4 bytes) until the evaluation ends (or moves them to the CPU
every eval_accumulation_steps), but no logits or predictions: the cockpit passes no compute_metrics, so
Trainer.evaluate sets prediction_loss_only, and SFT/DPO/KTO/GRPOTrainer's prediction_step then return only the
loss (TRL's fused head never builds the logits). Measured on the CPU (benchmarks/eval_accuracy.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.estimate.activation_terms import step_dtypes
from core.estimate.generation_terms import (
    decoding_moments,
    nograd_head_bytes,
    nograd_layer_bytes,
    rollout_held,
    rollout_moments,
)
from core.estimate.plan import Plan, batch_shape, generates
from core.estimate.specs import ModelSpec
from core.generate import GREEDY_BATCH
from core.recipe import methods
from core.recipe.config_keys import SAMPLES_MAX_TOKENS

# the evaluation phase's own components (the generation ones are shared with generation_terms)
EVAL_COMPONENTS = ("eval_batch", "eval_forward", "kv_cache", "generation_activations", "logprob_forward")
# greedy decoding's (sequences x vocab) fp32 tensors: the last logits' copy and a logits processor's output (the
# smoke test's min_new_tokens; a run without one holds the copy alone: planned as the bound)
GREEDY_COPIES = 2


@dataclass(frozen=True)
class Evaluation:
    """An evaluation at its largest moment, and every moment's total (static terms included)."""

    moment: str
    phase: dict  # its components, static terms included
    moments: dict
    rows: int  # examples per eval batch

    def record(self) -> dict:
        return {
            "bytes": int(sum(self.phase.values())),
            "moment": self.moment,
            "moments": dict(self.moments),
            "rows": self.rows,
            "components": {k: int(v) for k, v in self.phase.items() if v},
        }


def _batch_bytes(plan: Plan, tensors: int) -> int:
    """`tensors` int64 tensors as wide as `plan`'s batch (rows x length)."""
    rows, length = batch_shape(plan)
    return 8 * tensors * rows * length


def training_batch_held(plan: Plan) -> int:
    """The last training batch's collated tensors, alive through an evaluation (two on the CPU: see above)."""
    traits = methods.get(plan.method).traits
    return (2 if plan.device == "cpu" else 1) * _batch_bytes(plan, traits.batch_tensors)


def eval_plan(plan: Plan) -> Plan:
    """`plan` at its eval batch, every row full (a generating method generates all of it at once)."""
    e = plan.eval_batch_size
    return replace(plan, batch_size=e, batch_tokens=0, **({"generation_batch": e} if generates(plan) else {}))


def forward_moment(spec: ModelSpec, plan: Plan, targets) -> dict:
    """The loss of one eval batch without autograd: its inputs (and the labels derived from them), the larger of a
    decoder layer's transients and the fused head, and the policy's outputs a reference forward keeps alive."""
    traits = methods.get(plan.method).traits
    ev = eval_plan(plan)
    rows, length = batch_shape(ev)
    ev = replace(ev, seq_len=length)  # the per-row length the head sees
    layer = int(rows * length * nograd_layer_bytes(spec, ev, targets, step_dtypes(plan).proj))
    head = nograd_head_bytes(spec, ev, rows, top1=traits.head_is_top1)
    kept = 0
    if traits.reference and not plan.precompute_ref:
        # log_probs, entropy, is_top1, the label mask and head_outputs more (fp32), one per scored position
        kept = rows * (length - 1) * (4 + 4 + int(traits.head_is_top1) + 1 + 4 * traits.head_outputs)
    return {
        "eval_batch": _batch_bytes(ev, traits.batch_tensors + traits.label_tensors),
        "eval_forward": kept + max(layer, head),
    }


def generated_moments(spec: ModelSpec, plan: Plan, targets) -> dict[str, dict]:
    """A generating method's evaluation: its eval batch generated (the generation phase's moments at E), then the
    loss over it without autograd, the generated batch's ids, masks and log-probs alive."""
    ev = eval_plan(plan)
    e, length = ev.eval_batch_size, ev.seq_len
    moments = {
        name: {("eval_batch" if k == "rollout_batch" else k): v for k, v in parts.items()}
        for name, parts in rollout_moments(spec, ev, targets).items()
    }
    layer = int(e * length * nograd_layer_bytes(spec, ev, targets, step_dtypes(plan).proj))
    moments["forward"] = {
        # the generated batch, and _compute_loss's joined ids and attention mask
        "eval_batch": rollout_held(ev, e) + 16 * e * length,
        "eval_forward": max(layer, nograd_head_bytes(spec, ev, e)),
    }
    return moments


def samples_moments(spec: ModelSpec, plan: Plan, targets) -> dict[str, dict]:
    """The samples callback's greedy answers: min(eval_samples, 32) prompts at once, each as long as a row's
    prompt can be (max_length; a generating method's prompt part), answered with up to SAMPLES_MAX_TOKENS."""
    g = min(plan.eval_samples, GREEDY_BATCH)
    prompt = plan.seq_len - plan.completion_len
    parts = decoding_moments(
        spec, plan, targets, g, prompt, prompt + SAMPLES_MAX_TOKENS, GREEDY_COPIES, batch="eval_batch"
    )
    return {f"samples {name}": moment for name, moment in parts.items()}


def eval_terms(spec: ModelSpec, plan: Plan, targets, static: dict, kv_per_token: int) -> Evaluation | None:
    """The evaluation phase of `plan`, or None for a run that does not evaluate."""
    moments: dict[str, dict] = {}
    if plan.eval_batch_size:
        if generates(plan):
            moments.update(generated_moments(spec, plan, targets))
        else:
            moments["forward"] = forward_moment(spec, plan, targets)
    if plan.eval_samples:
        moments.update(samples_moments(spec, plan, targets))
    if plan.eval_kv_tokens:
        moments["kv cache"] = {"kv_cache": plan.eval_kv_tokens * kv_per_token}
    if not moments:
        return None
    held = training_batch_held(plan)
    for m in moments.values():
        m["eval_batch"] = m.get("eval_batch", 0) + held
    totals = {k: int(sum(static.values()) + sum(m.values())) for k, m in moments.items()}
    name = max(totals, key=totals.get)
    phase = {**static, **dict.fromkeys(EVAL_COMPONENTS, 0), **moments[name]}
    return Evaluation(moment=name, phase=phase, moments=totals, rows=plan.eval_batch_size)
