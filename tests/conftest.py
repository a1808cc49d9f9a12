"""Shared fixtures: tiny real models built locally (no hub), offline mode, few threads (CI has 2 cores), and
the demo built (`demo_built`) and trained (`demo_trained`) once per test session, shared by every test and both
xdist workers."""

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_configure(config):
    """Threads: the cores this process may use, shared among the xdist workers (-n 2 on CI's 2 cores: one each).
    Two workers of two threads each on two cores made torch's OpenMP threads wait on each other: 10 steps of a
    tiny model's training took 16.7 s at 2 threads against 0.8 s at 1 on the loaded dev box. OMP_NUM_THREADS also
    holds for what the tests start (trainers, CLIs, the app), as it already did for some; one set by the user
    stays. Not in xdist's controller, which runs no test: its environment is what the workers inherit."""
    if not hasattr(config, "workerinput"):  # the controller, or the one process: the workers inherit it
        _cache_of_this_session(config)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))


def _cache_of_this_session(config) -> None:
    """The planner's and the schema's disk caches (XDG_CACHE_HOME) in a folder of this session's own, removed at
    its end: a test never reads an entry an earlier day's code wrote, nor writes into the user's home cache."""
    import tempfile

    config._cache_home = tempfile.mkdtemp(prefix="lora-cockpit-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = config._cache_home


def pytest_unconfigure(config):
    home = getattr(config, "_cache_home", None)
    if home:
        shutil.rmtree(home, ignore_errors=True)


# ---- the order files are handed to the two workers ----------------------------------------------------------

# Rough seconds per test, by mark: what orders the files heaviest first (below).
SECONDS_E2E, SECONDS_SLOW, SECONDS_QUICK = 120, 15, 0.5


def pytest_collection_modifyitems(config, items):
    """Heaviest files first. With -n 2 (--dist loadfile, --no-loadscope-reorder: pyproject.toml) xdist hands each
    worker whole files in this order, two ahead; xdist's own order (most tests first) left the browser tests and
    the package test, one or two tests of minutes each, to the end, where one worker ran them while the other was
    idle. Heaviest first is the longest-processing-time rule: the tail is made of quick files, which balance. A
    file's weight is its tests' marks (e2e, slow, neither); a file that uses the shared trained demo is not put
    second when the first uses it too, so the second worker does not start by waiting for the first to build it."""

    def weight(item) -> float:
        if item.get_closest_marker("e2e"):
            return SECONDS_E2E
        return SECONDS_SLOW if item.get_closest_marker("slow") else SECONDS_QUICK

    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files, key=lambda f: -sum(weight(i) for i in files[f]))  # stable: ties keep their order

    def demo(f):
        return any({"demo_trained", "demo_built"} & set(getattr(i, "fixturenames", ())) for i in files[f])

    if len(order) > 2 and demo(order[0]) and demo(order[1]):
        other = next((f for f in order[2:] if not demo(f)), None)
        if other is not None:
            order.remove(other)
            order.insert(1, other)
    items[:] = [item for f in order for item in files[f]]


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    import torch

    torch.set_num_threads(min(2, int(os.environ["OMP_NUM_THREADS"])))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama-style model with GQA and the char tokenizer, fp32, one safetensors file."""
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory) -> Path:
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_tied"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt2"), "gpt2")


@pytest.fixture()
def workspace(tmp_path, monkeypatch) -> Path:
    """A fresh workspace folder, also exported for subprocesses and the Streamlit app."""
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.setenv("LORA_COCKPIT_WORKSPACE", str(ws))
    return ws


# ---- the trained demo, once per session -----------------------------------------------------------------------


def shared_dir(tmp_path_factory) -> Path:
    """A folder every worker of this pytest session sees: with -n N (xdist) each worker's basetemp is
    <session>/popen-gwK, so their parent; in one process the session's own basetemp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive lock on `lock` (fcntl.flock: the other worker waits here until the holder is done)."""
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached(tmp_path_factory, name: str, build) -> Path:
    """`build(folder)` run once per session across workers, its folder shared (read-only by convention: a test
    that changes it takes a copy). A failed build is recorded, so the other worker fails at once with the same
    error instead of building again."""
    root = shared_dir(tmp_path_factory) / "shared-fixtures"
    root.mkdir(exist_ok=True)
    folder, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with _exclusive(root / f"{name}.lock"):
        if failed.exists():
            pytest.fail(
                f"the shared fixture {name} failed to build (in another worker): {failed.read_text()}"
            )
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            try:
                build(folder)
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}"[-4000:])
                raise
            done.write_text("ok")
    return folder


