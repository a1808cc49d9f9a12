"""A GRPO run's own reward function (a `type: python` reward): whether its file gives it, and loading it.

One rule: the file defines, at its top level, a callable named after the reward's `function`. It is checked three
ways, cheapest first: by reading the file (static_problem: it parses and binds that name at its top level; nothing
runs), by importing it in a child process (import_problem: its top-level code runs, never in the caller's process,
so the app never runs it), and by importing it where it runs, the trainer (load_function). Each says a problem in
the same words, naming the reward as the Train page's editor does ("Reward 3").

`python -m core.recipe.reward_code PATH FUNCTION INDEX` is import_problem's child.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from core.files import read_bounded
from core.fmt import error_line

MAX_SOURCE_BYTES = 16 << 20  # a reward file is a few kB; this bounds what ast.parse reads
IMPORT_TIMEOUT_S = 120.0  # a file that imports torch and transformers takes ~10 s on a slow CPU
_REPLY = "lora-cockpit-reward-check: "  # the child's answer line (the file's own prints go to stdout too)
REPO_ROOT = Path(__file__).resolve().parents[2]  # where the trainer runs: a child imports from where it would


class RewardError(RuntimeError):
    """A reward function failed while the run trained; the message names it, the row and the error."""


class RewardCodeError(RewardError):
    """The user's file does not give its reward function; the message says what, where and how to fix it."""


def label(index: int) -> str:
    """A reward as the Train page's editor names it (its place in `rewards`, from 1)."""
    return f"Reward {index + 1}"


def _missing(index: int, path: Path, function: str, found: list[str]) -> str:
    where = f"{label(index)}: {path} has no top-level function {function!r}"
    if not found:
        return f"{where} (it defines none): define {function} in that file."
    return f"{where} (it defines {', '.join(found)}): set its function to one of them, or define {function} there."


def static_problem(spec: dict, index: int) -> str | None:
    """None when the file parses and binds `function` at its top level (or may, through `import *`); else one
    sentence. Reads the file and runs none of it."""
    path, function = Path(spec["path"]).expanduser().resolve(), spec["function"]
    try:
        tree = ast.parse(read_bounded(path, MAX_SOURCE_BYTES), filename=str(path))
    except SyntaxError as exc:
        return f"{label(index)}: {path} is not valid Python (line {exc.lineno}: {exc.msg}): fix that line."
    except (OSError, ValueError) as exc:  # unreadable, too large, not a regular file, a NUL byte
        return (
            f"{label(index)}: {path} cannot be read as Python ({error_line(exc)}): give the .py file itself."
        )
    bound, functions, star = set(), [], False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            functions += [node.name] if not isinstance(node, ast.ClassDef) else []
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            star = star or any(a.name == "*" for a in node.names)
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:  # assignments, and names bound under a top-level if / try / with
            bound.update(
                n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            )
            bound.update(
                n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    if function in bound or star:
        return None
    return _missing(index, path, function, [f for f in functions if not f.startswith("_")])


def load_function(spec: dict, index: int):
    """The user's function from its file, imported in this process (it runs the file's top-level code: the
    trainer's, or import_problem's child). RewardCodeError when the file does not give it."""
    path = Path(spec["path"]).expanduser().resolve()
    try:
        module_spec = importlib.util.spec_from_file_location(f"lora_cockpit_reward_{index}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardCodeError(
            f"{label(index)}: importing {path} failed ({error_line(exc)}): fix the file so that it imports."
        ) from None
    function = getattr(module, spec["function"], None)
    if not callable(function):
        # the functions the file itself defines, as the reading lists them (not what it imports)
        found = [
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
        ]
        raise RewardCodeError(_missing(index, path, spec["function"], found))
    return function


def import_problem(spec: dict, index: int, timeout: float = IMPORT_TIMEOUT_S) -> tuple[str, str] | None:
    """None when importing the file in a child process gives the function; else (level, one sentence): "error",
    or "warning" when the import did not finish in `timeout` (the trainer will try; a slow file is not a wrong
    one). Cached per file version: the Train page asks again on every rerun."""
    path = Path(spec["path"]).expanduser().resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        return (
            "error",
            f"{label(index)}: {path} cannot be read ({error_line(exc)}): give the .py file itself.",
        )
    return _import_in_child(str(path), spec["function"], index, stat.st_mtime_ns, stat.st_size, timeout)


@functools.lru_cache(maxsize=32)
def _import_in_child(path: str, function: str, index: int, _mtime: int, _size: int, timeout: float):
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "core.recipe.reward_code", path, function, str(index)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return "warning", (
            f"{label(index)}: importing {path} took longer than {timeout:.0f} s, so preflight could not check it "
            "(the trainer will): keep the file's top level to imports and definitions."
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_REPLY):
            problem = json.loads(line[len(_REPLY) :])
            return None if problem is None else ("error", problem)
    last = (proc.stderr.strip().splitlines() or ["it printed nothing to stderr"])[-1]
    return "error", (
        f"{label(index)}: importing {path} ended its process (exit code {proc.returncode}; {last}): remove what "
        "exits or crashes at the file's top level."
    )


def code_problem(spec: dict, index: int) -> tuple[str, str] | None:
    """Preflight's check of one python reward outside the trainer: imported in a child process when its
    trust_code is ticked (the import is the truth: a name bound by `globals()` or a module __getattr__ is found),
    else read without running it."""
    if spec.get("trust_code") is True:
        return import_problem(spec, index)
    problem = static_problem(spec, index)
    return None if problem is None else ("error", problem)


def main(argv: list[str]) -> int:
    path, function, index = argv
    try:
        load_function({"path": path, "function": function}, int(index))
        problem = None
    except RewardCodeError as exc:
        problem = str(exc)
    sys.stdout.flush()
    print(_REPLY + json.dumps(problem), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main(sys.argv[1:]))
