"""The run engine: the run config, data and preflight, and the trainer (`python -m core.train`)."""
