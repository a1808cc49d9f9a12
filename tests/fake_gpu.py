"""A stand-in for the GPU driver (NVML) where no GPU exists: the only thing the tests mock."""

from core.gpu import GpuInfo

GiB = 2**30


class BusyNvml:
    """Two 24 GiB cards; GPU 1 nearly full with another process's memory (pid 4242: a notebook kernel, another
    run), GPU 0 free."""

    def init(self):
        return None

    def devices(self):
        return [GpuInfo(i, "NVIDIA RTX 4090", 24 * GiB) for i in (0, 1)]

    def driver(self):
        return {"driver": "570.86.15", "cuda": "12.8"}

    def read(self, index):
        held = int(23.5 * GiB) if index == 1 else 0
        return {
            "memory_used": held + int(0.3 * GiB),
            "memory_total": 24 * GiB,
            "processes": [{"pid": 4242, "memory": held}] if held else [],
        }
