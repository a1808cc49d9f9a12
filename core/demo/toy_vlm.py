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
    """A small config of `family`: one of FAMILIES (`text` / `vision` override its sub-configs), or a family of
    issue #47 (its real vision and text classes, small widths, the published models' image geometry)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        return _twin(family)

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


# issue #47's families: the published models' image geometry, a text config with the head width they pin
TWIN_TEXT = dict(TEXT, head_dim=16)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)


def _twin(family: str):
    """A tiny config of `family`: its real vision and text classes, the image geometry of the published models."""
    from transformers import AutoConfig

    if family == "mistral3":
        v = dict(SMALL, head_dim=32, image_size=1540, patch_size=14)
        return AutoConfig.for_model(
            family,
            text_config=dict(TWIN_TEXT, model_type="mistral"),
            vision_config=v,
            image_token_index=151,
            spatial_merge_size=2,
        )
    if family == "llava_next":
        v = dict(SMALL, image_size=336, patch_size=14, model_type="clip_vision_model", projection_dim=64)
        return AutoConfig.for_model(
            family,
            text_config=dict(TWIN_TEXT, model_type="llama"),
            vision_config=v,
            image_token_index=151,
            image_seq_length=576,
        )
    if family == "llava_onevision":
        v = dict(SMALL, image_size=384, patch_size=14, model_type="siglip_vision_model")
        return AutoConfig.for_model(
            family,
            text_config=dict(TWIN_TEXT, model_type="qwen2"),
            vision_config=v,
            image_token_index=151,
        )
    if family == "internvl":
        v = dict(SMALL, image_size=[448, 448], patch_size=[14, 14])
        return AutoConfig.for_model(
            family,
            text_config=dict(TWIN_TEXT, model_type="qwen2"),
            vision_config=v,
            image_token_id=151,
            image_seq_length=256,
        )
    if family == "paligemma":
        v = dict(SMALL, image_size=224, patch_size=14, model_type="siglip_vision_model", projection_dim=64)
        return AutoConfig.for_model(
            family,
            text_config=dict(TWIN_TEXT, model_type="gemma"),
            vision_config=v,
            image_token_index=151,
            projection_dim=64,  # the config copies its own onto the vision config
        )
    if family in ("glm4v", "exaone4_5"):
        v = dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64, patch_size=14
        )
        t = dict(TWIN_TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
        if family == "exaone4_5":  # its text config is EXAONE 4's, named in the dict
            t = dict(TWIN_TEXT, model_type="exaone4")
        return AutoConfig.for_model(family, text_config=t, vision_config=v, image_token_id=151)
    if family == "idefics2":
        v = dict(SMALL, image_size=980, patch_size=14)
        return AutoConfig.for_model(
            family,
            text_config=dict(TWIN_TEXT, model_type="mistral"),
            vision_config=v,
            image_token_id=151,
            perceiver_config=dict(
                hidden_size=64,
                resampler_n_latents=64,
                resampler_depth=1,
                resampler_n_heads=2,
                resampler_head_dim=16,
                num_key_value_heads=1,
            ),
        )
    if family == "gemma4":
        t = dict(TWIN_TEXT, model_type="gemma4_text", layer_types=["sliding_attention", "full_attention"])
        v = dict(SMALL, patch_size=16, head_dim=32, num_key_value_heads=2)
        return AutoConfig.for_model(family, text_config=t, vision_config=v, image_token_id=151)
    if family == "llama4":
        t = dict(TWIN_TEXT, model_type="llama4_text", num_local_experts=2, intermediate_size_mlp=128)
        v = dict(
            SMALL,
            image_size=336,
            patch_size=14,
            vision_output_dim=64,
            projector_input_dim=64,
            projector_output_dim=64,
        )
        return AutoConfig.for_model(family, text_config=t, vision_config=v, image_token_index=151)
    if family == "lfm2_vl":
        t = dict(TWIN_TEXT, model_type="lfm2", layer_types=["conv", "full_attention"])
        v = dict(SMALL, patch_size=16, num_patches=256, model_type="siglip2_vision_model")
        return AutoConfig.for_model(
            family, text_config=t, vision_config=v, image_token_id=151, projector_hidden_size=64
        )
    if family == "video_llava":
        v = dict(SMALL, image_size=224, patch_size=14, model_type="clip_vision_model", projection_dim=64)
        return AutoConfig.for_model(
            family, text_config=dict(TWIN_TEXT, model_type="llama"), vision_config=v, image_token_index=151
        )
    if family == "blip-2":
        v = dict(SMALL, image_size=224, patch_size=14)
        q = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            encoder_hidden_size=64,
        )
        return AutoConfig.for_model(
            family,
            text_config=dict(TWIN_TEXT, model_type="opt", ffn_dim=128, word_embed_proj_dim=64),
            vision_config=v,
            qformer_config=q,
            num_query_tokens=32,
            image_token_index=151,
        )
    if family == "deepseek_vl":
        v = dict(SMALL, image_size=384, patch_size=16, model_type="siglip_vision_model")
        return AutoConfig.for_model(
            family, text_config=dict(TWIN_TEXT, model_type="llama"), vision_config=v, image_token_id=151
        )
    raise KeyError(family)
