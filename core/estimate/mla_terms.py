"""Multi-head latent attention (MLA): DeepSeek-V2/V3 (Kimi K2 is deepseek_v3), GLM-4.7-Flash (glm4_moe_lite),
MiniCPM3, Mistral 4, Youtu, LongCat-Flash, and the MLA layers of Kimi Linear and Bailing hybrid; what one attention
block keeps for backward per token, tensor by tensor, and what transformers' KV cache holds for it.

From transformers 5.x models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3Attention; the other families copy it):
`q_a_proj -> q_a_layernorm -> q_b_proj` (or one `q_proj` when q_lora_rank is None), `kv_a_proj_with_mqa` split into
the latent (kv_lora_rank) and a shared k_pe (qk_rope_head_dim), `kv_a_layernorm` on the latent, rope on q's and
k_pe's last qk_rope_head_dim, `expand_kv`: `kv_b_proj` gives per head k_nope (qk_nope_head_dim) and the value
(v_head_dim), the key is a new tensor [k_nope | k_pe expanded to every head]; the query `cat(q_nope, q_rope)`.
Attention runs on heads x qk_head_dim queries and keys and heads x v_head_dim values; `o_proj` reads the
heads x v_head_dim output. Rope and the concatenations save nothing per layer (`x * cos` saves the shared cos and
sin, which need no grad; cat and copy_ save no tensor). The value is a view of kv_b_proj's output, so a kernel
that saves it keeps that whole output alive (heads x (qk_nope + v_head_dim)).

Which attention kernel runs decides what is saved (torch aten/src/ATen/native/transformers/sdp_utils*.cpp):
torch's flash kernels (CPU and CUDA) need one head dim for q, k and v, so with v_head_dim != qk_head_dim sdpa takes
the memory-efficient kernel on CUDA (q, k, v, out, logsumexp) and the math path on the CPU
(_scaled_dot_product_attention_math: 16-bit inputs upcast to fp32, the scaled q and k^T, the fp32 probabilities and
v are saved). transformers' flash attention (integrations/flash_attention.py) pads v to the qk head dim and crops
the output: the padded v and output are saved, the crop's contiguous copy feeds o_proj.

Measured on the CPU tensor by tensor (tests/test_mla.py: autograd's saved tensors of one real attention module equal
these terms for sdpa's math and flash paths, eager, fp32, full fine-tuning, LoRA dropout, q_proj, Kimi Linear and
Bailing's gate); the CUDA kernels' terms (memory-efficient, flash) are modelled from their code, not yet measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

MLA_LINEARS = frozenset(
    {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "g_proj"}
)


@dataclass(frozen=True)
class MlaFacts:
    hidden: int
    heads: int
    q_lora_rank: int  # 0: one q_proj (DeepSeek-V2-Lite, Kimi Linear), else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope: int  # qk_nope_head_dim
    qk_rope: int  # qk_rope_head_dim
    qk_head: int  # the query / key head dim (qk_nope + qk_rope; LongCat-Flash may set it)
    v_head: int  # v_head_dim
    output_gate: bool  # Bailing hybrid: sigmoid(g_proj(x)) per head gates the attention output

    @property
    def q_width(self) -> int:
        return self.heads * self.qk_head

    @property
    def kv_b_width(self) -> int:  # kv_b_proj's output: k_nope and the value per head; the value views it
        return self.heads * (self.qk_nope + self.v_head)

    @property
    def out_width(self) -> int:
        return self.heads * self.v_head


def mla_facts(config: dict) -> MlaFacts | None:
    """The MLA widths from a (text) config dict, as the configuration classes fill them; None for a config
    without a latent KV (kv_lora_rank)."""
    c = config.get("text_config") or config
    if not isinstance(c.get("kv_lora_rank"), int) or not c.get("qk_rope_head_dim"):
        return None
    heads = int(c["num_attention_heads"])
    nope, rope = int(c.get("qk_nope_head_dim") or 0), int(c["qk_rope_head_dim"])
    # MiniCPM3 leaves v_head_dim None in its config.json: its configuration class takes hidden / heads
    v = int(c.get("v_head_dim") or c["hidden_size"] // heads)
    return MlaFacts(
        hidden=int(c["hidden_size"]),
        heads=heads,
        q_lora_rank=int(c.get("q_lora_rank") or 0),
        kv_lora_rank=int(c["kv_lora_rank"]),
        qk_nope=nope,
        qk_rope=rope,
        qk_head=int(c.get("qk_head_dim") or nope + rope),
        v_head=v,
        output_gate=c.get("model_type") == "bailing_hybrid",
    )


@lru_cache(maxsize=64)
def _facts_of(config_json: str) -> MlaFacts | None:
    return mla_facts(json.loads(config_json))


def is_mla(spec) -> bool:
    """Does this model's attention run as MLA: its config has a latent KV and its layers the MLA projections?"""
    if _facts_of(spec.config_json) is None:
        return False
    return any(s.name.endswith(".kv_b_proj") for s in spec.decoder_linears)  # found in the first MLA layer


