"""Tiny vision-language models of issue #47's families saved with their real processors, for training end to end
through `python -m core.train` (tests/test_vlm_families_train.py): Gemma 4 (a SigLIP-like tower with 2-D positions
and soft-token pooling, a Gemma 4 language model) and LLaVA-OneVision (a SigLIP tower, any-res tiles with a base
image, a Qwen2 language model). Each holds the family's PIL image processor, the char tokenizer with the family's
image tokens and a chat template that writes them. Both processor classes hold a video processor, which transformers
builds only with torchvision installed: without it the builder says so and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

from core.demo.toy import build_tokenizer, vlm_template
from core.demo.toy_vlm import TEXT

TRAINED_FAMILIES = ("gemma4", "llava_onevision")
TOKENS = {  # the image entry the chat template writes, and the family's special tokens
    "gemma4": (
        "<|image|>",
        ("<|image|>", "<|boi|>", "<|eoi|>", "<|video|>", "<|audio|>", "<|boa|>", "<|eoa|>"),
    ),
    "llava_onevision": ("<image>", ("<image>", "<video>")),
}


def build_family_vlm(out_dir: str | os.PathLike, family: str, seed: int = 0) -> Path:
    """Save a randomly initialised tiny `family` VLM (TRAINED_FAMILIES) with its processor to `out_dir`; ValueError
    naming torchvision where the processor class cannot be built (nothing is written then)."""
    import torch

    if family not in TRAINED_FAMILIES:
        raise ValueError(f"family must be one of {', '.join(TRAINED_FAMILIES)} (got {family!r}).")
    tok = family_tokenizer(family)
    image_processor, extra = _image_processor(family)
    processor = _processor(family, tok, image_processor, extra)
    torch.manual_seed(seed)
    model = family_model(family, tok)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out


def family_tokenizer(family: str):
    """The char tokenizer with the family's image tokens (named as its processor reads them) and chat template."""
    from transformers import PreTrainedTokenizerFast

    image, specials = TOKENS[family]
    base = build_tokenizer(chat_template=False, extra_specials=specials)
    named = {"image_token": image}
    if family == "gemma4":
        # its audio tokens too: Gemma4Processor checks them even when no audio is given
        named.update(
            boi_token="<|boi|>",
            eoi_token="<|eoi|>",
            audio_token="<|audio|>",
            boa_token="<|boa|>",
            eoa_token="<|eoa|>",
        )
    else:
        named["video_token"] = "<video>"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=named,
    )
    tok.chat_template = vlm_template(image)
    return tok


def _image_processor(family: str):
    """(the family's PIL image processor, the processor's own settings)."""
    if family == "gemma4":
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        # 16-px patches pooled 3 x 3: an image resized to at most 70 soft tokens (the smallest budget it takes)
        return Gemma4ImageProcessorPil(patch_size=16, pooling_kernel_size=3, max_soft_tokens=70), {
            "image_seq_length": 70
        }
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    # 28-px tiles of 7-px patches (16 tokens a tile): a base image and up to 2 x 2 tiles, as anyres_max_9 reads them
    grid = [[28, 28], [28, 56], [56, 28], [56, 56]]
    images = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=grid)
    return images, {"num_image_tokens": 16, "vision_feature_select_strategy": "full"}


def _processor(family: str, tok, image_processor, extra: dict):
    """The family's real processor class, with its video processor (torchvision) and Gemma 4's audio features."""
    import transformers

    video = video_processor(family)
    if family == "gemma4":
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

        return transformers.Gemma4Processor(
            feature_extractor=Gemma4AudioFeatureExtractor(),
            image_processor=image_processor,
            tokenizer=tok,
            video_processor=video,
            chat_template=tok.chat_template,
            **extra,
        )
    return transformers.LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video,
        chat_template=tok.chat_template,
        **extra,
    )


def video_processor(family: str):
    """The family's video processor: transformers builds it only with torchvision installed."""
    import transformers

    try:
        if family == "gemma4":
            return transformers.Gemma4VideoProcessor()
        return transformers.LlavaOnevisionVideoProcessor()
    except (ImportError, AttributeError, ValueError):
        raise ValueError(
            f"a {family} processor needs torchvision (it holds a video processor): install torchvision, or "
            "build the llava family (core.demo.toy.build_tiny_vlm)."
        ) from None


def family_model(family: str, tok):
    """The tiny model: its real vision and text classes, small widths, the tokenizer's vocabulary and image ids."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    ids = lambda *names: [tok.convert_tokens_to_ids(n) for n in names]  # noqa: E731
    # the tiny text config of core.demo.toy_vlm, over this tokenizer's vocabulary
    text = dict(TEXT, vocab_size=len(tok), head_dim=16, max_position_embeddings=512)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    if family == "gemma4":
        image, boi, eoi, video = ids("<|image|>", "<|boi|>", "<|eoi|>", "<|video|>")
        cfg = AutoConfig.for_model(
            "gemma4",
            text_config=dict(
                text,
                model_type="gemma4_text",
                layer_types=["sliding_attention", "full_attention"],
                # its per-layer input embeddings over this vocabulary, not the published 262,144 tokens
                vocab_size_per_layer_input=len(tok),
                hidden_size_per_layer_input=16,
            ),
            vision_config=dict(small, patch_size=16, head_dim=16, num_key_value_heads=2),
            image_token_id=image,
            boi_token_id=boi,
            eoi_token_id=eoi,
            video_token_id=video,
        )
    else:
        image, video = ids("<image>", "<video>")
        cfg = AutoConfig.for_model(
            "llava_onevision",
            text_config=dict(text, model_type="qwen2"),
            vision_config=dict(small, image_size=28, patch_size=7, model_type="siglip_vision_model"),
            image_token_index=image,
            video_token_index=video,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]],
        )
    return AutoModelForImageTextToText.from_config(cfg)
