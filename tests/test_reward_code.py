"""A GRPO run's own reward function before launch (issue #51 section 3, core.recipe.reward_code): one rule -- the
file defines its function at its top level -- said in one sentence naming the editor's row, whether the file is
read (nothing runs), imported in a child process (the app never runs it) or imported in the trainer."""

import json
import sys
from pathlib import Path

import pytest

from core.recipe import reward_code
from core.recipe.config import validate_config
from core.recipe.prompts import run_prompt_preflight


@pytest.fixture()
def own_file(tmp_path) -> Path:
    """A reward file whose top level leaves a mark when it runs, and defines only `reward`."""
    path = tmp_path / "myreward.py"
    path.write_text(
        "from pathlib import Path\n"
        "Path(__file__).with_suffix('.ran').write_text('imported')\n"
        "def reward(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n"
    )
    return path


def _spec(path: Path, function: str, trust: bool) -> dict:
    return {"type": "python", "path": str(path), "function": function, "trust_code": trust}


def test_unticked_the_file_is_read_not_run_and_a_missing_function_is_named(own_file):
    said = (
        f"Reward 3: {own_file} has no top-level function 'nope' (it defines reward): set its function to one of "
        "them, or define nope there."
    )
    assert reward_code.code_problem(_spec(own_file, "nope", False), 2) == ("error", said)
    assert reward_code.code_problem(_spec(own_file, "reward", False), 2) is None
    assert not own_file.with_suffix(".ran").exists()  # nothing of it ran
    broken = own_file.with_name("broken.py")
    broken.write_text("def reward(:\n")
    assert reward_code.code_problem(_spec(broken, "reward", False), 0) == (
        "error",
        f"Reward 1: {broken} is not valid Python (line 1: invalid syntax): fix that line.",
    )
    # a name bound otherwise than by def is not called missing by the reading (the import decides)
    alias = own_file.with_name("alias.py")
    alias.write_text("from math import sqrt as score\n")
    assert reward_code.static_problem(_spec(alias, "score", False), 0) is None


def test_ticked_it_is_imported_in_a_child_and_says_what_the_trainer_would(own_file):
    said = reward_code.code_problem(_spec(own_file, "nope", True), 2)
    assert own_file.with_suffix(".ran").read_text() == "imported"  # it ran, in another process than this one
    assert "lora_cockpit_reward_2" not in sys.modules
    with pytest.raises(reward_code.RewardCodeError) as trainer:  # the trainer's own import: the same sentence
        reward_code.load_function(_spec(own_file, "nope", True), 2)
    assert said == ("error", str(trainer.value))
    assert reward_code.code_problem(_spec(own_file, "reward", True), 2) is None
    exits = own_file.with_name("exits.py")
    exits.write_text("raise SystemExit(3)\n")
    level, text = reward_code.code_problem(_spec(exits, "reward", True), 0)
    assert level == "error" and text.startswith(
        f"Reward 1: importing {exits} ended its process (exit code 3;"
    )


def test_the_trainers_preflight_names_it_once_with_no_fix_of_fix(own_file, tiny_llama, tmp_path):
    """The smoke test read 'rewards[0].function: ... has no function 'nope' ... Fix: Fix rewards[2] (python) before
    launching.' for the editor's Reward 3."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}", "answer": w}) + "\n" for w in ("A", "B", "C")))
    cfg = validate_config(
        {
            "method": "grpo",
            "model": {"path": str(tiny_llama)},
            "data": {"path": str(data)},
            "rewards": [
                {"type": "match", "column": "answer"},
                {"type": "format", "pattern": "[A-Z]+"},
                _spec(own_file, "nope", True),
            ],
            "training": {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8},
        }
    )
    for in_trainer in (
        False,
        True,
    ):  # the app's preflight (a child imports it) and the trainer's (it imports)
        (found,) = run_prompt_preflight(cfg, in_trainer=in_trainer)
        assert str(found) == (
            f"ERROR [reward] Reward 3: {own_file} has no top-level function 'nope' (it defines reward): set its "
            "function to one of them, or define nope there."
        )
