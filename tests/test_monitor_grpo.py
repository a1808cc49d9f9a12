"""The Monitor's GRPO readers and health rules on files written as trl.GRPOTrainer writes them (issue #34 item 6):
the per-reward-function keys of metrics.jsonl, the sample completions' parquet files (bounded, a broken one never
breaks the reader), the reward rules, and a GRPO run summarised by its reward. No training here: the page tests
(test_page_monitor_grpo.py) read a real run."""

import json
import os

import pandas as pd
import pytest

from core import rundir
from core.monitor.completions import COMPLETIONS, CompletionsReader
from core.monitor.health import HealthChecker
from core.monitor.summary import summarize_run
from core.monitor.tail import RunSeries
from tests.cli import runs


def grpo_line(step: int, match: float = 0.5, reward: float | None = None, **extra) -> dict:
    """One logging step of a GRPO run with two reward functions (match, short), as GRPOTrainer logs it; the total
    reward is match's unless given."""
    return {
        "time": 1000.0 + step,
        "step": step,
        "loss": 1e-9 * (-1) ** step,  # GRPO's loss hovers around 0: no learning curve
        "learning_rate": 1e-5,
        "reward": match if reward is None else reward,
        "reward_std": 0.3,
        "rewards/match/mean": match,
        "rewards/match/std": 0.3,
        "rewards/short/mean": 1.0,
        "rewards/short/std": 0.0,
        "frac_reward_zero_std": 0.2,
        "completions/mean_length": 6.0,
        "completions/max_length": 8.0,
        "completions/clipped_ratio": 0.0,
        **extra,
    }


# ---- metrics.jsonl: the per-function keys ------------------------------------------------------------------------


def test_each_reward_functions_mean_and_std_are_read_with_a_smoothed_twin():
    s = RunSeries.from_records([grpo_line(5, 0.2), grpo_line(10, 0.4, **{"eval_rewards/match/mean": 0.5})])
    assert s.metric("rewards/match/mean")[1].tolist() == [0.2, 0.4]
    assert s.metric("rewards/short/std")[1].tolist() == [0.0, 0.0]
    assert s.metric("eval_rewards/match/mean")[1].tolist() == [0.5]
    assert s.family_names == [
        "rewards/match/mean",
        "rewards/match/std",
        "rewards/short/mean",
        "rewards/short/std",
    ]
    assert len(s.smoothed["rewards/match/mean"]) == 2 and "eval_rewards/match/mean" not in s.smoothed
    before = s.smooth("rewards/match/mean")[1][-1]
    assert s.set_smoothing(
        1.0
    )  # a window of one step: the smoothed curve is recomputed and nears the raw one
    assert abs(s.smooth("rewards/match/mean")[1][-1] - 0.4) < abs(before - 0.4)


def test_an_sft_or_dpo_line_is_not_searched_for_per_function_keys():
    """Only a line with a figure of GRPO's own walks its keys: one that merely looks like a reward key elsewhere is
    left alone (an SFT line takes its fixed fields, and nothing else)."""
    sft = {"time": 1.0, "step": 1, "loss": 2.0, "entropy": 0.5, "rewards/odd/mean": 3.0}
    dpo = {"time": 2.0, "step": 2, "loss": 0.6, "rewards/margins": 0.1, "rewards/odd/mean": 3.0}
    s = RunSeries.from_records([sft, dpo])
    assert "rewards/odd/mean" not in s.metrics and s.family_names == []
    assert s.metric("rewards/margins")[1].tolist() == [0.1]


# ---- the completions' parquet files -------------------------------------------------------------------------------


def completions_file(run_dir, step: int, n: int = 4, **columns) -> None:
    folder = run_dir / COMPLETIONS
    folder.mkdir(parents=True, exist_ok=True)
    table = {
        "step": [step] * n,
        "prompt": [[{"role": "user", "content": f"Uppercase: w{step}-{i}"}] for i in range(n)],
        "completion": [[{"role": "assistant", "content": f"W{step}-{i}"}] for i in range(n)],
        "match": [float(i % 2) for i in range(n)],
        "advantage": [0.5 - (i % 2) for i in range(n)],
        **columns,
    }
    pd.DataFrame(table).to_parquet(folder / f"completions_{step:05d}.parquet")


def test_the_newest_files_are_read_first_and_bounded(tmp_path):
    for step in (5, 10, 15, 20, 100):  # 100 sorts after 20 by its number, not its name's text
        completions_file(tmp_path, step, n=40)
    got = CompletionsReader(tmp_path, files=2, rows=3).read()
    assert got.files == 5 and got.rewards == ["match"] and not got.skipped
    assert [r["step"] for r in got.rows] == [100, 100, 100, 20, 20, 20]
    assert got.rows[0] == {
        "step": 100,
        "prompt": "Uppercase: w100-0",
        "completion": "W100-0",
        "match": 0.0,
        "advantage": 0.5,
    }


def test_a_run_without_completions_has_none_and_a_plain_prompt_reads_as_text(tmp_path):
    assert CompletionsReader(tmp_path).read() is None
    completions_file(tmp_path, 2, n=2, prompt=["Uppercase: a", "Uppercase: b"], completion=["A", "b"])
    assert [(r["prompt"], r["completion"]) for r in CompletionsReader(tmp_path).read().rows] == [
        ("Uppercase: a", "A"),
        ("Uppercase: b", "b"),
    ]


def test_a_reward_that_gave_no_score_is_empty_not_nan(tmp_path):
    completions_file(tmp_path, 2, n=2, fmt=[float("nan"), 1.0])
    rows = CompletionsReader(tmp_path).read().rows
    assert [r["fmt"] for r in rows] == [None, 1.0]


