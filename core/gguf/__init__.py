"""Export a local HF model folder to GGUF (llama.cpp, Ollama, LM Studio): streamed tensor by tensor, verified
against the source before the file appears, with an Ollama Modelfile beside it.

UI-free API for a page:
    estimate_size(model_dir, out_type) -> dict        # output bytes, without reading tensor data
    export_gguf(model_dir, out, out_type, verify_mode, on_progress=callback) -> ExportResult
    read_progress(out) -> dict | None                 # the progress file a running export keeps beside --out
    ExportResult.report                               # the verification report (dict, also FILE.gguf.verify.json)
BadInput: unusable input, nothing written.  ExportError: failed export or check, nothing at --out.

CLI: python -m core.gguf --model DIR --out FILE.gguf --type f16|bf16|q8_0|q5_0|q4_0|q4_k_m...
                         [--verify auto|full|quick|none]
"""

from core.gguf.export import (
    ALL_TYPES,
    VERIFY_MODES,
    ExportError,
    ExportResult,
    estimate_size,
    export_gguf,
    report_path,
    summary_lines,
)
from core.gguf.source import BadInput
from core.gguf.tensors import K_TYPES, TYPES
from core.gguf.verify import TENSOR_RMS_LIMITS
from core.gguf.verify_logits import LOGIT_LIMITS
from core.gguf.writer import progress_path, read_progress

__all__ = [
    "summary_lines",
    "ALL_TYPES",
    "K_TYPES",
    "LOGIT_LIMITS",
    "TENSOR_RMS_LIMITS",
    "TYPES",
    "VERIFY_MODES",
    "BadInput",
    "ExportError",
    "ExportResult",
    "estimate_size",
    "export_gguf",
    "progress_path",
    "read_progress",
    "report_path",
]
