"""Llama 4's MoE block (transformers 5 models/llama4/modeling_llama4.py: Llama4TextMoe, Llama4Router,
Llama4TextExperts), from its code: what autograd saves, the forward's temporaries and backward's gradients at the
experts. core.estimate.moe_terms adds the shared expert (a dense SwiGLU MLP) and builds the layer from these.

What the block runs for T tokens and E experts (R = E x T rows: every token goes through every expert, the experts
the router does not pick get a score of 0, not fewer rows -- so no term depends on top-k but the indices):
- the router (an nn.Linear): logits T x E; top-k of them (its indices saved for the scatter's backward), scattered
  into -inf, sigmoid in fp32 (its output saved), cast back to the logits' dtype;
- `hidden.repeat(E, 1) * scores.T.reshape(-1, 1)`: the multiply keeps the repeated hidden states (R x hidden) and
  the transposed scores' copy (R x 1);
- the experts: gate_up = bmm(routed_in, gate_up_proj) (R x 2 width), up x silu(gate) (silu keeps gate, a view of
  gate_up; the multiply keeps up, the same storage, and silu's output), down = bmm(product, down_proj). bmm keeps
  its input only when the weight needs a gradient (LoRA), and the weight when the input does (a frozen parameter
  is no activation; peft's merged copy is).
- LoRA on the experts (peft target_parameters, ParamWrapper): peft dispatches Llama4TextExperts' 3-D
  gate_up_proj / down_proj like every other family's -- one rank-r pair per expert, folded into a merged copy of the
  stack every forward (torch.baddbmm, autocast off, in the weight's dtype) that the bmm then uses and keeps. The
  module has no `is_transposed`, so peft takes the stack as experts x out x in while Llama 4 multiplies x @ W
  (experts x in x out): lora_A then spans the output side and lora_B the input side. The update is still a rank-r
  delta of each expert's matrix, of the parameter's own shape, so the trainable count and every byte are the same.
"""

from __future__ import annotations

from core.estimate.activation_terms import step_dtypes
from core.estimate.moe import MoeFacts
from core.estimate.plan import DTYPE_BYTES, Plan
from core.estimate.static_terms import adapter_bytes


def _mm_bytes(plan: Plan) -> int:
    """Bytes of the experts' bmm operands: bmm is on autocast's lower-precision list, so under autocast it runs in
    the compute dtype, else in the weights' dtype."""
    d = step_dtypes(plan)
    return DTYPE_BYTES[plan.compute_dtype] if d.autocast else DTYPE_BYTES[plan.load_dtype]


def llama4_routed(
    h: int, facts: MoeFacts, plan: Plan, lora: dict, tokens: int
) -> tuple[dict[str, int], int, int]:
    """(saved bytes by tensor, merged expert copies, forward temporaries) of the router and the experts of one
    Llama 4 MoE layer for `tokens` tokens (`lora`: core.estimate.moe_terms.expert_targets)."""
    d = step_dtypes(plan)
    e, k, width = facts.experts, facts.top_k, facts.width
    rows = tokens * e
    p, load = _mm_bytes(plan), DTYPE_BYTES[plan.load_dtype]
    saved = {
        "router.topk_indices": tokens * k * 8,  # topk's, kept by the scatter too (one tensor)
        "router.sigmoid": tokens * e * 4,  # `sigmoid(router_scores.float())`
        "experts.routing_weights": rows * d.proj,  # scores.transpose(0, 1).reshape(-1, 1): a copy
        "experts.repeated_input": rows * h * d.hidden,  # hidden_states.repeat(E, 1)
        "experts.gate_up_out": rows * 2 * width * p,
        "experts.act_gate": rows * width * p,  # silu's output, kept by up x silu(gate)
    }
    merged = 0
    ad = adapter_bytes(plan)
    for name, fan_in, fan_out in (("gate_up_proj", h, 2 * width), ("down_proj", width, h)):
        s = lora.get(name)
        if s is None:
            continue
        saved[f"experts.{name}.input"] = (
            rows * fan_in * p
        )  # the bmm's input (`{rows_in}`), for the weight's grad
        # the merged stack as the bmm keeps it: under autocast over fp32 weights its 16-bit copy (baddbmm's fp32
        # output is not saved)
        merged += e * fan_in * fan_out * p
        if ad != load:  # peft casts the factors to the weight's dtype for baddbmm, which keeps them
            saved[f"experts.{name}.factors"] = e * plan.lora_r * s.rank * (fan_in + fan_out) * load
    if merged:
        saved["experts.merged_weights"] = merged
    if p != load:  # autocast's copies of the frozen stacks: the bmm keeps them for its input's gradient
        frozen = [(h, 2 * width)] * ("gate_up_proj" not in lora) + [(width, h)] * ("down_proj" not in lora)
        if frozen:
            saved["experts.autocast_weights"] = sum(e * i * o * p for i, o in frozen)
    # Alive beside the saved tensors while the experts run, not saved: routed_in (a local of the block's forward
    # until it returns) unless the gate_up bmm keeps it, the product unless the down bmm keeps it, the down output.
    temporaries = rows * h * p * ("gate_up_proj" not in lora) + rows * width * p * ("down_proj" not in lora)
    return saved, merged, temporaries + rows * h * p


def llama4_backward_peak(h: int, facts: MoeFacts, plan: Plan, lora: dict, tokens: int) -> int:
    """Bytes alive beyond the saved tensors while backward goes through one Llama 4 experts block: the gradients
    of its R = experts x tokens rows stage by stage (down: the incoming gradient, the product's and, adapted, the
    merged stack's; the gate: up's and gate's gradients and chunk's concatenation of them; gate_up: its gradient
    and routed_in's and, adapted, the merged stack's; the routing multiply: routed_in's, the repeated input's and
    the scores' product), the largest of them."""
    p = _mm_bytes(plan)
    e, width, rows = facts.experts, facts.width, tokens * facts.experts
    hidden = step_dtypes(plan).hidden
    stacks = {"down_proj": e * h * width * p, "gate_up_proj": e * h * 2 * width * p}
    down = rows * (h + width) * p + (stacks["down_proj"] if "down_proj" in lora else 0)
    gate = 4 * rows * width * p
    gate_up = rows * (2 * width + h) * p
    if "gate_up_proj" in lora:  # down_proj's merged copy is freed by then
        gate_up += stacks["gate_up_proj"] - (stacks["down_proj"] if "down_proj" in lora else 0)
    routing = rows * h * p + 2 * rows * h * hidden
    return max(down, gate, gate_up, routing)
