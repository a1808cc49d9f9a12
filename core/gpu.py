"""GPU discovery and sampling through NVML, every call guarded (nvitop style): a missing driver, a missing
library or an unsupported query gives None / "N/A", never an exception.

The sampling layer takes a *source* object so tests can inject samples on machines without a GPU; the real
NVML source is the default.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

NA = "N/A"


@dataclass
class GpuInfo:
    index: int
    name: str
    memory_total: int | None  # bytes
    uuid: str | None = None  # "GPU-xxxxxxxx-..." from NVML: ties an NVML index to a torch CUDA device


@dataclass
class GpuSample:
    """One reading of one GPU. Bytes for memory, percent for utilisation, Celsius, watts."""

    time: float
    index: int
    memory_used: int | None
    memory_total: int | None
    utilization: float | None
    temperature: float | None
    power_w: float | None
    process_memory: int | None = None  # bytes used on this GPU by the watched process tree
    other_processes: list[dict] = field(default_factory=list)  # [{pid, memory}] not in the tree


class GpuSource(Protocol):
    def init(self) -> str | None:
        """None when ready, else a sentence saying why there is no GPU data."""

    def devices(self) -> list[GpuInfo]: ...

    def read(self, index: int) -> dict: ...


def _guard(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # NVMLError of any kind, AttributeError on old bindings, ...
        return default


class NvmlSource:
    """The real NVML via `pynvml` (package nvidia-ml-py)."""

    def __init__(self):
        self._nvml = None
        self._handles: dict[int, object] = {}

    def init(self) -> str | None:
        try:
            import pynvml
        except Exception:
            return "no NVIDIA GPU found (the pynvml module from nvidia-ml-py is not installed)"
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            return f"no NVIDIA GPU found (NVML could not start: {exc})"
        self._nvml = pynvml
        if not self.devices():
            return "no NVIDIA GPU found (NVML reports 0 devices)"
        return None

    def _handle(self, index: int):
        if index not in self._handles:
            self._handles[index] = _guard(self._nvml.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def devices(self) -> list[GpuInfo]:
        if self._nvml is None:
            return []
        out = []
        for i in range(_guard(self._nvml.nvmlDeviceGetCount, default=0) or 0):
            h = self._handle(i)
            if h is None:
                continue
            name = _guard(self._nvml.nvmlDeviceGetName, h, default=NA)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            mem = _guard(self._nvml.nvmlDeviceGetMemoryInfo, h)
            uuid = _guard(self._nvml.nvmlDeviceGetUUID, h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode(errors="replace")
            out.append(GpuInfo(i, str(name), getattr(mem, "total", None), uuid))
        return out

    def _temperature(self, h):
        # nvmlDeviceGetTemperature is deprecated (to be removed with CUDA 14); its successor
        # nvmlDeviceGetTemperatureV needs a recent driver. Try the new one first, the old one second.
        nv = self._nvml
        sensor = getattr(nv, "NVML_TEMPERATURE_GPU", 0)
        for getter in ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"):
            fn = getattr(nv, getter, None)
            value = _guard(fn, h, sensor) if fn is not None else None
            if isinstance(value, (int, float)):
                return value
        return None

    def _processes(self, h) -> list[dict]:
        """[{pid, memory}] of the compute and graphics processes on the card, one entry per pid.

        A process with both a CUDA and a graphics context is listed by both queries: counted once, with the
        larger figure. usedGpuMemory is None where the driver cannot tell (pynvml maps
        NVML_VALUE_NOT_AVAILABLE to None). The unversioned getters call the _v3 entry points; a driver
        without them (NVMLError_FunctionNotFound) gets the _v2 ones."""
        nv, by_pid = self._nvml, {}
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            found = None
            for name in (getter, getter + "_v2"):
                fn = getattr(nv, name, None)
                found = _guard(fn, h) if fn is not None else None
                if found is not None:
                    break
            for p in found or []:
                pid = getattr(p, "pid", None)
                if pid is None:
                    continue
                memory = getattr(p, "usedGpuMemory", None)
                if not isinstance(memory, int) or memory < 0:
                    memory = None
                known = by_pid.get(int(pid))
                if known is None or (memory is not None and (known["memory"] or 0) < memory):
                    by_pid[int(pid)] = {"pid": int(pid), "memory": memory}
        return list(by_pid.values())

    def driver(self) -> dict:
        """{"driver": "570.86.15", "cuda": "12.8"}: the driver's version and the newest CUDA it runs (what decides
        which torch build works here); None for what NVML cannot tell."""
        nv = self._nvml
        if nv is None:
            return {"driver": None, "cuda": None}
        version = _guard(nv.nvmlSystemGetDriverVersion)
        if isinstance(version, bytes):
            version = version.decode(errors="replace")
        cuda = None
        for getter in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
            fn = getattr(nv, getter, None)
            cuda = _guard(fn) if fn is not None else None
            if isinstance(cuda, int) and cuda > 0:
                break
        # NVML encodes CUDA 12.8 as 12080
        return {
            "driver": str(version) if version else None,
            "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) and cuda > 0 else None,
        }

    def read(self, index: int) -> dict:
        nv, h = self._nvml, self._handle(index)
        if nv is None or h is None:
            return {}
        mem = _guard(nv.nvmlDeviceGetMemoryInfo, h)
        util = _guard(nv.nvmlDeviceGetUtilizationRates, h)
        power = _guard(nv.nvmlDeviceGetPowerUsage, h)  # milliwatts
        return {
            "memory_used": getattr(mem, "used", None),
            "memory_total": getattr(mem, "total", None),
            "utilization": getattr(util, "gpu", None),
            "temperature": self._temperature(h),
            "power_w": power / 1000.0 if isinstance(power, (int, float)) else None,
            "processes": self._processes(h),
        }


def detect_gpus(source: GpuSource | None = None) -> tuple[list[GpuInfo], str | None]:
    """(GPUs, None) or ([], reason). Never raises."""
    source = source or NvmlSource()
    try:
        reason = source.init()
        return ([], reason) if reason else (source.devices(), None)
    except Exception as exc:
        return [], f"no NVIDIA GPU found ({exc})"


def process_tree(pid: int) -> set[int]:
    """pid and all its descendants (psutil), or just {pid} when psutil cannot see them."""
    try:
        import psutil

        proc = psutil.Process(pid)
        return {pid} | {c.pid for c in proc.children(recursive=True)}
    except Exception:
        return {pid}


def take_samples(source: GpuSource, devices: list[GpuInfo], watch_pid: int | None = None) -> list[GpuSample]:
    tree = process_tree(watch_pid) if watch_pid else set()
    now = time.time()
    out = []
    for dev in devices:
        r = _guard(source.read, dev.index, default={}) or {}
        procs = r.get("processes") or []
        # None when no process of the tree reports a figure: "unknown" must not read as 0 bytes
        mine = [p["memory"] for p in procs if p.get("pid") in tree and p.get("memory") is not None]
        others = [p for p in procs if p.get("pid") not in tree]
        out.append(
            GpuSample(
                time=now,
                index=dev.index,
                memory_used=r.get("memory_used"),
                memory_total=r.get("memory_total") or dev.memory_total,
                utilization=r.get("utilization"),
                temperature=r.get("temperature"),
                power_w=r.get("power_w"),
                process_memory=sum(mine) if mine else None,
                other_processes=others,
            )
        )
    return out


class GpuSampler:
    """Appends one JSON line per GPU per interval to `path` from a daemon thread.

    Without NVML it writes nothing and reports the reason once through `on_unavailable`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        interval: float = 1.0,
        watch_pid: int | None = None,
        source: GpuSource | None = None,
        on_unavailable=None,
    ):
        self.path = Path(path)
        self.interval = interval
        self.watch_pid = watch_pid or os.getpid()
        self.source = source or NvmlSource()
        self.on_unavailable = on_unavailable
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuSampler:
        devices, self.reason = detect_gpus(self.source)
        if self.reason:
            if self.on_unavailable:
                self.on_unavailable(self.reason)
            return self
        self._devices = devices
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        with open(self.path, "a", encoding="utf-8") as fh:
            while not self._stop.is_set():
                for s in take_samples(self.source, self._devices, self.watch_pid):
                    fh.write(json.dumps(asdict(s)) + "\n")
                fh.flush()
                self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
