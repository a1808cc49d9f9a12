"""`lora-cockpit doctor` (core.doctor) on this machine, for real: the facts it prints are this interpreter's; a
read-only workspace, a full disk and a CPU build of torch beside an NVIDIA GPU each block training with one
sentence and its fix. Only the GPU driver (NVML) is mocked, where no GPU exists (the tests say so in their names);
and the planner's "this machine" is read through the same functions (core.machine)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from core import doctor, gpu, machine
from core.estimate import from_config, layer_kinds
from tests.cli import REPO, in_process
from tests.fake_gpu import BusyNvml

CPU_TORCH = not (torch.version.cuda or getattr(torch.version, "hip", None))


def test_doctor_on_this_machine_prints_the_real_facts_exits_0_and_never_the_token(tmp_path):
    """The installed command's way in (`python -m lora_cockpit doctor` runs core.doctor as __main__), in its own
    interpreter, with a token in the environment."""
    env = dict(os.environ, HF_TOKEN="secret-xyz")
    done = subprocess.run(
        [sys.executable, "-m", "lora_cockpit", "doctor", "--workspace", str(tmp_path / "ws")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert torch.__version__ in lines["torch"]
    assert ("CPU build" if CPU_TORCH else "CUDA" if torch.version.cuda else "ROCm") in lines["torch"]
    assert transformers.__version__ in lines["transformers"]
    for dist in ("peft", "trl", "accelerate", "datasets"):
        assert importlib.metadata.version(dist) in lines[dist]
    assert platform.python_version() in lines["Python"]
    assert f"{tmp_path / 'ws'} (created on first use): writable" in out
    assert "token set (from HF_TOKEN)" in out
    assert "secret-xyz" not in out + done.stderr
    assert out.rstrip().endswith("Nothing blocks training.")


def test_json_has_the_same_facts_as_the_text_and_no_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-xyz")
    done = in_process(doctor.main, "--json", "--workspace", tmp_path)
    assert done.returncode == 0 and "secret-xyz" not in done.stdout
    report = json.loads(done.stdout)
    assert report["packages"]["torch"] == torch.__version__ == report["torch"]["version"]
    assert report["torch"]["cuda"] == torch.cuda.is_available()
    assert report["packages"]["transformers"] == transformers.__version__
    assert report["system"]["python"] == platform.python_version()
    assert report["workspace"]["path"] == str(tmp_path) and report["workspace"]["writable"]
    assert report["hub"]["token_set"] and report["hub"]["token_from"] == "HF_TOKEN"
    assert set(report["kernels"]) == set(machine.KERNELS)
    assert report["ok"] and not any(p["blocks"] for p in report["problems"])
    text = doctor.format_text(report)
    for dist, found in report["packages"].items():
        assert f"{found or 'not installed'}" in text, dist
    assert report["trains_on"]["label"] in text


def _mount_tmpfs(where: Path, *options: str) -> bool:
    """A tmpfs at `where` (root with the right to mount), unmounted at the test's end; False where this machine
    does not let the tests mount. Its size is a limit, not memory taken."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@pytest.fixture
def mounts():
    made: list[Path] = []

    def mount(where: Path, *options: str) -> bool:
        ok = _mount_tmpfs(where, *options)
        if ok:
            made.append(where)
        return ok

    yield mount
    for where in reversed(made):
        subprocess.run(["umount", str(where)], capture_output=True, timeout=30)


def test_a_read_only_workspace_blocks_training_with_its_fix(tmp_path, mounts):
    ws = tmp_path / "ro"
    if not mounts(ws, "ro", "size=64g"):  # roomy: only its being read-only blocks
        ws.mkdir(exist_ok=True)
        ws.chmod(0o555)
        if os.access(ws, os.W_OK):  # root without the right to mount: a mode does not stop it
            pytest.skip("no read-only folder can be made here (root, and no mount allowed)")
    try:
        done = in_process(doctor.main, "--workspace", ws)
    finally:
        if ws.stat().st_mode & 0o777 == 0o555:
            ws.chmod(0o755)
    assert done.returncode == 1
    assert f"The workspace cannot be written ({ws} is " in done.stdout
    assert "choose a folder you can write to (--workspace DIR or $LORA_COCKPIT_WORKSPACE)" in done.stdout
    assert "1 problem blocks training" in done.stdout


def test_a_full_disk_blocks_training_on_a_1_mib_tmpfs(tmp_path, mounts):
    disk = tmp_path / "small"
    if not mounts(disk, "size=1m"):
        pytest.skip("this machine does not let the tests mount a tmpfs")
    done = in_process(doctor.main, "--workspace", disk / "ws")
    assert done.returncode == 1
    assert f"free on the disk holding the workspace {disk / 'ws'} (under 5.00 GiB" in done.stdout
    assert "choose a workspace on a larger disk (--workspace DIR)" in done.stdout