def test_a_half_written_a_fifo_and_a_huge_file_are_named_and_the_rest_still_shows(tmp_path):
    completions_file(tmp_path, 5)
    completions_file(tmp_path, 10)
    folder = tmp_path / COMPLETIONS
    whole = (folder / "completions_00010.parquet").read_bytes()
    (folder / "completions_00015.parquet").write_bytes(whole[: len(whole) // 2])  # TRL mid-write
    os.mkfifo(folder / "completions_00020.parquet")  # never opened for reading: no hang
    (folder / "completions_00025.parquet").write_bytes(b"\0" * 20_000)
    reader = CompletionsReader(tmp_path, files=5, max_bytes=16_000)
    got = reader.read()
    why = {line.split(":")[0]: line for line in got.skipped}
    assert "being written, or damaged" in why["completions_00015.parquet"]
    assert why["completions_00020.parquet"].endswith("not a regular file.")
    assert "20,000 bytes, more than the 16,000" in why["completions_00025.parquet"]
    assert [r["step"] for r in got.rows] == [10] * 4 + [5] * 4
    (folder / "completions_00015.parquet").write_bytes(whole)  # the writer finished: read on the next tick
    assert [r["step"] for r in reader.read().rows][:4] == [10] * 4
    assert not any(s.startswith("completions_00015") for s in reader.read().skipped)


# ---- health rules --------------------------------------------------------------------------------------------------


def warnings_of(records, method="grpo"):
    return {w.code: w for w in HealthChecker().check(RunSeries.from_records(records), method=method)}


def test_a_reward_zero_for_steps_says_it_cannot_be_earned_and_where_to_look():
    found = warnings_of([grpo_line(s, 0.0, reward=0.0) for s in range(5, 35, 5)])
    w = found["reward_zero"]
    assert w.title.startswith("The reward has been 0") and "steps 5-30" in w.detail
    assert "rewards[i].column" in w.fix and "extract" in w.fix
    assert "reward_no_spread" not in found  # the same cause: one warning


def test_one_reward_function_that_never_scores_is_named():
    found = warnings_of([grpo_line(s, 0.0, reward=0.5) for s in range(5, 35, 5)])
    assert found["reward_zero"].title.startswith("Reward function match has been 0")


def test_a_zero_reward_early_or_recovering_is_no_warning():
    assert "reward_zero" not in warnings_of([grpo_line(s, 0.0, reward=0.0) for s in (5, 10, 15)])  # too early
    recovering = [grpo_line(s, 0.0, reward=0.0) for s in range(5, 35, 5)] + [grpo_line(35, 0.25)]
    assert "reward_zero" not in warnings_of(recovering)


def test_groups_that_all_score_alike_say_there_is_no_learning_signal():
    found = warnings_of([grpo_line(s, 0.7, frac_reward_zero_std=1.0) for s in (2, 4, 6)])
    w = found["reward_no_spread"]
    assert "100%" in w.detail and "training.num_generations" in w.fix and "training.temperature" in w.fix
    assert "reward_no_spread" not in warnings_of(
        [grpo_line(s, 0.7, frac_reward_zero_std=0.5) for s in (2, 4, 6)]
    )


def test_completions_always_cut_at_the_limit_say_raise_it():
    w = warnings_of([grpo_line(s, **{"completions/clipped_ratio": 1.0}) for s in (2, 4, 6)])[
        "completions_clipped"
    ]
    assert "training.max_completion_length" in w.fix and "mean length 6 tokens" in w.detail


def test_grpos_loss_near_zero_is_neither_flat_nor_spiking_but_an_sfts_is_still_judged():
    records = [grpo_line(s, 0.5, loss=(1e-9 if s % 7 else 0.05)) for s in range(1, 260)]
    assert not {"loss_flat", "loss_spike"} & set(warnings_of(records))
    sft = [{"time": float(s), "step": s, "loss": 2.0} for s in range(1, 260)]
    assert "loss_flat" in warnings_of(sft, method="sft")


# ---- a GRPO run summarised by its reward -------------------------------------------------------------------------


@pytest.fixture()
def grpo_run(tmp_path):
    run_dir = tmp_path / "runs" / "grpo-run"
    run_dir.mkdir(parents=True)
    (run_dir / rundir.CONFIG).write_text("method: grpo\nmodel: {path: m}\ndata: {path: d.jsonl}\n")
    lines = [grpo_line(5, 0.25), grpo_line(10, 0.75)]
    (run_dir / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / rundir.STATUS).write_text(json.dumps({"state": "finished", "step": 10, "max_steps": 10}))
    return run_dir


def test_the_runs_summary_and_list_give_a_grpo_runs_reward(grpo_run):
    s = summarize_run(grpo_run)
    assert s.method == "grpo" and s.reward_source == "train"
    assert s.headline == [{"key": "reward", "label": "reward", "value": 0.75, "format": ".3f"}]
    assert s.reward_accuracy is None and s.reward_margin is None
    listed = runs(grpo_run.parent.parent, "list")
    assert listed.returncode == 0, listed.stderr
    line = next(x for x in listed.stdout.splitlines() if x.startswith("grpo-run"))
    assert "grpo" in line and line.rstrip().endswith("reward 0.75"), line
    (obj,) = json.loads(runs(grpo_run.parent.parent, "list", "--json").stdout)
    assert obj["headline"] == {"reward": 0.75} and obj["headline_source"] == "train"
