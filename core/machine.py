"""This machine as a run started on it finds it: the torch build and what it can use (CUDA, ROCm, MPS), NVML's GPUs
with their free memory and who holds the rest, the driver, bitsandbytes' backend, the optional kernels, the RAM.

The planner ("this machine's card", a GPU another process holds, the kernel path of a recurrent layer, a CPU run's
RAM) and `lora-cockpit doctor` read these functions: one place knows the machine. Every reading is guarded: a
missing package, driver or library is a fact (None, False, a reason), never an exception. torch and bitsandbytes
are imported only by the functions that report on them; the kernels are looked up without being imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata

from core import gpu

# The libraries a run trains with (distribution names): the versions a bug report needs first
STACK = ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets")
# Optional kernels, distribution -> the module its code imports as. The planner assumes a recurrent layer's kernel
# path only where its modules are importable (core.estimate.layer_kinds); use_liger_kernel needs liger's.
KERNELS = {
    "flash-attn": "flash_attn",
    "liger-kernel": "liger_kernel",
    "flash-linear-attention": "fla",
    "mamba-ssm": "mamba_ssm",
    "causal-conv1d": "causal_conv1d",
}


def _guard(fn, default=None):
    try:
        return fn()
    except Exception:
        return default


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None."""
    try:
        return metadata.version(dist)
    except Exception:  # not installed, or its metadata is unreadable
        return None


def importable(module: str) -> bool:
    """Can `module` be imported here? find_spec only: none of its code runs (a CUDA kernel package's import can
    take seconds or fail loudly). A dotted name whose parent is missing reads as absent."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def kernels() -> dict[str, str | None]:
    """Each optional kernel (KERNELS) -> its version where it is importable, else None."""
    return {dist: (version(dist) or "present") if importable(mod) else None for dist, mod in KERNELS.items()}


def packages() -> dict[str, str | None]:
    """The training stack's versions (STACK), None for one not installed."""
    return {dist: version(dist) for dist in STACK}


def system() -> dict:
    """Python and the OS, as a bug report gives them."""
    os_name = platform.platform()
    if sys.platform.startswith("linux"):
        release = _guard(platform.freedesktop_os_release, {}) or {}
        if release.get("PRETTY_NAME"):
            os_name = f"{release['PRETTY_NAME']} ({os_name})"
    env = (
        "virtualenv"
        if sys.prefix != sys.base_prefix
        else "conda"
        if os.environ.get("CONDA_PREFIX")
        else "system"
    )
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "environment": env,
        "os": os_name,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def ram() -> tuple[int, int]:
    """(total, available) bytes of RAM: what a CPU run is planned against."""
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


@dataclass(frozen=True)
class TorchFacts:
    version: str | None
    build: str  # "CPU", "CUDA 12.8", "ROCm 6.3" (what the wheel was built for), or "not importable"
    cuda: bool  # torch.cuda.is_available(): CUDA or ROCm devices torch can use
    devices: int  # how many
    mps: bool  # Apple's Metal backend
    error: str | None = None  # why torch does not import

    @property
    def gpu_build(self) -> bool:
        return self.build.startswith(("CUDA", "ROCm"))


def torch_facts() -> TorchFacts:
    try:
        import torch
    except Exception as exc:  # a broken wheel (missing libcudart, an ABI mismatch) is what a user asks about
        return TorchFacts(version("torch"), "not importable", False, 0, False, f"{type(exc).__name__}: {exc}")
    hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
    build = f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU"
    usable = bool(_guard(torch.cuda.is_available, False))
    count = int(_guard(torch.cuda.device_count, 0) or 0) if usable else 0
    mps = bool(_guard(lambda: torch.backends.mps.is_available(), False))
    return TorchFacts(torch.__version__, build, usable, count, mps)


def torch_devices() -> list[dict]:
    """The devices torch itself sees ({index, name, memory_total}): a ROCm GPU, or a CUDA one where NVML cannot
    tell. Properties only: no context is created, so no GPU memory is taken."""
    import torch

    out = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = _guard(lambda i=i: torch.cuda.get_device_properties(i))
        out.append(
            {
                "index": i,
                "name": getattr(props, "name", gpu.NA),
                "memory_total": getattr(props, "total_memory", None),
            }
        )
    return out


