"""Every benchmark still runs (issue 48, item 5): nothing else ran benchmarks/, so a script could rot while
RESULTS.md cites it. Each benchmark has a quick mode, `python benchmarks/X.py --quick`: its own code path on its
smallest input, in seconds. A quick mode checks that the script runs, not its goal (a toy input cannot judge a 5%
or a 1% goal): it exits 0 on a goal miss and non-zero on an error, and still ends with its headline, `name: value
(goal ...)`. Each script's docstring says what its --quick runs.

A benchmark file in neither QUICK nor ELSEWHERE fails test_every_benchmark_is_covered: a new benchmark comes with
its quick run. The runs are subprocesses, as a user starts them (an interpreter each, imports included: ~10 to 40
CPU-seconds a script), so they are marked slow, the browser ones e2e; CI runs both (.ci/run runs the README's
`pytest -n 2`, no mark left out)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.browser import CHROMIUM

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"

# script -> the name its headline starts with
QUICK = {
    "cold_start.py": "cold_start",
    "estimate_speed.py": "estimate_speed",
    "estimator_accuracy.py": "estimator_accuracy",
    "eval_accuracy.py": "eval_accuracy",
    "eval_speed.py": "eval_speed",
    "families_accuracy.py": "families_worst_error",
    "first_point.py": "first_point_s",
    "gguf_export.py": "gguf_export",
    "gguf_llamacpp.py": "gguf_llamacpp",  # without llama-cpp-python: everything up to llama.cpp
    "grpo_accuracy.py": "grpo_accuracy",
    "hybrid_accuracy.py": "hybrid_worst_error",
    "merge_memory.py": "merge_memory",
    "model_coverage.py": "planner_tracebacks",
    "moe_accuracy.py": "moe_worst_error",
    "moe_published.py": "moe_published",
    "monitor_overhead.py": "monitor_overhead",
    "monitor_refresh.py": "monitor_refresh",
    "server_idle.py": "server_idle_cpu",
    "vlm_accuracy.py": "vlm_worst_error",
    "vlm_published.py": "vlm_published",
}
BROWSER = {"cold_start.py", "server_idle.py"}  # a Streamlit server in Chromium
# more arguments after --quick: families_accuracy's --quick steps every family's tiny twin (twice each, a minute of
# CPU and growing with FAMILIES), twins the layer tests step already (tests/test_layer_plan.py and the others that
# import its FAMILIES and measure); here the script's own loop and headline, on one family
MORE = {"families_accuracy.py": ["--only", "llama"]}

# script -> (a test that already runs it, the code in that test that runs it): not run a second time here
ELSEWHERE = {
    # the GPU scripts' --dry-run (what their --quick is): a CUDA GPU's code paths on the CPU; 2 gloo ranks
    "gpu_truth.py": ("tests/test_gpu_truth.py", ['"benchmarks/gpu_truth.py", "--dry-run"']),
    "multi_gpu_truth.py": ("tests/test_distributed_sharding.py", ['"multi_gpu_truth.py"', '"--dry-run"']),
    # planner-only scripts run whole there, their goal judged
    "max_context.py": ("tests/test_levers.py", ['[sys.executable, "benchmarks/max_context.py"]']),
    "multi_gpu_published.py": (
        "tests/test_distributed_plan.py",
        ["import multi_gpu_published as bench", "bench.main("],
    ),
}

# the last line: a name, maybe a qualifier such as "(dry run, cpu)", a colon, the figures, the goal in parentheses
HEADLINE = re.compile(r"(?P<name>\w+)[^:]*: \S.*\(goal\b[^)]*\)")


def marks(script: str) -> list:
    if script in BROWSER:
        return [
            pytest.mark.e2e,
            pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium"),
        ]
    return [pytest.mark.slow]


def test_every_benchmark_is_covered():
    """A benchmark without a quick run here (or a test elsewhere that runs it) fails: it would rot unseen."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    uncovered = scripts - QUICK.keys() - ELSEWHERE.keys()
    assert not uncovered, (
        f"benchmarks with no quick run in {Path(__file__).name}'s QUICK: {sorted(uncovered)}"
    )
    assert not (QUICK.keys() | ELSEWHERE.keys() | MORE.keys()) - scripts, "a benchmark named here is gone"
    for script in sorted(scripts):
        source = (BENCHMARKS / script).read_text()
        assert '"--quick"' in source, f"{script}: no --quick option"
        doc = ast.get_docstring(ast.parse(source)) or ""
        assert "--quick" in doc, f"{script}: its docstring does not say what --quick runs"
    for script, (test, runs) in ELSEWHERE.items():
        text = (REPO / test).read_text()
        assert all(code in text for code in runs), f"{test} no longer runs benchmarks/{script} ({runs})"


@pytest.mark.parametrize("script", [pytest.param(script, marks=marks(script)) for script in QUICK])
def test_quick_mode_runs_and_ends_with_its_headline(script, tmp_path):
    workspace = tmp_path / "ws"  # what a script writes into the default workspace lands here
    workspace.mkdir()
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *MORE.get(script, [])],
        cwd=REPO,
        env={**os.environ, "LORA_COCKPIT_WORKSPACE": str(workspace)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, tail
    last = (done.stdout.strip().splitlines() or [""])[-1]
    headline = HEADLINE.match(last)
    assert headline and headline["name"] == QUICK[script], (
        f"the last line is not the headline: {last!r}\n{tail}"
    )
