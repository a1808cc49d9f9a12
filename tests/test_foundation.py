"""Foundation: the GPU layer never crashes without a GPU, run names are sanitised, toy assets load."""

import json

import pytest

from core import gpu, workspace


class FakeNvmlNoGpu:
    """Injected GPU source that behaves like a machine with the driver but no device."""

    def init(self):
        return "no NVIDIA GPU found (NVML reports 0 devices)"

    def devices(self):
        return []

    def read(self, index):
        raise AssertionError("must not be read")


class FakeNvmlOneGpu:
    """Injected GPU source (mocked driver: no GPU on this machine) with one 24 GB card and a flaky query."""

    def __init__(self):
        self.calls = 0

    def init(self):
        return None

    def devices(self):
        return [gpu.GpuInfo(0, "Fake RTX 4090", 24 * 2**30)]

    def read(self, index):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return {
            "memory_used": 10 * 2**30,
            "memory_total": 24 * 2**30,
            "utilization": 97,
            "temperature": 70,
            "power_w": 300.0,
            "processes": [{"pid": 999999, "memory": 2**30}],
        }


def test_detect_gpus_on_this_machine_never_raises():
    devices, reason = gpu.detect_gpus()
    assert isinstance(devices, list)
    if not devices:
        assert reason and reason.startswith("no NVIDIA GPU found")


def test_detect_gpus_reports_reason_from_injected_source():
    assert gpu.detect_gpus(FakeNvmlNoGpu()) == ([], "no NVIDIA GPU found (NVML reports 0 devices)")


def test_sampler_with_mocked_gpu_writes_jsonl_and_survives_a_failing_query(tmp_path):
    src = FakeNvmlOneGpu()
    path = tmp_path / "gpu.jsonl"
    sampler = gpu.GpuSampler(path, interval=0.01, source=src).start()
    import time

    deadline = time.time() + 5
    while time.time() < deadline and len(path.read_text().splitlines() if path.exists() else []) < 3:
        time.sleep(0.01)
    sampler.stop()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 3
    assert rows[0]["memory_used"] == 10 * 2**30 and rows[0]["utilization"] == 97
    assert rows[0]["other_processes"] == [{"pid": 999999, "memory": 2**30}]
    # The failed read gives N/A fields, not a crash.
    assert rows[1]["memory_used"] is None and rows[1]["memory_total"] == 24 * 2**30


def test_sampler_without_gpu_writes_nothing_and_says_why_once(tmp_path):
    reasons = []
    path = tmp_path / "gpu.jsonl"
    s = gpu.GpuSampler(path, source=FakeNvmlNoGpu(), on_unavailable=reasons.append).start()
    s.stop()
    assert not path.exists()
    assert reasons == ["no NVIDIA GPU found (NVML reports 0 devices)"]


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "..", " ", "a b", "-x", "x" * 65])
def test_bad_run_names_are_refused_with_the_rule(bad):
    with pytest.raises(workspace.WorkspaceError, match="Run name"):
        workspace.check_run_name(bad)


def test_good_run_name_and_paths_inside_workspace(tmp_path):
    assert workspace.check_run_name("demo-1.b_2") == "demo-1.b_2"
    assert workspace.inside(tmp_path, "runs/a") == (tmp_path / "runs" / "a").resolve()
    with pytest.raises(workspace.WorkspaceError, match="outside the workspace"):
        workspace.inside(tmp_path, "../elsewhere")


def test_toy_model_and_tokenizer_load_with_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    ids = tok("12+3=15", return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == "12+3=15"
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert "<|assistant|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_sizes_read_in_the_unit_that_fits():
    """Issue #21 item 24: 512 bytes read "0 KiB"."""
    from core.fmt import nbytes

    assert [nbytes(n) for n in (0, 512, 1536, 3 * 2**20, 5 * 2**30)] == [
        "0 B",
        "512 B",
        "1.5 KiB",
        "3.0 MiB",
        "5.00 GiB",
    ]


def test_core_jobs_help_is_help_not_a_folder():
    """Issue #21 item 24: `python -m core.jobs --help` looked for ./--help/job.json."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "core.jobs", "--help"], capture_output=True, text=True, timeout=120
    )
    assert (
        out.returncode == 0
        and out.stdout.startswith("usage: python -m core.jobs FOLDER")
        and "job.json" in out.stdout
    )
    bad = subprocess.run(
        [sys.executable, "-m", "core.jobs", "--nope"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "usage" in bad.stderr and "Traceback" not in bad.stderr
