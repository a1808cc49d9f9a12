"""Batched greedy answers and teacher-forced answer losses: the two model calls an evaluation makes.

Low in the layering (imports nothing of core): the trainer's samples callback (core.train.eval_callbacks) uses the
same generation as `python -m core.eval`. Prompts are token ids; batches are left-padded and formed from prompts
of similar length (sorted), so little is spent on padding; answers come back in the prompts' order.
"""

from __future__ import annotations

from collections.abc import Callable

GREEDY_BATCH = 32  # prompts answered at once (the samples callback's, and the planner's eval phase)


def model_device(model):
    import torch

    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def pad_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def sides(model, tuned):
    """[(side, model, context)]: the base first (the adapter switched off, or the base model), then the tuned."""
    import contextlib

    if tuned is None:
        return [("base", model, model.disable_adapter()), ("tuned", model, contextlib.nullcontext())]
    return [("base", model, contextlib.nullcontext()), ("tuned", tuned, contextlib.nullcontext())]


def _padded(seqs: list[list[int]], pad: int, left: bool):
    """(input ids, attention mask) of token lists padded to the longest: on the left for generation (every row
    ends where its answer begins), on the right for a forward pass."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            cols = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[row, cols] = torch.tensor(seq, dtype=torch.long)
            mask[row, cols] = 1
    return ids, mask


def both_sides(model, tuned, tokenizer, prompts, targets, max_new_tokens, batch_size, report) -> dict:
    """{side: (greedy answers, [summed NLL of each target list])} for the base and the tuned model: what an
    evaluation asks of each side. `targets` are token lists to score after the prompts (reference answers, or
    chosen and rejected answers); `report(phase=, done=, total=)` hears of each batch."""
    n, pad, out = len(prompts), pad_id(tokenizer), {}
    for side, m, ctx in sides(model, tuned):

        def tell(what, s=side):
            return lambda k: report(phase=f"{s} {what}", done=k, total=n)

        with ctx:
            said = greedy(m, tokenizer, prompts, max_new_tokens, batch_size, on_batch=tell("answers"))
            losses = [
                answer_losses(m, prompts, t, batch_size, pad, on_batch=tell("answer loss")) for t in targets
            ]
        out[side] = (said, losses)
    return out


def _batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def greedy(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int = GREEDY_BATCH,
    on_batch: Callable[[int], None] | None = None,
    min_new_tokens: int = 0,
) -> list[str]:
    """The greedy answer to each prompt (decoded, special tokens dropped, stripped), stopping at EOS.

    `on_batch(n_done)` is called after each batch (progress); `min_new_tokens`: no stop before (a smoke test's
    answers are as long as a run's can be)."""

    out: list[str] = [""] * len(prompts)
    device, pad = model_device(model), pad_id(tokenizer)

    def batch(idx: list[int]) -> None:
        ids, mask = _padded([prompts[i] for i in idx], pad, left=True)
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens or None,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )
        for row, i in enumerate(idx):
            out[i] = tokenizer.decode(gen[row, ids.shape[1] :], skip_special_tokens=True).strip()

    _in_batches(model, [len(p) for p in prompts], batch_size, batch, on_batch)
    return out


def answer_losses(
    model,
    prompts: list[list[int]],
    answers: list[list[int]],
    batch_size: int = 32,
    pad: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> list[float]:
    """The summed negative log-likelihood of each answer's tokens after its prompt (teacher forcing), in nats:
    divided by the answer's token count, the mean loss per token the trainer's eval_loss also reports."""
    import torch

    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    out: list[float] = [0.0] * len(seqs)
    device = model_device(model)

    def batch(idx: list[int]) -> None:
        ids, mask = _padded([seqs[i] for i in idx], pad, left=False)
        target = torch.zeros_like(mask, dtype=torch.bool)
        for row, i in enumerate(idx):
            target[row, len(prompts[i]) : len(seqs[i])] = True
        ids, mask, target = ids.to(device), mask.to(device), target.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        # the token at position t is predicted by the logits at t - 1
        logps = torch.log_softmax(logits[:, :-1], dim=-1)
        token = logps.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        sums = -(token * target[:, 1:]).sum(-1)
        for row, i in enumerate(idx):
            out[i] = float(sums[row])

    _in_batches(model, [len(x) for x in seqs], batch_size, batch, on_batch)
    return out


def _in_batches(model, lengths: list[int], batch_size: int, work, on_batch) -> None:
    """`work(indices)` for each batch (rows of similar length together), in eval mode and without gradients,
    with progress after each; the model's training mode is restored after."""
    import torch

    was_training, done = model.training, 0
    model.eval()
    try:
        with torch.no_grad():
            for idx in _batches(lengths, batch_size):
                work(idx)
                done += len(idx)
                if on_batch is not None:
                    on_batch(done)
    finally:
        model.train(was_training)