def test_free_space_under_the_threshold_blocks_training(tmp_path):
    """The same check anywhere: a threshold above what this disk has free."""
    above = shutil.disk_usage(tmp_path).free / 2**30 + 1
    done = in_process(doctor.main, "--json", "--workspace", tmp_path, "--min-free-gib", f"{above:.1f}")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    blocking = [p["text"] for p in report["problems"] if p["blocks"]]
    assert any(t.startswith("Only ") and str(tmp_path) in t for t in blocking), blocking
    assert not report["ok"]


@pytest.mark.skipif(not CPU_TORCH, reason="torch here is a GPU build")
def test_cpu_torch_beside_an_nvidia_gpu_names_the_fix_and_exits_1_with_nvml_mocked(tmp_path, monkeypatch):
    monkeypatch.setattr(
        gpu, "NvmlSource", BusyNvml
    )  # two RTX 4090s, GPU 1 held by pid 4242, driver CUDA 12.8
    done = in_process(doctor.main, "--workspace", tmp_path)
    assert done.returncode == 1
    out = done.stdout
    assert "NVIDIA driver  570.86.15 (CUDA 12.8)" in out
    assert "GPU 1          NVIDIA RTX 4090: 24.00 GiB, 204.8 MiB free; pid 4242" in out
    same = torch.__version__.split("+")[0]
    assert (
        "BLOCKS   torch is the CPU build but an NVIDIA GPU is present (NVIDIA RTX 4090): pip uninstall -y "
        f"torch && pip install 'torch=={same}' --index-url https://download.pytorch.org/whl/cu128."
    ) in out
    assert "warning  GPU 1 (NVIDIA RTX 4090) has 23.80 GiB of 24.00 GiB in use (pid 4242" in out
    assert "Trains on      this machine's CPU and RAM (torch can use no GPU)" in out


def test_the_torch_wheel_follows_the_driver():
    assert doctor.cuda_wheel("13.1") == "cu130"
    assert doctor.cuda_wheel("12.8") == "cu128"
    assert doctor.cuda_wheel("12.6") == "cu126"
    assert doctor.cuda_wheel(None) == "cu128"  # the driver did not say: the README's
    assert doctor.cuda_wheel("12.4") is None  # older than any wheel: update the driver first
    old_driver = {"nvidia": {"cuda": "12.4"}, "torch": {"version": "2.13.0+cpu"}, "gpus": [{"index": 0}]}
    assert doctor.torch_fix(old_driver).startswith(
        "update the NVIDIA driver (it runs CUDA 12.4; torch needs 12.6 or newer), then pip uninstall -y torch"
    )
    no_gpu = {"nvidia": {"cuda": None}, "torch": {"version": None}, "gpus": []}
    assert doctor.torch_fix(no_gpu) == "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def test_bad_arguments_exit_2_with_one_sentence(tmp_path):
    done = in_process(doctor.main, "--min-free-gib", "-1")
    assert done.returncode == 2 and "--min-free-gib must be 0 or more, not -1." in done.stderr
    assert done.stdout == ""
    assert in_process(doctor.main, "--no-such-flag").returncode == 2


def test_the_planner_and_doctor_read_one_card_and_warn_of_bitsandbytes_with_nvml_mocked(
    tmp_path, monkeypatch
):
    """core.machine.cuda_gpus is what both call: a GPU that torch can use (mocked, with its driver) is the
    planner's card and doctor's "trains on", and bitsandbytes without a GPU backend beside it is a warning."""
    one = gpu.GpuInfo(0, "NVIDIA L40S", 48 * 2**30)
    monkeypatch.setattr(machine, "cuda_gpus", lambda source=None: machine.CudaGpus((one,), 1))
    card = from_config.local_card()
    assert (card.device, card.count, card.label, card.gpu_gb) == ("cuda", 1, "the NVIDIA L40S", 48.0)
    report = doctor.collect(tmp_path)
    assert report["trains_on"] == {
        "device": "cuda",
        "gpus": 1,
        "label": "1 CUDA GPU(s), first the NVIDIA L40S",
    }
    warnings = [p["text"] for p in report["problems"] if not p["blocks"]]
    bnb = report["bitsandbytes"]
    if bnb["version"] is None:
        assert any(t.startswith("bitsandbytes is not installed") for t in warnings), warnings
    elif not bnb["gpu"]:  # this machine: bitsandbytes' CPU backend
        assert any(
            t.startswith(f"bitsandbytes {bnb['version']} has no GPU backend here") and "QLoRA" in t
            for t in warnings
        ), warnings


def test_the_planner_assumes_the_kernels_doctor_reports(monkeypatch):
    plan = SimpleNamespace(device="cuda", recurrent_kernels="auto")
    present = {"mamba_ssm", "causal_conv1d"}
    monkeypatch.setattr(machine, "importable", lambda module: module in present)
    assert layer_kinds.kernel_path(plan, "mamba2")
    assert not layer_kinds.kernel_path(plan, "gated_deltanet")  # fla is missing
    found = machine.kernels()
    assert found["mamba-ssm"] and found["causal-conv1d"] and found["flash-linear-attention"] is None
