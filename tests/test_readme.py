"""The README stays a newcomer's page and the docs stay true: the set-up commands CI and the fresh-clone check read
are in the README, it stays short, every tool it names is documented in docs/cli.md flag by flag, every path the
pages cite exists, and the troubleshooting page is what the diagnosis rules generate."""

import importlib
import re
import signal

import pytest

from core.monitor.diagnose import BLOCK_END, BLOCK_START, TROUBLESHOOTING_DOC, troubleshooting_markdown
from core.monitor.diagnose import main as diagnose_main
from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"

# Each documented CLI: its module (what `python -m` runs) and the subcommands whose flags docs/cli.md lists.
CLIS = {
    "core.hub": ("core.hub.__main__", [[], ["info"], ["download"], ["list"], ["rm"]]),
    "core.estimate": ("core.estimate.__main__", [[]]),
    "core.demo": ("core.demo.__main__", [[]]),
    "core.preflight": ("core.preflight", [[]]),
    "core.train": ("core.train.__main__", [[]]),
    "core.merge": ("core.merge.__main__", [[]]),
    "core.eval": ("core.eval.__main__", [[]]),
    "core.gguf": ("core.gguf.__main__", [[]]),
    "core.runs": (
        "core.runs.__main__",
        [[], *([c] for c in ("list", "show", "launch", "stop", "resume", "delete", "export"))]
        + [["queue", c] for c in ("add", "list", "rm", "move", "resume")],
    ),
    "core.diagnose": ("core.diagnose", [[]]),
    "core.doctor": ("core.doctor", [[]]),
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# A path a page cites in backticks or links to: it must exist in the repository (issue #38: citations of design
# notes that were not part of it)
CITED = re.compile(r"(?:`|\]\()((?:docs|core|tests|benchmarks|pages|ui|\.ci)/[\w./-]*[\w/])")


def _pages() -> list:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_readme_shows_the_two_setup_commands():
    lines = README.read_text().splitlines()
    assert "pip install -r requirements.txt && lora-cockpit" in lines
    assert "pip install -r requirements.txt && pytest -n 2" in lines


def test_readme_is_a_newcomers_page():
    """What it is, the two commands, the tour, where to go next: the reference lives in docs/ (#38 item 6)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference material to docs/"


def test_every_path_the_readme_and_docs_cite_exists():
    missing = [
        f"{page.relative_to(REPO)}: {path}"
        for page in _pages()
        for path in CITED.findall(page.read_text())
        if not (REPO / path).exists()
    ]
    assert missing == []


def _help(module: str, sub: list[str], capsys) -> str:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # the trainer's CLI installs its stop handler before it parses: not in this process
        with pytest.raises(SystemExit) as done:
            importlib.import_module(module).main([*sub, "--help"])
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_tool_is_in_the_readme_and_every_flag_in_docs_cli(capsys):
    """The README names each tool (the tools table); docs/cli.md has each flag of each tool and subcommand, read
    from the tools' own --help, so a flag added to a parser and not to the page fails here."""
    readme, cli = README.read_text(), (DOCS / "cli.md").read_text()
    # `--[no-]x` on the page documents both --x and --no-x
    page = "\n".join((cli, cli.replace("--[no-]", "--"), cli.replace("--[no-]", "--no-")))
    missing = []
    for tool, (module, subs) in CLIS.items():
        assert f"python -m {tool}" in readme, f"README does not name {tool}"
        assert f"lora-cockpit {tool.removeprefix('core.')}" in readme, (
            f"README does not name lora-cockpit's {tool}"
        )
        assert f"python -m {tool}" in cli, f"docs/cli.md does not name {tool}"
        for sub in subs:
            flags = set(FLAG.findall(_help(module, sub, capsys))) - {"--help"}
            missing += [
                f"{tool} {' '.join(sub)} {flag}".replace("  ", " ")
                for flag in sorted(flags)
                if flag not in page
            ]
    assert missing == [], "flags missing from docs/cli.md"


def test_the_troubleshooting_page_is_generated_from_the_diagnosis_rules():
    text = (REPO / TROUBLESHOOTING_DOC).read_text()
    block = text[text.index(BLOCK_START) + len(BLOCK_START) : text.index(BLOCK_END)]
    assert block.strip() == troubleshooting_markdown().strip(), (
        f"run: python -m core.diagnose --readme {TROUBLESHOOTING_DOC}"
    )


def test_diagnose_regenerates_the_block_of_the_file_it_is_given(tmp_path, capsys):
    """`--readme FILE` works on whichever file holds the block, and says where the block lives when FILE has none."""
    page = tmp_path / "troubleshooting.md"
    page.write_text(f"# Mine\n\n{BLOCK_START}\nstale rules\n{BLOCK_END}\nafter\n")
    assert diagnose_main(["--readme", str(page)]) == 0 and capsys.readouterr().out.strip() == "updated"
    text = page.read_text()
    assert (
        text.startswith("# Mine\n") and text.endswith(f"{BLOCK_END}\nafter\n") and "stale rules" not in text
    )
    assert troubleshooting_markdown() in text
    assert diagnose_main(["--readme", str(page)]) == 0 and capsys.readouterr().out.strip() == "up to date"
    plain = tmp_path / "README.md"
    plain.write_text("# no block here\n")
    assert diagnose_main(["--readme", str(plain)]) == 2
    assert TROUBLESHOOTING_DOC in capsys.readouterr().err and plain.read_text() == "# no block here\n"