@dataclass(frozen=True)
class TrainedDemo:
    """A demo folder shared by the whole session: `python -m core.demo --out FOLDER --run` (demo_trained: the
    default pretraining and its SFT run trained) or the assets alone (demo_built). Read it, never write into it;
    `copy(dest)` gives a folder of your own."""

    folder: Path
    stdout: str

    @property
    def run_dir(self) -> Path:
        return self.folder / "example-run"

    @property
    def adapter(self) -> Path:
        return self.run_dir / "adapter"

    def copy(self, dest: Path) -> Path:
        """A copy of the demo's assets (base, data, manifest) at `dest`, without a trained run; a run.yaml (the
        CLI writes one) written again for `dest`, as the CLI there would have (its paths are absolute)."""
        from core.demo.build import RUN_CONFIG, write_run_config

        shutil.copytree(self.folder, dest, ignore=shutil.ignore_patterns("example-run*"))
        if (dest / RUN_CONFIG).exists():
            write_run_config(dest)
        return dest


def _train_demo(folder: Path) -> None:
    folder.mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, "-m", "core.demo", "--out", str(folder / "demo"), "--run"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # a tiny model: one thread is fastest on 2 shared cores
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (folder / "stdout.txt").write_text(proc.stdout)
    (folder / "result.json").write_text(json.dumps({"returncode": proc.returncode}))


def _build_demo_200(folder: Path) -> None:
    from core.demo.build import build_demo

    build_demo(folder / "demo", pretrain_steps=200, log=lambda _m: None)


@pytest.fixture(scope="session")
def demo_built(tmp_path_factory) -> TrainedDemo:
    """The demo's assets with a 200-step pretrained base, built once for the session (both workers), no run: what
    the tests calibrated on that base start from (test_eval's 40-step run, the launched run of test_demo, the
    browser tests whose runs must still be learning at their evaluations). `copy(dest)` for a folder of your own."""
    folder = cached(tmp_path_factory, "demo-200", _build_demo_200)
    return TrainedDemo(folder / "demo", "")


@pytest.fixture(scope="session")
def demo_trained(tmp_path_factory) -> TrainedDemo:
    """The demo, built and its SFT run trained by the demo's own CLI, once for the whole session (both workers):
    what the CLI's own test (test_demo) and the DPO/KTO/GRPO demo tests start from."""
    folder = cached(tmp_path_factory, "demo-trained", _train_demo)
    return TrainedDemo(folder / "demo", (folder / "stdout.txt").read_text())


# ---- GRPO on the Train page (test_page_train_grpo, test_page_train_guards) ----

GRPO_WORDS = ["abc", "dog", "cat", "sun", "red", "sky", "box", "map", "pen", "ink"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """GRPO prompts (uppercase a word) with their answers, as the Train page's GRPO tests give them."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Uppercase: {w}", "answer": w.upper()}) + "\n" for w in GRPO_WORDS)
    )
    return path


@pytest.fixture(scope="module")
def own_reward(tmp_path_factory) -> Path:
    """A user's own Python reward file defining `reward`."""
    path = tmp_path_factory.mktemp("code") / "my_reward.py"
    path.write_text("def reward(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n")
    return path


@contextlib.contextmanager
def stand_in_run(run_dir: Path, seconds: int = 120):
    """A run folder whose pid is a live process (a sleeping python standing in for the trainer) and whose status
    says running: what a live run looks like to the launcher, without paying for a real one."""
    from core import procs, stopping
    from core.rundir import write_status

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model:\n  path: x\ndata:\n  path: y\n")
    fd = procs.claim(run_dir)  # as a launcher starts its trainer: the lock handed down, pid and start time
    try:
        pid = procs.spawn(run_dir, [sys.executable, "-c", f"import time; time.sleep({seconds})"], fd)
    finally:
        os.close(fd)
    write_status(run_dir, state="running", step=3, max_steps=100)
    try:
        yield run_dir
    finally:
        stopping.kill_tree(pid)
        stopping.wait_gone(run_dir, 30)
