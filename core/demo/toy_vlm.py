"""Tiny vision-language configs of real families (random weights, a few MB): what the VLM planner's tests and
benchmarks/vlm_accuracy.py build and train for one step."""

from __future__ import annotations

TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "smolvlm", "llava")
# Qwen3.5's language model: three Gated DeltaNet layers to one of full attention (full_attention_interval 4)
QWEN3_5_TEXT = dict(
    num_hidden_layers=4,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def tiny_vlm_config(family: str, text: dict | None = None, vision: dict | None = None):
    """A small config of `family` (FAMILIES); `text` / `vision` override the sub-configs."""
    from transformers import AutoConfig

    t = {**TEXT, **(QWEN3_5_TEXT if family == "qwen3_5" else {}), **(text or {})}
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        head = t["hidden_size"] // t["num_attention_heads"]
        t.setdefault(
            "rope_parameters",
            {
                "rope_type": "default",
                "mrope_section": [head // 8, head // 8 * 3 // 2, head // 8 * 3 // 2][:3],
            },
        )
        v = dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=t["hidden_size"]
        )
        if family == "qwen2_5_vl":  # windowed attention with one full block
            v.update(fullatt_block_indexes=[1], window_size=112)
        else:  # Qwen3-VL: deepstack features and learnt position embeddings; its text layers name head_dim
            t.setdefault("head_dim", head)
            v.update(num_position_embeddings=256)
            if family == "qwen3_vl":  # Qwen3.5's tower is Qwen3-VL's without deepstack
                v.update(deepstack_visual_indexes=[0])
        return AutoConfig.for_model(
            family,
            text_config=t,
            vision_config={**v, **(vision or {})},
            image_token_id=151,
            video_token_id=152,
            vision_start_token_id=153,
            vision_end_token_id=154,
        )
    if family == "smolvlm":
        v = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
        )
        return AutoConfig.for_model(
            family,
            text_config={**t, "model_type": "llama"},
            vision_config={**v, **(vision or {})},
            scale_factor=2,
            image_token_id=151,
        )
    if family == "llava":
        v = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=2,
            image_size=84,
            patch_size=14,
            projection_dim=64,
            model_type="clip_vision_model",
        )
        return AutoConfig.for_model(
            family,
            text_config={**t, "model_type": "llama"},
            vision_config={**v, **(vision or {})},
            image_token_index=151,
            vision_feature_layer=-2,
        )
    raise ValueError(f"no tiny config for {family}; use one of {', '.join(FAMILIES)}")
