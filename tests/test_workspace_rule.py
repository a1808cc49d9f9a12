"""One rule for the workspace, the app and every tool (#49 item 1): `--workspace`, else $LORA_COCKPIT_WORKSPACE, else
`./workspace` of the folder the command starts in, never beside the package; the app stays in that folder (a
relative path typed in it is read there), and a trainer or job it starts goes back there."""

import os
import sys
import time
from pathlib import Path

import pytest

from core import procs
from core.fmt import PROG_ENV
from core.procs import START_ENV
from core.workspace import ENV_VAR, default_workspace
from tests.cli import REPO, in_process


@pytest.fixture()
def elsewhere(tmp_path, monkeypatch) -> Path:
    """An empty folder outside the checkout, as the working folder, with no workspace in the environment."""
    folder = tmp_path / "start"
    folder.mkdir()
    for name in (ENV_VAR, START_ENV, PROG_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that what a call sets is put back
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.chdir(folder)
    return folder


def test_the_default_workspace_is_workspace_of_the_start_folder_not_beside_the_package(
    elsewhere, monkeypatch
):
    assert default_workspace() == elsewhere / "workspace"
    monkeypatch.setenv(ENV_VAR, "mine")
    assert default_workspace() == elsewhere / "mine"
    assert default_workspace(str(elsewhere / "given")) == elsewhere / "given"  # --workspace first


def test_runs_and_queue_take_workspace_before_or_after_the_verb(elsewhere, tmp_path):
    from core.runs.__main__ import main

    out = in_process(main, "list")
    assert out.returncode == 0 and out.stdout.strip() == f"no runs in {elsewhere / 'workspace' / 'runs'}"
    ws = tmp_path / "ws"
    for args in (("list", "--workspace", ws), ("--workspace", ws, "list"), ("ls", "--workspace", ws)):
        out = in_process(main, *args)
        assert out.returncode == 0 and out.stdout.strip() == f"no runs in {ws / 'runs'}", (args, out)
    shown = in_process(main, "show", "nope", "--workspace", ws)
    assert shown.returncode == 2 and str(ws / "runs") in shown.stderr
    for args in (("queue", "list", "--workspace", ws), ("queue", "--workspace", ws, "list")):
        out = in_process(main, *args)
        assert out.returncode == 0 and f"the queue of {ws} is empty" in out.stdout, (args, out)
    assert not (elsewhere / "workspace").exists()  # nothing was made in the default one


def test_demo_and_eval_take_workspace(elsewhere, tmp_path, monkeypatch):
    import core.demo.__main__ as demo
    from core.demo.build import NotADemoFolder
    from core.eval.cli import main as eval_main

    def refuse(out, **_):  # where the demo would be built, without building it
        raise NotADemoFolder(f"would build {out}")

    monkeypatch.setattr(demo, "build_demo", refuse)
    ws = tmp_path / "ws"
    built = in_process(demo.main, "--workspace", ws)
    assert built.returncode == 2 and f"would build {ws / 'demo'}" in built.stderr, built.stderr
    built = in_process(demo.main)
    assert f"would build {elsewhere / 'workspace' / 'demo'}" in built.stderr, built.stderr
    evaluated = in_process(eval_main, "--run", "nope", "--workspace", ws)
    assert evaluated.returncode == 2 and f"nor a run name under {ws / 'runs'}" in evaluated.stderr


def test_the_app_stays_in_its_start_folder_and_knows_its_workspace(elsewhere, monkeypatch, capsys):
    """`lora-cockpit` used to chdir into its installed files: a relative data path typed in the app was then read
    there ("mydata.jsonl does not exist (relative to /…/checkout)")."""
    from streamlit.web import cli as streamlit_cli

    from lora_cockpit import cli

    seen = {}

    def serve():
        seen.update(cwd=os.getcwd(), argv=list(sys.argv), ws=os.environ[ENV_VAR], start=os.environ[START_ENV])
        return 0

    monkeypatch.setattr(streamlit_cli, "main", serve)
    assert cli.main(["--port", "8599", "--workspace", "ws"]) == 0
    assert seen["cwd"] == str(elsewhere) == seen["start"]
    assert seen["ws"] == str(elsewhere / "ws")
    script = Path(seen["argv"][2])
    assert script.name == "dashboard.py" and (script.parent / "pages").is_dir()
    assert (script.parent / ".streamlit" / "config.toml").is_file()  # Streamlit reads it beside the script
    assert f"(workspace {elsewhere / 'ws'})" in capsys.readouterr().out


def test_a_child_started_from_the_package_folder_goes_back_to_its_starters_folder(elsewhere, tmp_path):
    """Trainers and jobs start in the package's folder (so that `-m core.X` never imports a user's file of the
    same name) and then enter the folder they were started from: a relative path means the same to both."""
    folder = tmp_path / "owned"
    folder.mkdir()
    code = "import os; from core.procs import enter_start_folder; enter_start_folder(); print(os.getcwd())"
    lock = procs.claim(folder)
    try:
        pid = procs.spawn(folder, [sys.executable, "-c", code], lock, cwd=REPO)
    finally:
        os.close(lock)  # the child holds its own copy, as the launcher's does
    deadline = time.time() + 60
    while procs.process_start_time(pid) is not None and time.time() < deadline:
        time.sleep(0.1)
    assert (folder / procs.STDOUT).read_text().strip() == str(elsewhere)
