"""LoRA Cockpit as an installed program: `lora-cockpit` starts the app or runs one of its tools (lora_cockpit.cli).
The engine is the `core` package, the pages' helpers the `ui` package; the app's router and pages travel with
the package (lora_cockpit.app_dir)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("lora-cockpit")
except metadata.PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"
