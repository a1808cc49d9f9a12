"""Merge a LoRA adapter into its base model shard by shard, verify it, and export it atomically.

`merge_and_unload()` loads the whole model (often in fp32); this engine instead reads the base checkpoint one
tensor (or one block of rows) at a time and streams each output tensor straight into its output shard, so RAM
stays near one tensor plus the adapter whatever the model size. Every merged weight is computed in fp32 and
rounded once to the output dtype. The export is written into a temporary folder beside the target and renamed
into place only when it is complete and verified: a merge killed midway leaves no target folder.

Pitfalls handled (docs/design/merge.md): tied embeddings (lm_head written explicitly, tie flag cleared),
GPT-2 Conv1D (layer kind from the model built on the meta device, never from shapes), embedding LoRA
(transposed delta), modules_to_save (replace, not add), rsLoRA, rank/alpha patterns (r read from tensor shapes),
key mapping (an adapter tensor that matches nothing fails loudly), DoRA on Linear/Conv1D, unknown adapter
types and features refused with a clear message.

Modules: errors (MergeError), progress (the progress record and its sentence), model_files (tokenizer and
processor files, the auto class), shards (safetensors/.bin reading, streaming shard writer),
adapter (reading a peft adapter), mapping (key mapping, layer kinds, tied embeddings, output shards), delta (the
merged-weight math), fingerprint (the base weights an adapter was trained on, recorded by the trainer), compat
(does the adapter belong to this base: recorded weights fingerprint, recorded base, vocabulary), precheck
(preflight: RAM, disk, target), verify (verification), export (the atomic merge), tryit (base vs adapter
generation), discover (adapters and their base for the page), __main__ (the CLI).

Paths: merge() and preflight() are the page's: the output must lie inside the workspace. merge_at() and
preflight_at() take any output folder (the CLI's: the user owns the shell).

The public names below are loaded on first use: `from core import merge` imports no torch, so the pages
and `python -m core.merge --help` start fast; `merge.merge`, `merge.preflight`, ... import what they need.
"""

from __future__ import annotations

import importlib

# name -> submodule that defines it
_EXPORTS = {
    "core.merge.errors": ("MergeError",),
    "core.merge.progress": ("MergeProgress", "ProgressFn", "progress_sentence"),
    "core.merge.model_files": ("TOKENIZER_FILES", "is_vision_model"),
    "core.merge.shards": (
        "COPY_BLOCK",
        "ST_DTYPES",
        "TORCH_TO_ST",
        "FLOAT_CODES",
        "DTYPE_ARGS",
        "DTYPE_NAMES",
        "TensorInfo",
        "read_safetensors_header",
        "BaseCheckpoint",
    ),
    "core.merge.adapter": ("UNSUPPORTED_FEATURES", "LoraModule", "Adapter", "load_adapter"),
    "core.merge.mapping": ("TensorPlan", "MergePlan", "parse_size", "plan_merge"),
    "core.merge.delta": ("CHUNK_BYTES", "merged_blocks"),
    "core.merge.fingerprint": ("FINGERPRINT_FILE", "Fingerprint", "fingerprint", "record_base"),
    "core.merge.precheck": (
        "RUNTIME_OVERHEAD",
        "Preflight",
        "mismatches",
        "preflight",
        "preflight_at",
        "workspace_target",
    ),
    "core.merge.verify": ("TOLERANCES", "DEFAULT_PROMPTS", "Verification", "verify_export"),
    "core.merge.export": (
        "TEMP_MARKER",
        "TEMP_GLOB",
        "PAUSE_ENV",
        "MergeResult",
        "merge",
        "merge_at",
    ),
    "core.merge.tryit": ("TryResult", "try_adapter"),
    "core.merge.discover": (
        "run_config_for",
        "is_qlora",
        "AdapterChoice",
        "guess_base",
        "list_adapters",
        "suggest_export_name",
        "folder_listing",
    ),
    "core.merge.__main__": ("main",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'core.merge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
