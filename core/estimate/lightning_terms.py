"""MiniMax's lightning attention (the `linear_attention` layers of transformers' `minimax`): what one mixer keeps for
backward and holds for a moment, per token, from transformers models/minimax/modeling_minimax.py.

MiniMaxLightningAttention.forward has one path (no kernel package): silu(qkv_proj(x)), then a Python loop over
blocks of block_size tokens: within a block (Q K^T * decay) V, across blocks Q (decay * KV), the [heads, dim, dim]
KV state carried and decayed; then an RMSNorm over the heads' output, a sigmoid output gate and out_proj. Autograd
keeps per block the (block x block) decayed scores -- block_size x heads x 2 bytes per token, 2 KiB at MiniMax-
Text-01's 64 heads and blocks of 256 -- and the decayed q and k. Equal to autograd's tensor by tensor
(tests/test_linear_attention_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LightningFacts:
    hidden: int
    heads: int
    head_dim: int
    block: int  # block_size

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


def lightning_facts(text_config: dict) -> LightningFacts | None:
    c = text_config
    if c.get("model_type") != "minimax":
        return None
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    return LightningFacts(int(c["hidden_size"]), heads, head_dim, int(c.get("block_size", 256)))


def _blocks(t, f: LightningFacts) -> list[int]:
    s = max(int(t.plan.seq_len), 1)
    return [min(f.block, s - start) for start in range(0, s, f.block)]


def lightning_mixer_saved(t, f: LightningFacts, kernel: bool) -> None:
    """Per token, what one lightning-attention mixer saves (rows of t.plan.seq_len tokens):

    - qkv_proj's and output_gate's LoRA inputs (the layer's normed input), silu's input (q|k|v, 3 x width);
    - every block's matmuls keep q, k and v as views of silu's output: the whole of it, once;
    - the decay buffers (diagonal [heads, block, block], query and key [heads, block]) the multiplies keep, once
      per layer, in the model's dtype;
    - per block: the decayed scores (Q K^T * diagonal_decay) the `@ V` keeps; from the second block on the decayed
      q and the KV state the inter-block `@` keeps (the first block's state is zeros, needing no gradient, though
      its matmul keeps it); the decayed k of every block but the last, whose KV update feeds the state the
      forward returns and the decoder layer drops; the block decay of the updates in between;
    - MiniMaxRMSNorm over the width (fp32 input, rstd), the gate's sigmoid output and the normed output the gating
      multiply keeps, out_proj's LoRA input."""
    d, saved, h, w, nh, dh = t.d, t.saved, f.hidden, f.width, f.heads, f.head_dim
    p = d.proj
    s = max(int(t.plan.seq_len), 1)
    buf = 4 if t.plan.load_dtype == "fp32" else 2
    blocks = _blocks(t, f)
    for m in ("qkv_proj", "output_gate"):
        t.linear_input(m, h, d.hidden, "attn_norm_out")
    saved["lightning.silu_input"] = 3 * w * p
    saved["lightning.qkv"] = 3 * w * p
    # the diagonal and query decays; the key decay only where an update other than the dropped last one keeps it
    saved["lightning.decay_buffers"] = (
        (nh * f.block * f.block + (1 + (len(blocks) > 1)) * nh * f.block) * buf / s
    )
    saved["lightning.intra_scores"] = sum(nh * n * n for n in blocks) * p / s
    saved["lightning.inter_q"] = nh * dh * (s - blocks[0]) * p / s
    saved["lightning.states"] = len(blocks) * nh * dh * dh * p / s
    saved["lightning.update_k"] = nh * dh * (s - blocks[-1]) * p / s
    saved["lightning.block_decay"] = max(len(blocks) - 2, 0) * nh * buf / s
    saved["lightning_norm.fp32_input"] = w * 4
    saved["lightning_norm.rstd"] = 4
    if t.plan.tuning == "full":
        saved["lightning_norm.normed"] = w * p
    saved["lightning.gate_sigmoid"] = w * p
    saved["lightning.normed_out"] = w * p
    t.linear_input("out_proj", w, p, "lightning.gated")


def lightning_forward_temporaries(t, f: LightningFacts, kernel: bool) -> float:
    """Per token, beyond the saved tensors: the forward peaks in out_proj's LoRA forward -- peft's fp32 copy of its
    input, the base output, lora_B's and the scaled sum (hidden wide) -- next to the gated input and the normed
    output it was made from (measured on the mixer alone: 908 B per token at width 64, against these 896)."""
    p, w = t.d.proj, f.width
    return w * 4 + 3 * f.hidden * p + 2 * w * p


def lightning_backward_temporaries(t, f: LightningFacts, kernel: bool) -> float:
    """Per token: each block's backward slices the gradient of q, k and v out of a whole-length gradient
    (narrow backward of silu's output, 3 x width), gathered as blocks add in: two of it alive at once, next to
    the incoming gradient (measured: 874 B per token at width 64, against these 896)."""
    return 2 * 3 * f.width * t.d.proj + f.hidden * t.d.proj
