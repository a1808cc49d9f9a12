"""Measurement: the live-tensor tracker and one real training step measured against the planner."""
