"""The build's one step beyond pyproject.toml: the app's own files (dashboard.py, pages/, .streamlit/config.toml)
go into the package as lora_cockpit/app/, package data that lora_cockpit.cli.app_dir finds with importlib.resources
wherever the package lands (a venv, `pip install --user`, `--target`, `--prefix`, pipx, `uv tool install`). In the
repository they stay where the product's layout has them (pages/ a top-level folder, `streamlit run dashboard.py`);
an editable install runs them from the checkout and copies nothing."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
APP_FILES = ("dashboard.py", "pages/*.py", ".streamlit/config.toml")
APP_PACKAGE = Path("lora_cockpit") / "app"


def app_files() -> list[Path]:
    """The app's files, relative to the repository."""
    return sorted(p.relative_to(ROOT) for pattern in APP_FILES for p in ROOT.glob(pattern) if p.is_file())


class BuildPyWithApp(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # the checkout itself is the app
            return
        for name in app_files():
            target = Path(self.build_lib) / APP_PACKAGE / name
            self.mkpath(str(target.parent))
            self.copy_file(str(ROOT / name), str(target))

    def get_source_files(self):
        # an sdist carries them too, so a wheel built from it has the app
        return [*super().get_source_files(), *map(str, app_files())]


setup(cmdclass={"build_py": BuildPyWithApp})
