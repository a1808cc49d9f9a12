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
            out.append(GpuInfo(i, str(name), getattr(mem, "total", None)))
        return out

    def read(self, index: int) -> dict:
        nv, h = self._nvml, self._handle(index)
        if nv is None or h is None:
            return {}
        mem = _guard(nv.nvmlDeviceGetMemoryInfo, h)
        util = _guard(nv.nvmlDeviceGetUtilizationRates, h)
        power = _guard(nv.nvmlDeviceGetPowerUsage, h)
        procs = []
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            for p in _guard(getattr(nv, getter, None) or (lambda _h: []), h, default=[]) or []:
                procs.append({"pid": int(p.pid), "memory": getattr(p, "usedGpuMemory", None)})
        return {
            "memory_used": getattr(mem, "used", None),
            "memory_total": getattr(mem, "total", None),
            "utilization": getattr(util, "gpu", None),
            "temperature": _guard(nv.nvmlDeviceGetTemperature, h, getattr(nv, "NVML_TEMPERATURE_GPU", 0)),
            "power_w": power / 1000.0 if isinstance(power, (int, float)) else None,
            "processes": procs,
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
        mine = [p["memory"] or 0 for p in procs if p.get("pid") in tree]
        others = [p for p in procs if p.get("pid") not in tree]
        out.append(
            GpuSample(
                time=now,
                index=dev.index,
                memory_used=r.get("memory_used"),
                memory_total=r.get("memory_total", dev.memory_total),
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
