"""benchmarks/gpu_truth.py stays runnable: its --dry-run takes every code path on the CPU (issue #15)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_truth_dry_run_passes_and_reports_every_part(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_truth.py", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("gpu_truth (dry run, cpu): tensor peak median")
    report = json.loads((tmp_path / "gpu_truth.json").read_text())
    assert report["planner"]["rows"] and report["planner"]["summary"]["err_tensor"]["worst"] <= 0.07
    assert {report["product"][v]["state"] for v in ("lora", "qlora")} == {"finished"}
    assert report["merge"]["passed"] and "skipped" in report["failures"]
    assert report["versions"]["trl"]
    assert "0 CUDA GPU(s) visible" in report["multi_gpu"]["skipped"]
