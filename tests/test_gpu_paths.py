"""The CUDA/NVML-only branches, exercised on a machine without a GPU.

Only the GPU driver is mocked: a fake `pynvml` module with the real function names, returning the real
pynvml structs (c_nvmlMemory_t, c_nvmlUtilization_t, process info as pynvml's friendly objects) and raising
the real NVMLError subclasses. torch / transformers / peft / bitsandbytes are real.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

import pynvml
import pytest
import torch

from core import gpu
from core.tracker import _nvml_index_of_cuda, _uuid_key, track_live_tensors

GiB = 2**30
FAN_PID = 424242  # a pid that is not ours: "another program on the card"


def _proc(pid: int, used: int | None):
    """A process entry as pynvml returns it: its v3 struct turned into a friendly object, with
    NVML_VALUE_NOT_AVAILABLE mapped to None as pynvml does (WDDM, some consumer drivers)."""
    raw = pynvml.c_nvmlProcessInfo_v3_t()
    raw.pid = pid
    raw.usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
    obj = pynvml.nvmlStructToFriendlyObject(raw)
    if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        obj.usedGpuMemory = None
    return obj


def fake_nvml(
    compute=(),
    graphics=(),
    new_temperature_api=False,
    v3_processes=True,
    uuid=b"GPU-6f1a6e2c-0000-4b1e-9a51-1234567890ab",
):
    """A mocked NVML driver binding with one RTX 4090: the pynvml function names, argument lists and return
    types of nvidia-ml-py 13; `nvmlDeviceGetTemperatureV` missing from old drivers, the _v3 process queries
    missing from old drivers (NVMLError_FunctionNotFound)."""
    handle = object()
    not_found = pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    calls = []

    def need_handle(h):
        assert h is handle, "queries must use the handle nvmlDeviceGetHandleByIndex gave"

    def memory(h, version=None):
        need_handle(h)
        return pynvml.c_nvmlMemory_t(total=24 * GiB, free=4 * GiB, used=20 * GiB)

    def utilization(h):
        need_handle(h)
        return pynvml.c_nvmlUtilization_t(gpu=97, memory=61)

    def temperature(h, sensor):
        need_handle(h)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        calls.append("GetTemperature")
        return 71

    def temperature_v(h, sensor, version=pynvml.nvmlTemperature_v1):
        need_handle(h)
        calls.append("GetTemperatureV")
        if not new_temperature_api:
            raise not_found
        return 72

    def processes(found, versioned):
        def get(h):
            need_handle(h)
            if versioned and not v3_processes:
                raise not_found
            return list(found)

        return get

    def name(h):
        need_handle(h)
        return "NVIDIA GeForce RTX 4090"  # nvidia-ml-py 13 decodes to str (convertStrBytes)

    mod = types.ModuleType("pynvml")
    mod.NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    mod.nvmlInit = lambda: None
    mod.nvmlDeviceGetCount = lambda: 1
    mod.nvmlDeviceGetHandleByIndex = lambda i: handle if i == 0 else (_ for _ in ()).throw(not_found)
    mod.nvmlDeviceGetName = name
    mod.nvmlDeviceGetUUID = lambda h: uuid
    mod.nvmlDeviceGetMemoryInfo = memory
    mod.nvmlDeviceGetUtilizationRates = utilization
    mod.nvmlDeviceGetTemperature = temperature
    mod.nvmlDeviceGetTemperatureV = temperature_v
    mod.nvmlDeviceGetPowerUsage = lambda h: 287_450  # milliwatts
    mod.nvmlDeviceGetComputeRunningProcesses = processes(compute, True)
    mod.nvmlDeviceGetComputeRunningProcesses_v2 = processes(compute, False)
    mod.nvmlDeviceGetGraphicsRunningProcesses = processes(graphics, True)
    mod.nvmlDeviceGetGraphicsRunningProcesses_v2 = processes(graphics, False)
    mod.calls = calls
    return mod


@pytest.fixture()
def use_fake_nvml(monkeypatch):
    def install(**kwargs):
        mod = fake_nvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod

    return install


def test_nvml_source_mocked_nvml_reads_real_struct_shapes(use_fake_nvml):
    use_fake_nvml(compute=[_proc(os.getpid(), 3 * GiB), _proc(FAN_PID, GiB)])
    src = gpu.NvmlSource()
    assert src.init() is None
    (dev,) = src.devices()
    assert (dev.index, dev.name, dev.memory_total) == (0, "NVIDIA GeForce RTX 4090", 24 * GiB)
    assert dev.uuid == "GPU-6f1a6e2c-0000-4b1e-9a51-1234567890ab"
    r = src.read(0)
    assert r["memory_used"] == 20 * GiB and r["memory_total"] == 24 * GiB
    assert r["utilization"] == 97
    assert r["power_w"] == pytest.approx(287.45)  # NVML reports milliwatts
    assert r["temperature"] == 71
    (sample,) = gpu.take_samples(src, [dev], watch_pid=os.getpid())
    assert sample.process_memory == 3 * GiB
    assert sample.other_processes == [{"pid": FAN_PID, "memory": GiB}]
    json.dumps(sample.__dict__)  # what GpuSampler writes must be JSON


def test_temperature_mocked_nvml_prefers_new_api_and_falls_back_on_old_drivers(use_fake_nvml):
    old = use_fake_nvml(new_temperature_api=False)
    src = gpu.NvmlSource()
    src.init()
    assert src.read(0)["temperature"] == 71
    assert old.calls == ["GetTemperatureV", "GetTemperature"]
    new = use_fake_nvml(new_temperature_api=True)
    src = gpu.NvmlSource()
    src.init()
    assert src.read(0)["temperature"] == 72
    assert new.calls == ["GetTemperatureV"]


def test_unknown_process_memory_mocked_nvml_is_none_not_zero(use_fake_nvml):
    # WDDM and some drivers cannot tell a process's memory: pynvml gives usedGpuMemory None.
    use_fake_nvml(compute=[_proc(os.getpid(), None)], graphics=[_proc(FAN_PID, None)])
    src = gpu.NvmlSource()
    src.init()
    (sample,) = gpu.take_samples(src, src.devices(), watch_pid=os.getpid())
    assert sample.process_memory is None
    assert sample.other_processes == [{"pid": FAN_PID, "memory": None}]


def test_process_in_both_lists_mocked_nvml_is_counted_once(use_fake_nvml):
    # A process with a CUDA and a graphics context is listed by both NVML queries.
    me = os.getpid()
    use_fake_nvml(compute=[_proc(me, 5 * GiB)], graphics=[_proc(me, 5 * GiB), _proc(FAN_PID, GiB // 2)])
    src = gpu.NvmlSource()
    src.init()
    (sample,) = gpu.take_samples(src, src.devices(), watch_pid=me)
    assert sample.process_memory == 5 * GiB
    assert [p["pid"] for p in sample.other_processes] == [FAN_PID]


def test_old_driver_without_v3_process_queries_mocked_nvml_uses_v2(use_fake_nvml):
    me = os.getpid()
    use_fake_nvml(compute=[_proc(me, 2 * GiB)], v3_processes=False)
    src = gpu.NvmlSource()
    src.init()
    (sample,) = gpu.take_samples(src, src.devices(), watch_pid=me)
    assert sample.process_memory == 2 * GiB


def test_sampler_with_real_nvml_source_mocked_nvml_writes_lines(use_fake_nvml, tmp_path):
    use_fake_nvml(compute=[_proc(os.getpid(), 3 * GiB)])
    out = tmp_path / "gpu.jsonl"
    sampler = gpu.GpuSampler(out, interval=0.02).start()  # the default NvmlSource, as core.train uses it
    try:
        deadline = time.time() + 5
        while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 2):
            time.sleep(0.02)
    finally:
        sampler.stop()
    assert sampler.reason is None
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) >= 2
    assert lines[0]["memory_used"] == 20 * GiB
    assert lines[0]["power_w"] == pytest.approx(287.45)
    assert lines[0]["process_memory"] == 3 * GiB


def test_nvml_index_mapping_never_guesses_between_cards():
    # torch prints a CUDA UUID bare, NVML prefixes it with GPU-
    assert _uuid_key("GPU-6F1A6E2C-0000-4b1e") == _uuid_key("6f1a6e2c-0000-4b1e")
    assert _uuid_key("GPU-aaaa") != _uuid_key("GPU-bbbb")
    two = [gpu.GpuInfo(0, "RTX 4090", 24 * GiB, "GPU-aaaa"), gpu.GpuInfo(1, "RTX 4090", 24 * GiB, "GPU-bbbb")]
    if not torch.cuda.is_available():
        # no CUDA device to match by UUID: with two cards any index could be another card's figure
        assert _nvml_index_of_cuda(0, two) is None


def test_tracker_cuda_filter_counts_bitsandbytes_paged_state():
    """bitsandbytes' paged optimizer state (F.get_paged) is CUDA managed memory that torch sees as a CPU
    tensor marked is_paged: the "cuda" filter must count it, and still skip ordinary CPU tensors."""
    with track_live_tensors(device="cuda") as tr:
        paged = torch.zeros(25_000)  # the way get_paged makes it: a CPU tensor over the managed buffer
        paged.is_paged = True
        host = torch.zeros(50_000)
        paged.add_(1.0)  # the optimizer's update uses it
        host.add_(1.0)
        held = tr.current_bytes
    assert held == paged.numel() * 4
    with track_live_tensors(device="cpu") as tr:  # the CPU filter is unchanged: both are CPU storages
        a = torch.zeros(25_000)
        a.is_paged = True
        b = torch.zeros(50_000)
        a.add_(1.0)
        b.add_(1.0)
        held_cpu = tr.current_bytes
    assert held_cpu == (a.numel() + b.numel()) * 4


def test_fp16_mixed_precision_gets_float32_trainable_weights(tiny_llama):
    """fp16 AMP (CUDA only): torch's GradScaler refuses float16 gradients. load_model must hand the Trainer
    float32 trainable weights for full fine-tuning and trainable LoRA biases, loaded in float16 (make_trainer
    applies _fp32_trainable to the model SFTTrainer hands back)."""
    from core.recipe.config import default_config
    from core.train.model import _fp32_trainable
    from core.train.model import load_model as load_base

    def load_model(cfg, prec):
        return _fp32_trainable(load_base(cfg, prec), prec)

    cfg = default_config()
    cfg["model"]["path"] = str(tiny_llama)
    cfg["model"]["dtype"] = "float16"
    cfg["lora"]["enabled"] = False
    from dataclasses import replace

    from core.precision import Device, Precision

    prec = Precision(Device.of("cpu"), "float16", "float16", autocast=True, bf16=False, fp16=True)
    model = load_model(cfg, prec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    # The scaler's own check, on real gradients: it now passes.
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(trainable, lr=0.0)
    ids = torch.tensor([[1, 2, 3, 4]])
    loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    # Control: without fp16 AMP the weights stay as loaded, and the scaler refuses such gradients.
    plain = load_model(cfg, replace(prec, fp16=False, autocast=False))
    assert {p.dtype for p in plain.parameters() if p.requires_grad} == {torch.float16}
    opt16 = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.0)
    scaler16 = torch.amp.GradScaler("cpu")
    loss16 = plain(input_ids=ids, labels=ids).loss
    scaler16.scale(loss16).backward()
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        scaler16.unscale_(opt16)
