"""Runs: the launcher, the supervisor, the queue and sweeps, and what the pages do to runs (smoke tests, delete).
The run directory's file contract is core.rundir, on the ground floor."""
