"""The run engine: preflight, the Hub sources, the smoke test, the callbacks and the trainer (`python -m core.train`).
What a run is (its config, methods, data formats) lives below, in core.recipe."""
