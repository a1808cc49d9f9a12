"""Planning: the model specs, the memory bill of a training step, the fit search (`python -m core.estimate`)."""
