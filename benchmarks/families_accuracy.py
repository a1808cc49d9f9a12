"""The model families of 2026, each layer planned as itself, against real training steps: a tiny twin and a twin at the
family's real widths with reduced depth (one recurrent layer and one attention layer where the family has both), with
gradient checkpointing on and off. Planned: the planner's tensor peak (`python -m core.estimate`'s); measured: one
real step through the engine's own model and trainer construction under the live-tensor tracker
(core.measure.step.measure_config: SFTTrainer, peft LoRA r 8 on all-linear, bf16 autocast, the steady peak).

Real widths are transformers' default config of each family (hidden 4096, the published head counts and head dims of
its mixers, chunk sizes) with the vocabulary cut to 8,192, the MLPs to width 1,024 and a mixture of experts to 4
experts (what the recurrent layers hold is what these twins test; the experts' terms have their own benchmark,
moe_accuracy.py), at 512 tokens, where activations outweigh the weights.

    python benchmarks/families_accuracy.py [--quick] [--only qwen3_5_text,...]

`--quick`: the tiny twins only, to show the script still runs (the suite runs `--quick --only llama`): a goal miss
does not fail it, an error does. Last line `families_worst_error: X% (goal <= 5%)`; exit 1 on a miss.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GOAL = 0.05
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)
# MLA families' tiny latents and experts (the real twins keep their latents, the experts cut to 4)
MLA_MOE = dict(
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)
MLA_MOE_REAL = dict(
    first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1
)
# Kimi Linear's and Ling 2.5's twins: a KDA layer and an MLA layer, dense MLPs; the tiny twins' latents, and their
# MLA expanding every head's key and value
_KDA_MLA = dict(
    num_hidden_layers=2,
    pad_token_id=0,
    eos_token_id=2,
    layer_types=["linear_attention", "full_attention"],
    mlp_layer_types=["dense", "dense"],
)
_KDA_MLA_TINY = dict(
    num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16
)
# family -> (tiny twin's fields, the real-width twin's fields over transformers' default config)
FAMILIES = {
    "llama": (dict(TINY, num_hidden_layers=2), {}),  # the baseline: the planner before hybrids
    # Gated DeltaNet + attention (Qwen3.5's 3:1 pattern, cut to 1:1)
    "qwen3_5_text": (
        dict(
            TINY,
            num_hidden_layers=4,
            head_dim=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    ),
    # Mamba-2 + attention with a shared MLP in every layer, dense as Granite 4.0-H Micro / 1B (the MoE sizes: tests/
    # test_layer_plan.py's Granite MoE twin)
    "granitemoehybrid": (
        dict(
            TINY,
            num_hidden_layers=2,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            layer_types=["mamba", "attention"],
            num_local_experts=0,
        ),
        dict(num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=0),
    ),
    # blocks of one kind each: Mamba-2, attention, MLP
    "nemotron_h": (
        dict(
            TINY,
            num_hidden_layers=4,
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            hybrid_override_pattern="M*M-",
        ),
        dict(num_hidden_layers=3, hybrid_override_pattern="M*-"),
    ),
    "bamba": (
        dict(
            TINY,
            num_hidden_layers=2,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            attn_layer_indices=[1],
        ),
        dict(num_hidden_layers=2, attn_layer_indices=[1]),
    ),
    # a mixture of experts with its own experts forward: every token through every expert, a shared expert
    "llama4_text": (
        dict(TINY, num_hidden_layers=2, head_dim=16, intermediate_size_mlp=128, num_local_experts=4),
        dict(num_hidden_layers=2, num_local_experts=4),
    ),
    # short convolutions + attention
    "lfm2": (
        dict(TINY, num_hidden_layers=2, layer_types=["conv", "full_attention"]),
        dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    ),
    # Gemma 4: sliding layers (head_dim 16) and full ones (global_head_dim 32, one KV head, K = V), per-layer input
    # embeddings, and the last two layers reusing the K/V of the last sliding and full layer below them
    "gemma4_text": (
        dict(
            TINY,
            num_hidden_layers=4,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=128,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=128,
        ),
        dict(
            num_hidden_layers=4,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=8192,  # the per-layer table cut with the vocabulary (REAL)
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    # Gemma 4's mixture of experts (enable_moe_block): every layer runs its dense MLP and the routed experts side by
    # side (router.proj, top_k_experts), sliding and full layers (K = V), per-layer inputs
    "gemma4_text_moe": (
        dict(
            TINY,
            num_hidden_layers=2,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=128,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=128,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
        dict(
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            vocab_size_per_layer_input=8192,  # the per-layer table cut with the vocabulary (REAL)
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=1024,  # the experts cut as the MLPs (REAL)
        ),
    ),
    # Gemma 3n's text decoder: an MLP width per layer, AltUp's copies of the hidden stream, Laurel blocks, activation
    # sparsity in the first layers, per-layer inputs, the last two layers reusing K/V
    "gemma3n_text": (
        dict(
            TINY,
            num_hidden_layers=4,
            intermediate_size=[128, 96, 160, 128],
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=128,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=128,
            laurel_rank=8,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
        ),
        dict(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=8192,  # the per-layer table cut with the vocabulary (REAL)
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
        ),
    ),
    # Gated DeltaNet + attention, every layer a mixture of experts with a shared expert
    "qwen3_next": (
        dict(
            TINY,
            num_hidden_layers=2,
            head_dim=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"],
        ),
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=4),
    ),
    # attention and Mamba-2 side by side in every layer
    "falcon_h1": (
        dict(
            TINY,
            num_hidden_layers=2,
            head_dim=16,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_d_ssm=128,
            mamba_n_groups=1,
        ),
        dict(num_hidden_layers=2),
    ),
    # Mamba-1 (core.estimate.mamba1_terms): the selective scan's loop over time; FalconMamba normalizes dt, B and C.
    # Their config's intermediate_size is the mixer's own d_inner: REAL's cut makes the real twins' mixers 1,024 wide
    "mamba": (
        dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=16, time_step_rank=8),
        dict(num_hidden_layers=2),
    ),
    "falcon_mamba": (
        dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=16, time_step_rank=8),
        dict(num_hidden_layers=2),
    ),
    # Jamba interleaves Mamba-1 / attention and MLP / a mixture of experts (tiny: Mamba + MLP, attention + MLP,
    # Mamba + MoE, attention + MLP)
    "jamba": (
        dict(
            TINY,
            num_hidden_layers=4,
            mamba_d_state=16,
            mamba_dt_rank=8,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=4,
            expert_layer_offset=2,
            num_experts=4,
        ),
        dict(
            num_hidden_layers=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
        ),
    ),
    # Zamba2: Mamba-2 layers, and hybrid layers that run the shared attention + MLP block (weights once, activations
    # in every layer applying it) before their Mamba-2 layer
    "zamba2": (
        dict(
            TINY,
            num_key_value_heads=4,
            num_hidden_layers=3,
            mamba_d_state=16,
            n_mamba_heads=4,
            mamba_headdim=32,
            adapter_rank=8,
            layers_block_type=["linear_attention", "hybrid", "hybrid"],
        ),
        dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"]),
    ),
    # experts of its own layout, attention sinks, sliding and full layers
    "gpt_oss": (
        dict(
            TINY,
            num_hidden_layers=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
        ),
        dict(num_hidden_layers=2, num_local_experts=4, layer_types=["sliding_attention", "full_attention"]),
    ),
    # multi-head latent attention (core.estimate.mla_terms): q and kv through low-rank latents, a dense first layer
    # and a mixture of experts; DeepSeek-V3's v head (16) narrower than its q/k head (24)
    "deepseek_v3": (
        dict(TINY, num_key_value_heads=4, num_hidden_layers=2, **MLA_MOE, qk_nope_head_dim=16, v_head_dim=16),
        dict(num_hidden_layers=2, **MLA_MOE_REAL),
    ),
    # GLM-4.7-Flash's MLA: v head as wide as the q/k head (sdpa's flash kernel)
    "glm4_moe_lite": (
        dict(TINY, num_key_value_heads=4, num_hidden_layers=2, **MLA_MOE, qk_nope_head_dim=24, v_head_dim=32),
        dict(num_hidden_layers=2, **MLA_MOE_REAL),
    ),
    # experts with forwards of their own (core.estimate.jetmoe_terms, longcat_terms, zaya_terms): JetMoE's attention is
    # a mixture of experts too; LongCat-Flash's layer is two MLA + MLP sublayers and a shortcut MoE with
    # zero-computation experts; ZAYA's attention is convolutional (CCA), its router an MLP with a skip class
    "jetmoe": (
        dict(TINY, num_hidden_layers=2, kv_channels=16, num_local_experts=4),
        dict(num_hidden_layers=2, num_local_experts=4),
    ),
    "longcat_flash": (
        dict(
            TINY,
            num_key_value_heads=4,
            num_layers=2,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
            expert_ffn_hidden_size=32,
        ),
        # two layers of two sublayers (one layer would make its sublayer list the model's longest ModuleList)
        dict(num_hidden_layers=4, n_routed_experts=4, zero_expert_num=2, moe_topk=2),
    ),
    "zaya": (
        dict(
            TINY,
            num_hidden_layers=2,
            head_dim=16,
            moe_intermediate_size=128,
            num_experts=4,
            router_hidden_size=32,
        ),
        dict(num_hidden_layers=2, num_experts=4, moe_intermediate_size=1024),
    ),
    # Kimi Delta Attention + MLA attention (1:1; Kimi Linear's own pattern is 3:1), dense MLPs (the MoE: moe_accuracy)
    "kimi_linear": (
        dict(TINY, **_KDA_MLA, **_KDA_MLA_TINY, bos_token_id=1, linear_num_heads=4, linear_head_dim=16),
        dict(_KDA_MLA, bos_token_id=1),
    ),
    # Bailing hybrid (Ling 2.5): the same KDA with its own gate, MLA with an output gate
    "bailing_hybrid": (
        # head_dim: the KDA heads' width (the config keeps it as linear_head_dim)
        dict(TINY, **_KDA_MLA, **_KDA_MLA_TINY, head_dim=16),
        dict(_KDA_MLA),
    ),
    # MiniMax: lightning attention + softmax attention, a mixture of experts in every layer
    "minimax": (
        dict(
            TINY,
            num_hidden_layers=2,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            block_size=64,
        ),
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_local_experts=4),
    ),
    # RecurrentGemma: the RG-LRU block + local attention
    "recurrent_gemma": (
        dict(TINY, num_hidden_layers=2, head_dim=16, lru_width=64, block_types=["recurrent", "attention"]),
        dict(num_hidden_layers=2, block_types=["recurrent", "attention"]),
    ),
    # RWKV (v4): time mix + channel mix, no attention at all
    "rwkv": (
        dict(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            attention_hidden_size=64,
            intermediate_size=128,
            context_length=512,
        ),
        dict(num_hidden_layers=2),
    ),
    # xLSTM: mLSTM layers (chunkwise kernel + the step loop for the rest of the length) and a SwiGLU FFN
    "xlstm": (
        dict(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_heads=4,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
        dict(num_hidden_layers=2, pad_token_id=1, bos_token_id=0, eos_token_id=2),
    ),
}
# transformers cannot checkpoint these (supports_gradient_checkpointing False): measured without it only
NO_CHECKPOINTING = {"jetmoe"}
# the real twins' vocabulary and MLP cut: a CPU step in about a minute; what they test is the mixers' widths
REAL = dict(vocab_size=8192, intermediate_size=1024)
# a family key that is not a model type: the model type its twins are configs of
MODEL_TYPES = {"gemma4_text_moe": "gemma4_text"}


def measure(model_type: str, fields: dict, seq_len: int, checkpointing: bool) -> tuple[int, int]:
    """(planned tensor peak, measured steady peak) of one step."""
    from transformers import AutoConfig

    from core.estimate.plan import Plan
    from core.measure.step import measure_config

    config = AutoConfig.for_model(MODEL_TYPES.get(model_type, model_type), **fields)
    plan = Plan(
        model="twin",
        device="cpu",
        seq_len=seq_len,
        batch_size=1,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        gradient_checkpointing=checkpointing,
    )
    result = measure_config(config, plan)
    return result["estimated"]["tensor_peak_bytes"], result["measured"]["steady_peak_bytes"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="the tiny twins only (the suite's check that it runs)"
    )
    p.add_argument("--only", help="comma-separated model types")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    families = args.only.split(",") if args.only else list(FAMILIES)
    sizes = ("tiny",) if args.quick else ("tiny", "real")
    errors = []
    print(
        f"{'family':<18} {'twin':<5} {'tokens':>6} {'ckpt':<4} {'planned':>14} {'measured':>14} {'error':>7}"
    )
    for family in families:
        tiny, real = FAMILIES[family]
        for size in sizes:
            if size == "real" and not real:
                continue
            fields, seq_len = (tiny, 300) if size == "tiny" else ({**real, **REAL}, 512)
            for checkpointing in (False,) if family in NO_CHECKPOINTING else (True, False):
                planned, measured = measure(family, fields, seq_len, checkpointing)
                error = planned / measured - 1
                errors.append(abs(error))
                print(
                    f"{family:<18} {size:<5} {seq_len:>6} {'on' if checkpointing else 'off':<4} {planned:>14,} "
                    f"{measured:>14,} {error:>+7.1%}",
                    flush=True,
                )
    worst = max(errors)
    print(
        f"families_worst_error: {worst:.1%} (goal <= {GOAL:.0%}{'; --quick: not judged' if args.quick else ''})"
    )
    return 0 if worst <= GOAL or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
