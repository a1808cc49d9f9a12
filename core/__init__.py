"""LoRA Cockpit engine: planning, training runs, monitoring and merging. UI-free (no streamlit here)."""

import logging
import warnings


class _KnownNoise(logging.Filter):
    """Drops log lines that say nothing actionable here, so the first lines of every CLI call and the stderr
    tail the diagnosis reads are the run's own. Real warnings pass."""

    PREFIXES = (
        # bitsandbytes on a CPU without the optional `kernels` package: it falls back to its own kernel
        "Failed to load CPU gemm_4bit_forward from kernels-community",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_KnownNoise())
# transformers 5 renamed gradient_checkpointing to activation_checkpointing; peft and trl still call the old
# names on every run. The engine itself uses the new ones.
warnings.filterwarnings(
    "ignore",
    message=r"`(is_)?gradient_checkpointing(_enable|_kwargs)?` is deprecated and will be removed in v6",
    category=FutureWarning,
)
