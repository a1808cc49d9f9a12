"""Evaluating a GRPO run (issue #34 item 7): greedy answers of the base and of the tuned model to held-out prompts,
scored by the run's own reward functions (weighted as it trained) and by exact match, on the CLI and the Evaluate
page. One real GRPO run shared by the module (the tiny model, 4 steps, ~10 s), evaluated once by the CLI."""

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core import rundir
from core.eval.rewards import score_answers
from core.recipe.rewards import length_score
from tests.test_eval import eval_cli
from tests.test_page_monitor_grpo import grpo_config, write_prompts

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "evaluate.py")
HELDOUT = [("pen", "PEN"), ("ink", "INK"), ("owl", "OWL"), ("fig", "FIG")]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_llama):
    """(run dir, held-out prompts file, the CLI's completed process): the run trained in this process, evaluated by
    `python -m core.eval` as a user runs it."""
    from core.runs.launcher import create_run
    from core.train.run import StopFlag, run_training

    ws = tmp_path_factory.mktemp("ws_eval_grpo")
    cfg = grpo_config(tiny_llama, write_prompts(ws / "prompts.jsonl"))
    cfg["training"].update(max_steps=4, reward_weights=[2.0, 1.0])
    run_dir = create_run(ws, "grpo-eval", cfg)
    run_training(run_dir / rundir.CONFIG, run_dir, stop=StopFlag())
    heldout = ws / "heldout.jsonl"
    heldout.write_text(
        "".join(json.dumps({"prompt": f"Uppercase: {w}", "answer": a}) + "\n" for w, a in HELDOUT)
    )
    return run_dir, heldout, eval_cli("--run", run_dir, "--data", heldout, "--name", "held")


@pytest.mark.slow
def test_the_cli_scores_base_and_tuned_by_each_reward_next_to_exact_match(evaluated, tiny_llama):
    from transformers import AutoTokenizer

    run_dir, _, done = evaluated
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("eval: ")]
    assert [line.split(" -> ")[0].rsplit(" ", 1)[0] for line in said] == [
        "eval: mean reward",
        "eval: exact match",
        "eval: reward match",
        "eval: reward short",
    ]
    assert said[0].endswith("(weighted mean: match 2, short 1)")
    rows = [json.loads(line) for line in (run_dir / "eval" / "held" / "rows.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["reference"]) for r in rows] == [(f"Uppercase: {w}", a) for w, a in HELDOUT]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    for r in rows:
        for side in ("base", "tuned"):
            answer = r[f"{side}_answer"]
            assert r[f"{side}_match"] == float(answer.strip() == r["reference"]) == r[f"{side}_exact_match"]
            tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
            assert r[f"{side}_short"] == length_score(tokens, {"max": 3})  # in tokens, as TRL counts them
            assert r[f"{side}_reward"] == pytest.approx((2 * r[f"{side}_match"] + r[f"{side}_short"]) / 3)
        assert r["change"] == pytest.approx(r["tuned_reward"] - r["base_reward"])
    summary = json.loads((run_dir / "eval" / "held" / "summary.json").read_text())["summary"]
    assert summary["reward_short"]["tuned"] == pytest.approx(sum(r["tuned_short"] for r in rows) / len(rows))
    settings = json.loads((run_dir / "eval" / "held" / "settings.json").read_text())
    assert (
        settings["kind"] == "rewards" and settings["max_new_tokens"] == 4
    )  # the run's max_completion_length


@pytest.mark.slow
def test_held_out_input_that_cannot_be_scored_is_one_sentence(evaluated, tmp_path):
    run_dir, _, _ = evaluated
    no_prompts = tmp_path / "qa.jsonl"
    no_prompts.write_text(json.dumps({"question": "Uppercase: a", "answer": "A"}) + "\n")
    done = eval_cli("--run", run_dir, "--data", no_prompts)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("error: data: 1 row(s) have no prompt column"), done.stderr
    done = eval_cli("--run", run_dir)  # the run held nothing out
    assert done.returncode == 2 and "data.eval_split is 0" in done.stderr and "--data FILE" in done.stderr


@pytest.mark.slow
def test_the_evaluate_page_shows_each_reward_base_against_tuned(evaluated):
    run_dir, _, done = evaluated
    assert done.returncode == 0, done.stderr
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.session_state["workspace"] = str(run_dir.parent.parent)
    at.session_state["eval_run"] = str(run_dir)
    at.run()
    assert not at.exception, at.exception
    assert any("reward functions" in c.value and "exact match" in c.value for c in at.caption)
    figures = at.dataframe[0].value.set_index("metric")
    assert list(figures.index) == ["mean reward", "exact match", "reward match", "reward short"]
    summary = json.loads((run_dir / "eval" / "held" / "summary.json").read_text())["summary"]
    assert (
        figures.loc["reward short", "tuned"] == f"{summary['reward_short']['tuned']:.4g}"
    )  # a number, not a %
    assert figures.loc["exact match", "tuned"].endswith("%")


def test_scores_are_weighted_over_the_functions_that_gave_one(tmp_path):
    """A reward that returns None for a completion (TRL: no score) is left out of that completion's weighted
    mean, not counted as 0; a conversational prompt's completion reaches the rewards as an assistant message."""
    own = tmp_path / "own.py"
    own.write_text(
        "def reward(prompts, completions, **kw):\n"
        "    return [None if c[0]['content'] == 'B' else 0.5 for c in completions]\n"
    )
    specs = [
        {"type": "match", "column": "answer"},
        {"type": "python", "path": str(own), "function": "reward", "trust_code": True},
    ]
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": q.upper()} for q in ("a", "b")]
    a, b = score_answers(rows, ["A", "B"], specs, [1.0, 3.0], allow_code=True)
    assert a == {
        "match": 1.0,
        "python": 0.5,
        "reward": pytest.approx((1.0 + 3 * 0.5) / 4),
        "exact_match": 1.0,
    }
    assert b == {"match": 1.0, "python": None, "reward": 1.0, "exact_match": 1.0}
