"""Models and datasets from the Hub by id (issue #35), against a real Hub-protocol server on 127.0.0.1 (olah,
tests/hub_server.py), through the CLIs a user runs: the plan from config.json and the safetensors headers alone,
the download (only what training needs, progress, a free-space check, resumable after a kill), the cache list and
delete, offline mode, a missing repo or revision, a gated repo, and a dataset previewed from a streamed sample."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.hub_server import REPO, HubServer

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import olah"], capture_output=True).returncode != 0,
    reason="olah is not installed (pip install -r requirements.txt)",
)

ROWS = [{"question": f"Uppercase: w{i}", "answer": f"W{i}"} for i in range(40)]
README = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train.jsonl\n---\n# rows\n"
TRAINING_FILES = {
    "config.json",
    "generation_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """olah serving acme/tiny (a tiny Llama in 4 safetensors shards, plus a .bin, a GGUF and an original/ folder
    that training does not need), acme/big (the same with a 24 MiB shard: a download that takes a while) and the
    dataset acme/rows (40 question/answer rows)."""
    from core.demo.toy import build_tiny_model

    root = tmp_path_factory.mktemp("hub")
    model = build_tiny_model(root / "tiny", "llama", max_shard_size="100KB")
    server = HubServer(root / "server")
    junk = {"pytorch_model.bin": b"not needed", "model.gguf": b"GGUF", "original/consolidated.pth": b"x"}
    server.commit_tiny = server.publish_folder("acme/tiny", model, **junk)
    big = os.urandom(24 << 20)  # random: git cannot compress it, so serving it takes a moment
    server.publish_folder("acme/big", model, **{"model-zz-extra.safetensors": big})
    server.publish(
        "acme/rows",
        {"README.md": README, "train.jsonl": "".join(json.dumps(r) + "\n" for r in ROWS)},
        "dataset",
    )
    server.tiny_files = {p.name for p in model.iterdir()}
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def downloaded(hub, tmp_path_factory):
    """An HF_HOME holding acme/tiny, downloaded once by the CLI (its output kept for the progress test)."""
    home = tmp_path_factory.mktemp("hf_home")
    proc = hub.run(["-m", "core.hub", "download", "acme/tiny"], home)
    assert proc.returncode == 0, proc.stderr
    return home, proc


def snapshot_files(home: Path, repo: str = "models--acme--tiny") -> set[str]:
    snaps = home / "hub" / repo / "snapshots"
    return {p.relative_to(s).as_posix() for s in snaps.glob("*") for p in s.rglob("*") if p.is_file()}


def one_sentence(proc) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_plan_from_config_and_safetensors_headers_without_weights(hub, tmp_path):
    proc = hub.run(["-m", "core.estimate", "--model", "acme/tiny", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    short = hub.commit_tiny[:7]
    assert f"the Hub, acme/tiny @ {short}" in out["model_source"]
    assert "87,104 params in F32 (4 safetensors files)" in out["model_source"]  # the headers' exact count
    assert out["total_params"] == 87_104  # the meta model agrees with the headers
    cached = snapshot_files(tmp_path)
    assert "config.json" in cached and not [f for f in cached if f.endswith((".safetensors", ".bin"))]
    blobs = sum(p.stat().st_size for p in (tmp_path / "hub" / "models--acme--tiny" / "blobs").iterdir())
    assert blobs < 10_000  # the config and the shard index: kilobytes, no weights
    # the human table says the same
    proc = hub.run(["-m", "core.estimate", "--model", f"acme/tiny@{hub.commit_tiny}"], tmp_path)
    assert proc.returncode == 0 and f"acme/tiny @ {short}" in proc.stdout


def test_download_fetches_only_training_files_with_progress_and_never_twice(hub, downloaded):
    home, proc = downloaded
    lines = [line for line in proc.stdout.splitlines() if line.startswith("download:")]
    assert len(lines) >= 2 and lines[-1].startswith("download: 100%") and "10/10 files" in lines[-1]
    shares = [int(line.split()[1].rstrip("%")) for line in lines]
    assert shares == sorted(shares)  # progress only goes forward
    assert any("/s" in line for line in lines)  # a rate
    assert snapshot_files(home) == hub.tiny_files  # not the .bin, the GGUF or original/
    assert hub.gets("acme/tiny", "pytorch_model.bin") == 0 and hub.gets("acme/tiny", "model.gguf") == 0
    before = {f: hub.gets("acme/tiny", f) for f in hub.tiny_files}
    again = hub.run(["-m", "core.hub", "download", "acme/tiny"], home)
    assert again.returncode == 0 and "10 already cached, 0 B to fetch" in again.stdout
    assert {f: hub.gets("acme/tiny", f) for f in hub.tiny_files} == before
    listed = hub.run(["-m", "core.hub", "ls", "--json"], home)
    (entry,) = json.loads(listed.stdout)
    assert entry["id"] == "acme/tiny" and entry["revisions"][0]["complete"] is True
    assert entry["revisions"][0]["commit"] == hub.commit_tiny and entry["revisions"][0]["refs"] == ["main"]
    table = hub.run(["-m", "core.hub", "ls"], home).stdout
    assert "acme/tiny main @ " + hub.commit_tiny[:7] in table and "KiB" in table


def test_a_killed_download_resumes_without_fetching_complete_files_again(hub, tmp_path):
    """Killed (SIGKILL) after the first files completed, with the server paused so nothing else completes: the
    next download sends only what was missing (the server's log has one GET for each complete file)."""
    env = hub.env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.hub", "download", "acme/big"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("download:") and " 0/" not in line:
                break  # at least one file is complete
        hub.pause()
        proc.kill()
        proc.wait()
    finally:
        hub.resume()
    complete = snapshot_files(tmp_path, "models--acme--big")
    wanted = hub.tiny_files | {"model-zz-extra.safetensors"}
    assert complete and complete < wanted, "the kill should fall mid-download"
    hub_manifest = next((tmp_path / "hub" / "models--acme--big" / "lora-cockpit").glob("*.json"))
    assert set(json.loads(hub_manifest.read_text())["sizes"]) == wanted  # what a complete snapshot holds
    listed = json.loads(hub.run(["-m", "core.hub", "ls", "--json"], tmp_path).stdout)
    assert listed[0]["revisions"][0]["complete"] is False  # a partial snapshot never reads as complete
    sent = {f: hub.gets("acme/big", f) for f in complete}
    again = hub.run(["-m", "core.hub", "download", "acme/big"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"{len(complete)} already cached" in again.stdout
    assert {f: hub.gets("acme/big", f) for f in complete} == sent  # no second GET for a complete file
    assert snapshot_files(tmp_path, "models--acme--big") == wanted


def test_a_download_job_reports_progress_and_cancel_keeps_what_finished(hub, tmp_path, monkeypatch):
    """The Models page's path: core.jobs runs the download; Cancel ends it, the next job fetches the rest."""
    from core import jobs

    for key, value in hub.env(tmp_path / "hf").items():
        monkeypatch.setenv(key, value)  # the job process inherits them
    ws = tmp_path / "ws"
    params = {"id": "acme/big", "revision": None, "type": "model", "key": "model:acme/big"}
    folder = jobs.start(ws, "hub", params, key="model:acme/big")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            view = jobs.read(folder)
            if view.done or view.progress.get("files_done", 0) >= 1:
                break
            time.sleep(0.05)
        hub.pause()
        jobs.cancel(folder)
    finally:
        hub.resume()
    view = jobs.read(folder)
    assert view.state == "failed" and view.error == "cancelled", (view.state, view.error)
    done = jobs.start(ws, "hub", params, key="model:acme/big")
    while not (view := jobs.read(done)).done:
        time.sleep(0.1)
    assert view.state == "finished", view.error
    p = view.result["progress"]
    assert p["bytes_done"] == p["bytes_total"] > 24 << 20 and p["files_done"] == p["files_total"] == 11
    assert "rate_bps" in p and "eta_s" in p and p["commit"]


def test_offline_uses_the_cache_and_says_what_is_missing(hub, downloaded):
    home, _ = downloaded
    plan = hub.run(["-m", "core.estimate", "--model", "acme/tiny"], home, offline=True)
    assert plan.returncode == 0, plan.stderr
    assert (
        "the cache, acme/tiny @ " in plan.stdout
        and "cached safetensors headers: 87,104 params" in plan.stdout
    )
    info = hub.run(["-m", "core.hub", "info", "acme/tiny"], home, offline=True)
    assert info.returncode == 0 and "offline" in info.stdout
    for args in (
        ["-m", "core.hub", "download", "acme/rows2"],
        ["-m", "core.estimate", "--model", "acme/rows2"],
    ):
        line = one_sentence(hub.run(args, home, offline=True))
        assert "HF_HUB_OFFLINE=1" in line and "not in the local Hugging Face cache" in line


def test_missing_repo_and_missing_revision_each_get_a_sentence(hub, tmp_path):
    line = one_sentence(hub.run(["-m", "core.hub", "info", "acme/nothere"], tmp_path))
    assert f"the Hub at {hub.endpoint} has no model acme/nothere" in line
    line = one_sentence(hub.run(["-m", "core.hub", "download", "acme/tiny", "--revision", "v9"], tmp_path))
    assert "has no revision 'v9' of acme/tiny" in line
    line = one_sentence(hub.run(["-m", "core.estimate", "--model", "acme/nothere"], tmp_path))
    assert "Unknown model 'acme/nothere'" in line and "has no model acme/nothere" in line
    assert not (tmp_path / "hub" / "models--acme--nothere" / "snapshots").exists()


class _Gated(BaseHTTPRequestHandler):
    """What the Hub answers for a gated repo without an accepted licence (403, X-Error-Code: GatedRepo). olah's
    mirror mode has no gating, so this one answer stands in for it."""

    def _refuse(self):
        self.send_response(403)
        self.send_header("X-Error-Code", "GatedRepo")
        self.send_header("X-Error-Message", "Access to model acme/gated is restricted.")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _refuse

    def log_message(self, *args):
        pass


def test_a_gated_repo_says_accept_the_licence_then_set_hf_token(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gated)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = HubServer(tmp_path).env(tmp_path / "hf")
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}"
        proc = subprocess.run(
            [sys.executable, "-m", "core.hub", "download", "acme/gated"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.shutdown()
    line = one_sentence(proc)
    assert "acme/gated is gated" in line and "accept its licence" in line and "HF_TOKEN" in line


def test_a_download_that_would_not_fit_is_refused_before_any_byte(hub, tmp_path):
    line = one_sentence(
        hub.run(["-m", "core.hub", "download", "acme/tiny"], tmp_path, LORA_COCKPIT_HUB_KEEP_FREE="1000TB")
    )
    assert "needs 349.0 KiB more" in line and "must stay free" in line and "HF_HOME" in line
    repo = tmp_path / "hub" / "models--acme--tiny"
    assert not (repo / "lora-cockpit").exists() and not list(repo.glob("blobs/*"))


def test_rm_refuses_a_repo_a_live_run_uses_then_deletes_it(hub, tmp_path):
    home = tmp_path / "hf"
    assert hub.run(["-m", "core.hub", "download", "acme/tiny"], home).returncode == 0
    ws = tmp_path / "ws"
    run = ws / "runs" / "busy-run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: acme/tiny}\ndata: {path: data.jsonl}\n")
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 1}))
    owner = subprocess.Popen(  # a process that owns the run folder (its lock), as a trainer does
        [
            sys.executable,
            "-c",
            "import sys,time; from core import procs; fd = procs.claim(sys.argv[1]); "
            "procs.write_pid_info(sys.argv[1]); print('owned', flush=True); time.sleep(600)",
            str(run),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout.readline().strip() == "owned"
        line = one_sentence(hub.run(["-m", "core.hub", "rm", "acme/tiny", "--workspace", str(ws)], home))
        assert "used by the live run 'busy-run'" in line
        assert "acme/tiny" in hub.run(["-m", "core.hub", "ls"], home).stdout
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    done = hub.run(["-m", "core.hub", "rm", "acme/tiny", "--workspace", str(ws)], home)
    assert done.returncode == 0 and "deleted acme/tiny" in done.stdout, done.stderr
    assert "holds nothing" in hub.run(["-m", "core.hub", "ls"], home).stdout
    line = one_sentence(hub.run(["-m", "core.hub", "rm", "acme/tiny"], home))
    assert "not in the Hugging Face cache" in line


PREVIEW = """
import json, sys
from core.recipe.data import DataError, load_rows, preview_dataset
from core.recipe.findings import load_tokenizer_and_config
tok, _ = load_tokenizer_and_config({"path": "acme/tiny"})
data = json.loads(sys.argv[1])
pv = preview_dataset(data, tok, n=3)
try:
    load_rows({**data, "split": "validation"})
except DataError as exc:
    bad_split = str(exc)
print(json.dumps({"sample": pv["sample"], "rows": pv["rows"], "total": pv["total_rows"], "bad_split": bad_split}))
"""


def test_a_hub_dataset_is_previewed_and_checked_from_a_streamed_sample(hub, tmp_path):
    data = {"path": "acme/rows", "columns": {"instruction": "question", "output": "answer"}}
    proc = hub.run(["-c", PREVIEW, json.dumps(data)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sample"].startswith("a streamed sample of the first 40 rows of acme/rows @ ")
    assert out["rows"][0]["completion"].startswith("W0") and out["total"] == 40
    assert (
        out["bad_split"] == "data.split 'validation' is not a split of the dataset acme/rows: it has train."
    )
    assert "train.jsonl" not in snapshot_files(tmp_path, "datasets--acme--rows")  # streamed, not downloaded
    assert not [f for f in snapshot_files(tmp_path) if f.endswith(".safetensors")]  # the tokenizer alone
    # preflight on the same sample: columns that fit no format are named, with those needed
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"model": {"path": "acme/tiny"}, "data": {"path": "acme/rows"}}))
    proc = hub.run(["-m", "core.preflight", str(cfg)], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("ERROR")]
    assert "from the columns question, answer" in line and "'instruction' + 'output'" in line
