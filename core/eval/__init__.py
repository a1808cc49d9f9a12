"""Evaluate a fine-tune on held-out data: the base against the tuned model, row by row (issue #24).

    python -m core.eval --run RUN [--data FILE] [--limit N]

core.eval.run does one evaluation end to end and stores it in <run>/eval/<name>/; core.eval.scores holds the
metrics, core.generate the batched greedy generation and answer losses (also used by the trainer's samples
callback), core.eval.heldout the rows, core.eval.target what is compared, core.eval.prefs the DPO/KTO figures.
This file imports nothing, so the light parts stay light.
"""
