"""The demo: a tiny local model and dataset it learns on a CPU (`python -m core.demo`)."""
