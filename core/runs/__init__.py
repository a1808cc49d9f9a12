"""Runs: the run directory, the launcher, and what the pages do to runs (smoke tests, delete)."""
