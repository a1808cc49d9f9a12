"""Measurement: one real training step measured against the planner (the live-tensor tracker: core.tracker)."""
