"""Try it: greedy generation from one prompt with the base and with the adapter, side by side."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.merge.adapter import load_adapter
from core.merge.errors import MergeError, load_json
from core.merge.model_files import auto_model_class, load_tokenizer, tokenizer_source


@dataclass
class TryResult:
    prompt: str
    base_text: str
    adapter_text: str
    seconds: float


def try_adapter(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    prompt: str,
    max_new_tokens: int = 48,
    device: str = "cpu",
    chat: bool = True,
    image: str | os.PathLike | None = None,
) -> TryResult:
    """Greedy generation from one prompt with the base and with the adapter (one model load, adapter toggled).
    image: a picture the prompt asks about (a vision-language model's adapter; through its processor)."""
    # peft and transformers take seconds to import: only when the page's Try it runs
    from peft import PeftModel

    t0 = time.time()
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    if not prompt or not prompt.strip():
        raise MergeError("The prompt is empty: type something for both models to continue.")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise MergeError(f"{adapter_dir} is not a peft adapter folder: adapter_config.json is missing.")
    if not (base_dir / "config.json").is_file():
        raise MergeError(f"{base_dir} has no config.json: choose the base model folder.")
    load_adapter(adapter_dir)  # refuse unknown adapter types with our message
    config = load_json(base_dir / "config.json", "restore config.json from the model's original files.")
    if image is not None:
        text, ids, tokenizer = _with_image(base_dir, adapter_dir, prompt, Path(image), config)
        ids = ids.to(device)
    else:
        tokenizer = load_tokenizer(tokenizer_source(adapter_dir, base_dir))
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).to(device)
    model = auto_model_class(config).from_pretrained(str(base_dir), dtype="auto").to(device)
    model = PeftModel.from_pretrained(model, str(adapter_dir)).to(device).eval()
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    n = ids["input_ids"].shape[1]
    with torch.no_grad():
        with model.disable_adapter():
            base_out = model.generate(**ids, **kwargs)
        adapter_out = model.generate(**ids, **kwargs)
    return TryResult(
        prompt=text,
        base_text=tokenizer.decode(base_out[0, n:], skip_special_tokens=True),
        adapter_text=tokenizer.decode(adapter_out[0, n:], skip_special_tokens=True),
        seconds=time.time() - t0,
    )


def _with_image(base_dir: Path, adapter_dir: Path, prompt: str, image: Path, config: dict):
    """(rendered prompt, the processor's inputs, its tokenizer) of one question about one picture."""
    from PIL import Image
    from transformers import AutoProcessor

    if not isinstance(config.get("vision_config"), dict):
        raise MergeError(
            f"{base_dir} is not a vision-language model (no vision_config): ask without an image."
        )
    try:
        with Image.open(image) as im:
            picture = im.convert("RGB")
    except (OSError, ValueError) as exc:
        raise MergeError(f"The image {image} cannot be read ({exc}): choose a PNG or JPEG file.") from None
    own = (adapter_dir / "processor_config.json").is_file()
    processor = AutoProcessor.from_pretrained(str(adapter_dir if own else base_dir))
    content = [{"type": "image", "image": str(image)}, {"type": "text", "text": prompt}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = processor(text=[text], images=[picture], return_tensors="pt", add_special_tokens=False)
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return text, ids, tokenizer
