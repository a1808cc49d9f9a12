"""Try it: greedy generation from one prompt with the base and with the adapter, side by side."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.merge.adapter import load_adapter
from core.merge.common import MergeError, load_tokenizer, tokenizer_source


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
) -> TryResult:
    """Greedy generation from one prompt with the base and with the adapter (one model load, adapter toggled)."""
    # peft and transformers take seconds to import: only when the page's Try it runs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    if not prompt or not prompt.strip():
        raise MergeError("The prompt is empty: type something for both models to continue.")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise MergeError(f"{adapter_dir} is not a peft adapter folder: adapter_config.json is missing.")
    if not (base_dir / "config.json").is_file():
        raise MergeError(f"{base_dir} has no config.json: choose the base model folder.")
    load_adapter(adapter_dir)  # refuse unknown adapter types with our message
    tokenizer = load_tokenizer(tokenizer_source(adapter_dir, base_dir))
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).to(device)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto").to(device)
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
