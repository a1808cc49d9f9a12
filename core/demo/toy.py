"""Tiny, local, deterministic models and tokenizers (tests, demo, benchmarks). Nothing is downloaded.

The tokenizer is character level over printable ASCII with a chat template, built with `tokenizers` and
saved as a normal transformers tokenizer folder, so every loading path is the real one.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(
    out_dir: str | os.PathLike | None = None, chat_template: bool = True, extra_specials: tuple[str, ...] = ()
):
    """A character-level fast tokenizer (99 tokens + role markers, then `extra_specials`: an image token); saved to
    `out_dir` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    roles = ["<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {
        t: i for i, t in enumerate(SPECIALS + roles + list(string.printable[:95]) + list(extra_specials))
    }
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=roles + list(extra_specials),
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


# Mixture-of-experts families (transformers 5 stores their experts as fused 3-D parameters): a few small experts,
# two of them per token, and every layer sparse
MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
}


def tiny_config(arch: str = "llama", vocab_size: int = 102, **overrides):
    """A small config of a real architecture. `arch`: llama, qwen2, mistral, gemma2, phi3, gpt2, or one of the
    mixture-of-experts families in MOE (qwen3_moe, mixtral, gpt_oss)."""
    from transformers import AutoConfig

    if arch == "gpt2":
        base = dict(
            vocab_size=vocab_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        base = dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        if arch == "gemma2":
            base["head_dim"] = 16
        base.update(MOE.get(arch, {}))
        if arch == "gpt_oss":  # full attention in every layer (its default alternates with a sliding window)
            layers = overrides.get("num_hidden_layers", base["num_hidden_layers"])
            base["layer_types"] = ["full_attention"] * layers
            base["rope_parameters"] = {
                "rope_type": "default",
                "rope_theta": 150000.0,
            }  # no YaRN at 256 tokens
    base.update(overrides)
    return AutoConfig.for_model(arch, **base)


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    dtype=None,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Save a randomly initialised tiny model (and the char tokenizer) to `out_dir`; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    if tokenizer:
        build_tokenizer(out)
    return out


# ---- vision-language models -----------------------------------------------------------------------------------

IMAGE_TOKEN = "<image>"
QWEN_IMAGE = (
    "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen2-VL's image entry; <|image_pad|> is expanded
)


def vlm_template(image: str) -> str:
    """The chat template above, with an image entry written as the family's placeholder."""
    return (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}" + image + "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


VLM_FAMILIES = ("llava", "qwen2_5_vl")


def build_tiny_vlm(out_dir: str | os.PathLike, family: str = "llava", seed: int = 0) -> Path:
    """Save a randomly initialised tiny vision-language model with its processor (an image processor, the char
    tokenizer with the family's image tokens, a chat template that writes them) to `out_dir`. `family`: llava (a
    CLIP vision tower, a projector, a Llama language model; 16 image tokens per image) or qwen2_5_vl (a 2-block
    Qwen2.5-VL vision tower with its patch merger; (H/14 * W/14) / 4 image tokens, the image resized within
    [56^2, 112^2] pixels). transformers builds Qwen2.5-VL's processor only with torchvision installed (it holds a
    video processor)."""
    import torch

    if family not in VLM_FAMILIES:
        raise ValueError(f"family must be one of {', '.join(VLM_FAMILIES)} (got {family!r}).")
    out = Path(out_dir)
    torch.manual_seed(seed)
    model, processor = _tiny_llava() if family == "llava" else _tiny_qwen2_5_vl()
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out


def _tiny_llava():
    from transformers import AutoConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = build_tokenizer(extra_specials=(IMAGE_TOKEN,))
    tok.chat_template = vlm_template(IMAGE_TOKEN)
    size, patch = 28, 7
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",  # the CLS feature dropped: one token per patch
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    )
    vision = AutoConfig.for_model(
        "clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=size,
        patch_size=patch,
        projection_dim=32,
    )
    config = LlavaConfig(
        text_config=tiny_config("llama", vocab_size=len(tok)),
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    return LlavaForConditionalGeneration(config), processor


def _tiny_qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except (ImportError, AttributeError, ValueError):
        raise ValueError(
            "a Qwen2.5-VL processor needs torchvision (it holds a video processor): install torchvision, or "
            "build the llava family."
        ) from None
    specials = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    tok = build_tokenizer(extra_specials=specials)
    tok.chat_template = vlm_template(QWEN_IMAGE)
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    processor = Qwen2_5_VLProcessor(
        image_processor=images, tokenizer=tok, video_processor=video, chat_template=tok.chat_template
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # multimodal RoPE: its sections (temporal, height, width) add up to head_dim / 2
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config), processor


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def build_image_dataset(out_dir: str | os.PathLike, rows: int = 16, seed: int = 0) -> Path:
    """A tiny image conversation dataset: PNG squares of four colours in <out_dir>/imgs/, and data.jsonl whose rows
    ask "What colour is this?" about one of them (the path relative to the file) and answer its colour name.
    Returns the data file."""
    import json
    import random

    from PIL import Image

    out = Path(out_dir)
    (out / "imgs").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        name = list(COLOURS)[i % len(COLOURS)]
        size = (rng.randint(20, 48), rng.randint(20, 48))  # sizes vary; the processor resizes them
        Image.new("RGB", size, COLOURS[name]).save(out / "imgs" / f"{i}.png")
        user = [{"type": "image", "image": f"imgs/{i}.png"}, {"type": "text", "text": "What colour is this?"}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": name}]
        lines.append(json.dumps({"messages": messages}))
    data = out / "data.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return data