@dataclass(frozen=True)
class CudaGpus:
    """What a run started here trains on: NVML's NVIDIA GPUs and how many of them torch can use."""

    gpus: tuple[gpu.GpuInfo, ...]  # every NVIDIA GPU of the machine, in nvidia-smi's order
    usable: int  # CUDA devices torch can use here: 0 means a run trains on the CPU
    reason: str | None = None  # why NVML lists none


def cuda_gpus(source: gpu.GpuSource | None = None) -> CudaGpus:
    """NVML finds the GPUs cheaply; torch is imported only when it finds one, to confirm it can use them (a CPU
    build of torch on a GPU box trains on the CPU, and so must its plan)."""
    devices, reason = gpu.detect_gpus(source)
    usable = 0
    if devices:
        found = torch_facts()
        usable = found.devices if found.cuda else 0
    return CudaGpus(tuple(devices), usable, reason)


@dataclass(frozen=True)
class Gpu:
    """One reading of one NVIDIA GPU: its memory and every process holding some of it (all another's: nothing of
    ours runs yet)."""

    index: int  # nvidia-smi's number
    name: str
    memory_total: int | None
    memory_used: int | None
    others: tuple[dict, ...] = ()  # {pid, memory (bytes or None), name (where names were asked for)}

    @property
    def memory_free(self) -> int | None:
        if self.memory_total is None or self.memory_used is None:
            return None
        return max(0, self.memory_total - self.memory_used)


@dataclass(frozen=True)
class Nvml:
    gpus: tuple[Gpu, ...]
    reason: str | None = None  # why there are none
    driver: str | None = None  # the NVIDIA driver's version
    cuda: str | None = None  # the newest CUDA that driver runs ("12.8")


def _process_name(pid: int) -> str | None:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # gone, another user's, or in another container's pid namespace
        return None


def nvml(indices=None, source: gpu.GpuSource | None = None, names: bool = False) -> Nvml:
    """One reading of the machine's NVIDIA GPUs (those `indices` names, nvidia-smi's numbers), with the driver.
    `names`: each holding process's name too (a psutil look-up per pid)."""
    source = source or gpu.NvmlSource()
    devices, reason = gpu.detect_gpus(source)
    if reason:
        return Nvml((), reason)
    driver = getattr(source, "driver", None)  # an injected source may not say
    found = (_guard(driver) if driver else None) or {}
    picked = [d for d in devices if indices is None or d.index in indices]
    by_index = {d.index: d for d in picked}
    gpus = []
    for s in gpu.take_samples(source, picked):
        others = tuple(
            {**p, "name": _process_name(p["pid"])} if names else dict(p) for p in s.other_processes
        )
        gpus.append(Gpu(s.index, by_index[s.index].name, s.memory_total, s.memory_used, others))
    return Nvml(tuple(gpus), None, found.get("driver"), found.get("cuda"))


def gpu_readings(indices=None, source: gpu.GpuSource | None = None) -> list[Gpu]:
    """The GPUs `indices` names as a run about to start finds them; [] without NVML."""
    return list(nvml(indices, source).gpus)


@dataclass(frozen=True)
class Bitsandbytes:
    version: str | None  # None: not installed
    backend: str | None  # bitsandbytes' own name for what it runs on: "CUDA", "ROCm", "XPU", "CPU"
    native: bool  # its native library for that backend loaded
    error: str | None = None  # why it does not import, or what it said when its library did not load

    @property
    def gpu(self) -> bool:
        """Can 4-bit loading and the 8-bit / paged optimizers run on a GPU here?"""
        return self.backend in ("CUDA", "ROCm") and self.native


def bitsandbytes() -> Bitsandbytes:
    """bitsandbytes' backend, as it chose it on import (from the torch build and the native libraries it ships).
    Its import prints and logs when a library is missing: captured, and kept as the error."""
    found = version("bitsandbytes")
    if found is None or not importable("bitsandbytes"):
        return Bitsandbytes(None, None, False)
    said = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            warnings.simplefilter("ignore")
            from bitsandbytes import cextension
    except Exception as exc:
        return Bitsandbytes(found, None, False, f"{type(exc).__name__}: {exc}")
    backend = getattr(cextension, "BNB_BACKEND", None)
    mock = getattr(cextension, "ErrorHandlerMockBNBNativeLibrary", None)
    lib = getattr(cextension, "lib", None)
    native = lib is not None and not (isinstance(mock, type) and isinstance(lib, mock))
    text = " ".join(said.getvalue().split())
    return Bitsandbytes(
        found, backend, native, None if native else (text[:300] or "its native library did not load")
    )
