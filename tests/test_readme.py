"""The README stays true: its troubleshooting block is what the diagnosis rules generate, and the set-up
commands CI and the fresh-clone check rely on are there."""

from core.monitor.diagnose import README_END, README_START, troubleshooting_markdown
from tests.conftest import REPO


def test_readme_troubleshooting_is_generated_from_the_diagnosis_rules():
    text = (REPO / "README.md").read_text()
    block = text[text.index(README_START) + len(README_START) : text.index(README_END)]
    assert block.strip() == troubleshooting_markdown().strip(), (
        "run: python -m core.diagnose --readme README.md"
    )


def test_readme_shows_the_two_setup_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert "pip install -r requirements.txt && streamlit run dashboard.py" in lines
    assert "pip install -r requirements.txt && pytest -n 2" in lines