def mla_block(t) -> None:
    """Add one MLA attention block's saved tensors, per token, to `t.saved` (a LayerTerms of
    core.estimate.activation_terms): its Linears' inputs (t.linear_input: LoRA copies, full fine-tuning's inputs),
    the two inner RMSNorms, then what the attention kernel of t.plan saves, then o_proj's input."""
    f = _facts_of(t.spec.config_json)
    d, saved, s = t.d, t.saved, max(int(t.plan.seq_len), 1)
    po, pa = d.proj, d.attn  # the Linears' outputs; what the attention kernel gets (autocast's 16-bit copies)
    h, heads = f.hidden, f.heads
    # LayerTerms reads which Linears are adapted from layer 0, which in Kimi Linear and Bailing hybrid is a
    # recurrent layer without these: the MLA layer's own Linears are adapted wherever peft adapted them
    t.adapted = t.adapted | (MLA_LINEARS & t.every_adapted)
    # the layer's input norm output feeds every first projection
    first = ("q_a_proj",) if f.q_lora_rank else ("q_proj",)
    for m in first + ("kv_a_proj_with_mqa",) + (("g_proj",) if f.output_gate else ()):
        t.linear_input(m, h, d.hidden, "attn_norm_out")
    if f.q_lora_rank:
        _inner_norm(t, "q_a_layernorm", f.q_lora_rank, f.q_lora_rank, po)
        t.linear_input("q_b_proj", f.q_lora_rank, po, "q_a_norm_out")
    # kv_a_layernorm reads a split view of kv_a_proj_with_mqa's output: an fp32 one is not copied by `.to(float32)`,
    # so pow / the rstd multiply keep the whole output (latent and k_pe) alive
    _inner_norm(t, "kv_a_layernorm", f.kv_lora_rank, f.kv_lora_rank + f.qk_rope * (po == 4), po)
    t.linear_input("kv_b_proj", f.kv_lora_rank, po, "kv_a_norm_out")
    # the value as a kernel saves it: autocast's copy of the view (v_head_dim wide), else kv_b_proj's whole output
    value = f.out_width * pa if pa != po else f.kv_b_width * po
    plan = t.plan
    if plan.attn == "eager":  # eager_attention_forward: matmul saves q and k, softmax its fp32 output, ...
        saved["mla.q"] = f.q_width * pa
        saved["mla.k"] = f.q_width * pa
        saved["mla.probs_fp32"] = heads * s * 4
        if pa != 4:  # ... its cast, which the second matmul saves with v
            saved["mla.probs_cast"] = heads * s * pa
        saved["mla.v"] = value
        o_key = "mla.out_contiguous"  # transpose(1, 2).contiguous(): o_proj's input
    elif plan.attn == "flash":  # v padded to the qk head dim, the output cropped and copied for o_proj
        padded = f.v_head != f.qk_head
        saved["mla.q"] = f.q_width * pa
        saved["mla.k"] = f.q_width * pa
        saved["mla.v"] = f.q_width * pa if padded else value
        saved["mla.out"] = f.q_width * pa
        saved["mla.logsumexp"] = heads * 4
        o_key = "mla.out_cropped" if padded else "mla.out"
    elif plan.device == "cpu" and f.v_head != f.qk_head:  # sdpa's math path (no CPU flash for unequal dims)
        saved["mla.q_scaled_fp32"] = f.q_width * 4
        saved["mla.k_scaled_fp32"] = f.q_width * 4
        saved["mla.probs_fp32"] = heads * s * 4
        saved["mla.v"] = f.out_width * 4 if pa != 4 else value  # 16-bit inputs are upcast: v's fp32 copy
        o_key = "mla.out_contiguous"  # the math output is not saved; its 16-bit cast is o_proj's input
    else:  # sdpa's flash (equal head dims) or memory-efficient kernel: q, k, v, out, logsumexp
        saved["mla.q"] = f.q_width * pa
        saved["mla.k"] = f.q_width * pa
        saved["mla.v"] = value
        saved["mla.out"] = f.out_width * pa
        saved["mla.logsumexp"] = heads * 4
        # transformers' transpose(1, 2).contiguous(): a copy of the CPU kernel's [b, h, s, d] output; the CUDA
        # kernels write [b, s, h, d], so it is the saved output itself
        o_key = "mla.out" if plan.device == "cuda" else "mla.out_contiguous"
    if f.output_gate:  # Bailing: out * sigmoid(g.float()).to(dtype)
        # sigmoid saves its fp32 output, the multiply the gate and the output it gates
        saved["mla.gate_sigmoid_fp32"] = heads * 4
        saved["mla.gate"] = heads * pa
        # the gated multiply saves the output it gates: what the interface returns (flash's crop views its output)
        saved.setdefault("mla.out" if o_key == "mla.out_cropped" else o_key, f.out_width * pa)
        o_key = "mla.gated_out"
    t.linear_input("o_proj", f.out_width, pa, o_key)


def _inner_norm(t, name: str, width: int, fp32_width: int, in_bytes: int) -> None:
    """An RMSNorm inside the attention (DeepseekV3RMSNorm over the q or kv latent): `hidden.to(float32)` saved
    by pow and the rstd multiply (`fp32_width` elements: a view's whole storage when no copy is made), rstd, and,
    when its weight trains, the weight multiply's input `hidden.to(input_dtype)`. Liger's norm keeps its input."""
    if t.liger:
        t.saved[f"{name}.input"] = width * in_bytes
    else:
        t.saved[f"{name}.fp32_input"] = 4 * fp32_width
    t.saved[f"{name}.rstd"] = 4
    if t.full and not t.liger:
        t.saved[f"{name}.normed"] = width * in_bytes


def latent_cache_per_byte(config_json: str, attention_layers: int) -> int | None:
    """What transformers' cache holds per token per byte of element size for an MLA model: the compressed latent
    after kv_a_layernorm and the rope'd k_pe, one "head" each (`cache.update(kv_nope, k_rot)` before expand_kv),
    not per-head keys and values; None for a model without MLA."""
    f = _facts_of(config_json)
    return None if f is None else attention_layers * (f.kv_lora_rank + f.qk_rope)
