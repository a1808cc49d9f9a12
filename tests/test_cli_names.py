"""The command speaks as the command (#49 item 5): started as `lora-cockpit`, every tool's usage line and the
hints it prints name `lora-cockpit TOOL`, and `python -m core.TOOL` still names itself; listing is `list` on the
runs, the queue and the Hub, with `ls` accepted on each; a tool's --help description is a whole sentence."""

import sys

import pytest

from core.fmt import PROG_ENV, command, summary
from core.procs import START_ENV
from core.workspace import ENV_VAR
from lora_cockpit.cli import TOOLS
from lora_cockpit.cli import main as cockpit
from tests.cli import in_process

# `lora-cockpit TOOL` runs the tool's __main__ with runpy, in this process where a test imported it already
pytestmark = pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")


@pytest.fixture()
def as_cockpit(monkeypatch, tmp_path):
    """`lora-cockpit ...` called in this process from an empty folder: what it sets in the environment (its name,
    its start folder, the app's workspace) and sys.argv are put back afterwards."""
    for name in (PROG_ENV, START_ENV, ENV_VAR):
        monkeypatch.setenv(name, "")  # recorded now, so that monkeypatch restores the caller's value
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.chdir(tmp_path)
    return lambda *args: in_process(cockpit, *args)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_s_help_names_lora_cockpit_and_says_a_whole_sentence(as_cockpit, tool):
    out = as_cockpit(tool, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: lora-cockpit {tool} "), out.stdout[:200]
    assert "python -m" not in out.stdout, out.stdout
    description = out.stdout.split("\n\n")[1]
    assert description.rstrip().endswith("."), f"{tool}'s description is cut: {description!r}"


def test_demo_help_is_not_cut_mid_sentence(as_cockpit):
    """It was "...and, on request, train it: the SFT": the docstring's first line, not its first sentence."""
    text = " ".join(as_cockpit("demo", "--help").stdout.split("\n\n")[1].split())
    assert text.endswith("or the GRPO run from a warm start."), text


def test_summary_is_the_first_sentence_whatever_its_lines_and_dots():
    doc = """`python -m core.demo`: build it (see core.demo, e.g. the toy) and,
    on request, train it.

    More."""
    assert summary(doc) == "Build it (see core.demo, e.g. the toy) and, on request, train it."
    assert summary("Two. Sentences.") == "Two."


def test_python_m_still_names_itself(monkeypatch):
    from core.runs.__main__ import main as runs_main

    monkeypatch.delenv(PROG_ENV, raising=False)
    assert command("runs") == "python -m core.runs" and command("queue") == "python -m core.runs queue"
    out = in_process(runs_main, "--help")
    assert out.stdout.startswith("usage: python -m core.runs ")


def test_hints_name_the_command_that_was_typed(as_cockpit, tmp_path):
    empty = as_cockpit("queue", "list")
    assert empty.returncode == 0 and "(lora-cockpit queue add run.yaml)" in empty.stdout, empty.stdout
    missing = as_cockpit("queue", "rm", "q9")
    assert missing.returncode == 2 and "`lora-cockpit queue list`" in missing.stderr, missing.stderr
    wrong = as_cockpit("hub", "nope")
    assert wrong.returncode == 2 and "(see lora-cockpit hub --help)" in wrong.stderr, wrong.stderr
    usage = as_cockpit("queue", "add")
    assert usage.returncode == 2 and "usage: lora-cockpit queue add" in usage.stderr, usage.stderr


def test_list_and_ls_both_list_on_the_runs_the_queue_and_the_hub(as_cockpit, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    for tool, words in (("runs", ("no runs in",)), ("queue", ("is empty",)), ("hub", ("holds nothing",))):
        said = {verb: as_cockpit(tool, verb) for verb in ("list", "ls")}
        for verb, out in said.items():
            assert out.returncode == 0, f"{tool} {verb}: {out.stderr}"
            assert all(w in out.stdout for w in words), f"{tool} {verb}: {out.stdout}"
        assert said["list"].stdout == said["ls"].stdout
    # the usage documents one verb: `list`
    for tool in ("runs", "queue", "hub"):
        usage = as_cockpit(tool, "--help").stdout.split("\n\n")[0]
        assert "list" in usage and "ls" not in usage.replace("list", ""), usage
