"""LoRA Cockpit engine: planning, training runs, monitoring and merging. UI-free (no streamlit here)."""

__version__ = "0.1.0"
