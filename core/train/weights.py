"""The weights against config.json, from the safetensors headers alone: before anything is loaded.

transformers finds a tensor of the wrong shape only after reading the weights (a size-mismatch traceback), and a
file whose header claims a terabyte only when it maps it (MemoryError). Both are told here in one sentence: every
tensor's shape is compared with the model config.json describes, built on the meta device as the planner builds
it (core.estimate.specs), and the bytes the headers claim with the bytes that model can hold.
"""

from __future__ import annotations

import math
from pathlib import Path

from core.estimate.specs import parameter_shapes
from core.files import read_json_object
from core.fmt import nbytes
from core.recipe.findings import MISMATCH_FIX, loaded_weight_files, model_folder, safetensors_header

ITEMSIZE = dict(F64=8, I64=8, U64=8, F32=4, I32=4, U32=4, F16=2, BF16=2, I16=2, U16=2)  # bytes per element
# Real checkpoints carry a little beyond the model (a multi-token-prediction layer, a vision tower a causal LM
# leaves out): twice what the config implies, at the widest dtype stored, is never a real one.
CLAIM_FACTOR = 2


def weights_problem(path: str) -> str | None:
    """None when the weights the trainer would load fit config.json (or cannot be compared: .bin weights, an
    architecture transformers cannot build, a quantized checkpoint's packed shapes); else one sentence naming the
    file, the tensor and both sizes. Reads the headers only. Run after check_model_folder."""
    folder = model_folder(path) if isinstance(path, str) else None
    config = read_json_object(folder / "config.json") if folder else None
    if config is None:
        return None  # check_model_folder has said why
    try:
        prefix, expected = parameter_shapes(config)
    except Exception:  # SpecError, or a library's own (remote code, not a causal LM): the plan tells it
        return None
    headers = {}
    for file in loaded_weight_files(folder):
        header = safetensors_header(file)
        if header is not None:
            headers[file] = {k: v for k, v in header.items() if _tensor_entry(v)}
    if not headers:
        return None
    return _oversized(headers, expected) or (
        None if config.get("quantization_config") else _mismatch(headers, prefix, expected)
    )


def _oversized(headers: dict[Path, dict], expected: dict[str, tuple]) -> str | None:
    """The bytes the headers claim against the most the config's parameters can take at the widest dtype stored:
    a sparse or forged file claiming a terabyte is refused here rather than mapped by the loader."""
    widest = max((ITEMSIZE.get(v.get("dtype"), 4) for h in headers.values() for v in h.values()), default=4)
    params = sum(math.prod(shape) for shape in expected.values())
    implied = params * widest
    claims = {file: max((v["data_offsets"][1] for v in h.values()), default=0) for file, h in headers.items()}
    claimed = sum(claims.values())
    if claimed <= CLAIM_FACTOR * implied:
        return None
    file = max(claims, key=claims.get)
    name, entry = max(
        headers[file].items(), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0]
    )
    on_disk = file.stat().st_blocks * 512
    sparse = (
        f" (only {nbytes(on_disk)} of it is on disk: a sparse file)"
        if on_disk < file.stat().st_size / 2
        else ""
    )
    return (
        f"model.path: {file}'s header claims {nbytes(claims[file])} of tensors{sparse}, its {name} alone "
        f"{nbytes(entry['data_offsets'][1] - entry['data_offsets'][0])}: loading it would need that much memory "
        f"while config.json implies at most {nbytes(implied)} ({params:,} parameters at {widest} bytes each), so "
        "it is not this model's weights: copy or download them again."
    )


def _mismatch(headers: dict[Path, dict], prefix: str, expected: dict[str, tuple]) -> str | None:
    """The first tensor whose shape differs from the one the config implies for the same parameter. A name is
    matched as transformers loads it: as is, under the base model's prefix, or without it. A name the model does
    not have is left alone (the loader ignores it, or converts it)."""
    wrong = []
    for file, header in headers.items():
        for name, entry in header.items():
            key = _parameter_name(name, prefix, expected)
            if key is not None and tuple(entry["shape"]) != expected[key]:
                wrong.append((file, name, tuple(entry["shape"]), expected[key]))
    if not wrong:
        return None
    file, name, got, want = wrong[0]
    more = f" ({len(wrong) - 1} more tensor(s) differ too)" if len(wrong) > 1 else ""
    return (
        f"model.path: {file}: the tensor {name} is {_shape(got)}, config.json implies {_shape(want)}{more}: "
        f"{MISMATCH_FIX}"
    )


def _tensor_entry(v) -> bool:
    """A header entry that describes a tensor: what the checks read (the metadata and malformed entries are not)."""
    return (
        isinstance(v, dict)
        and _sizes(v.get("shape"))
        and _sizes(v.get("data_offsets"))
        and len(v["data_offsets"]) == 2
    )


def _sizes(values) -> bool:
    return isinstance(values, list) and all(type(x) is int and x >= 0 for x in values)


def _parameter_name(name: str, prefix: str, expected: dict) -> str | None:
    if name in expected:
        return name
    if prefix and f"{prefix}.{name}" in expected:
        return f"{prefix}.{name}"
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in expected:
        return name[len(prefix) + 1 :]
    return None


def _shape(shape: tuple) -> str:
    return "[" + ", ".join(f"{d:,}" for d in shape) + "]"
