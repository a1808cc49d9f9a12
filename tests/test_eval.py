"""core.eval (issue #24): the base against the tuned model on held-out rows, on one small trained demo run shared
by the module (the session's demo build, conftest.py, and a 40-step run with samples at each evaluation)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.eval import scores
from tests.cli import REPO, train

slow = pytest.mark.slow


def eval_cli(*args, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.eval", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def eval_main(*args) -> subprocess.CompletedProcess:
    """core.eval's main(argv) in this process (tests/cli.py: in_process), for error paths: no new interpreter.
    test_missing_run_is_one_sentence keeps the real `python -m core.eval` for its exit status and sentence."""
    from core.eval.cli import main
    from tests.cli import in_process

    return in_process(main, *args)


def lines_of(out: str) -> dict[str, str]:
    """{"exact match": "0% -> 100%", ...} from the `eval: <metric> B -> A` lines."""
    found = {}
    for line in out.splitlines():
        if line.startswith("eval: ") and " -> " in line:
            head, after = line[len("eval: ") :].split(" -> ")
            metric, before = head.rsplit(" ", 1)
            found[metric] = f"{before} -> {after}"
    return found


# ---- scores: plain functions ----------------------------------------------------------------------------------


def test_exact_match_is_strict_about_case_like_the_demo():
    assert scores.exact_match(" HELLO\n", "HELLO") == 1.0
    assert scores.exact_match("hello", "HELLO") == 0.0


def test_token_f1_counts_overlapping_words():
    assert scores.token_f1("the cat sat", "the cat sat") == 1.0
    assert scores.token_f1("a b", "c d") == 0.0
    assert scores.token_f1("the cat", "the cat sat on") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert scores.token_f1("", "") == 1.0 and scores.token_f1("", "x") == 0.0


def test_rouge_l_and_chrf_come_from_their_libraries():
    assert scores.rouge_l("the cat sat", "the cat sat") == pytest.approx(1.0)
    assert 0.0 < scores.rouge_l("the cat", "the cat sat on the mat") < 1.0
    assert scores.chrf("HELLO", "HELLO") == pytest.approx(1.0)
    assert scores.chrf("xyz", "HELLO") < 0.1


@pytest.mark.parametrize(
    "answer, reference",
    [("lpjwx", "LPJWX"), ("Hello, world", "hello world"), ("привет мир", "ПРИВЕТ МИР")],
)
def test_every_score_reads_the_answer_as_written(answer, reference):
    """One normalization rule: a base that answers in the wrong case (or punctuation) is wrong by every score;
    rouge-score's own tokenizer lower-cased ASCII words, so ROUGE-L alone called 'lpjwx' right."""
    row = scores.score(answer, reference)
    assert row["exact_match"] == 0.0 and row["token_f1"] < 1.0 and row["rouge_l"] < 1.0, row
    assert row["rouge_l"] == pytest.approx(row["token_f1"])  # one token list: LCS = overlap in order here
    assert scores.score(reference, reference)["rouge_l"] == 1.0  # and non-ASCII text scores, right or wrong


def test_summary_lines_read_base_then_tuned():
    rows = [
        {
            "base_exact_match": 0.0,
            "tuned_exact_match": 1.0,
            "n_answer_tokens": 2,
            "base_loss_sum": 4.0,
            "tuned_loss_sum": 0.2,
        },
        {
            "base_exact_match": 0.0,
            "tuned_exact_match": 0.0,
            "n_answer_tokens": 2,
            "base_loss_sum": 4.0,
            "tuned_loss_sum": 0.2,
        },
    ]
    summary = scores.summarize(rows)
    lines = scores.summary_lines(summary)
    assert "eval: exact match 0% -> 50%" in lines
    assert summary["answer_loss"] == pytest.approx({"base": 2.0, "tuned": 0.1})
    assert any(line.startswith("eval: perplexity 7.389 -> 1.105") for line in lines), lines
    assert scores.fmt_value(0.975, "pct") == "97.5%" and scores.fmt_value(1.0, "pct") == "100%"


# ---- the demo run ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, demo_built):
    """(demo folder, a finished 40-step demo run with training.eval_samples: 3, evaluated every 20 steps), on a
    copy of the session's 200-step demo build (conftest.py: demo_built)."""
    from core.demo.build import demo_config

    root = tmp_path_factory.mktemp("eval_demo")
    demo = demo_built.copy(root / "demo")
    cfg = demo_config(out=demo)
    cfg["training"].update(max_steps=40, eval_steps=20, save_steps=20, eval_samples=3)
    run_dir = root / "runs" / "demo-eval"
    done = train(cfg, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return demo, run_dir


@slow
def test_cli_prints_the_demos_own_heldout_figure_on_the_same_rows(demo_run):
    from core.demo.build import heldout_accuracy

    demo, run_dir = demo_run
    out = eval_cli("--run", run_dir, "--data", demo / "heldout.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = heldout_accuracy(demo), heldout_accuracy(demo, run_dir / "adapter")
    got = lines_of(out.stdout)
    assert got["exact match"] == f"{scores.fmt_value(before, 'pct')} -> {scores.fmt_value(after, 'pct')}", (
        out.stdout
    )
    assert after > before  # the run learned something the base could not do
    for metric in ("token F1", "ROUGE-L", "chrF", "answer loss", "perplexity"):
        assert metric in got, out.stdout
    folder = run_dir / "eval" / "heldout"
    settings = json.loads((folder / "settings.json").read_text())
    assert settings["data"] == str((demo / "heldout.jsonl").resolve()) and settings["tuned"].endswith(
        "adapter"
    )
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 100
    assert {"prompt", "reference", "base_answer", "tuned_answer", "change"} <= set(rows[0])
    assert sum(r["tuned_exact_match"] for r in rows) / 100 == pytest.approx(after)


@slow
def test_default_is_the_runs_own_eval_split_and_a_second_ask_is_read_back(demo_run):
    from transformers import AutoTokenizer

    from core.eval.run import evaluate
    from core.recipe.config import load_config
    from core.recipe.data import prepare_datasets

    _, run_dir = demo_run
    first = evaluate(run_dir)
    assert not first.reused and first.folder.name == "eval-split"
    # the very rows the trainer held out: prompt + answer tokens are its eval rows' tokens
    cfg = load_config(run_dir / "config.yaml")
    tok = AutoTokenizer.from_pretrained(cfg["model"]["path"])
    _, held = prepare_datasets(cfg, tok)
    assert first.summary["rows"] == len(held)
    from core.eval.heldout import split_rows

    mine = sorted(tuple(r.prompt_ids + r.answer_ids) for r in split_rows(cfg, tok))
    assert mine == sorted(tuple(ids) for ids in held["input_ids"])
    again = evaluate(run_dir)
    assert again.reused and again.lines == first.lines


@slow
def test_samples_while_training_show_the_answer_and_the_one_before(demo_run):
    from core.rundir import latest_samples

    _, run_dir = demo_run
    recs = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in recs}) == [20, 40]
    assert len(recs) == 6  # 3 prompts at each of the two evaluations
    latest = latest_samples(run_dir)
    assert [s["i"] for s in latest] == [0, 1, 2]
    assert all(s["step"] == 40 and s["previous_step"] == 20 for s in latest)
    assert all(s["reference"] and s["reference"].isupper() for s in latest), latest


@slow
def test_eval_runs_as_a_job_that_a_page_can_follow(demo_run, workspace):
    from core import jobs

    demo, run_dir = demo_run
    folder = jobs.start(
        workspace,
        "eval",
        {"run": str(run_dir), "data": str(demo / "heldout.jsonl"), "limit": 10, "name": "job-ten"},
        key=str(run_dir),
    )
    deadline = time.time() + 300
    view = jobs.read(folder)
    while not view.done and time.time() < deadline:
        time.sleep(0.5)
        view = jobs.read(folder)
    assert view.state == "finished", view.error
    assert any(line.startswith("eval: exact match") for line in view.result["lines"])
    assert Path(view.result["folder"]) == run_dir / "eval" / "job-ten"
    assert jobs.latest(workspace, "eval", key=str(run_dir)).path == folder


# ---- bad input: one sentence, exit 2 ----------------------------------------------------------------------------


def _one_sentence(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.stdout, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    err = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(err) == 1, out.stderr
    return err[0]


def test_missing_run_is_one_sentence(tmp_path):
    assert "is not a run folder" in _one_sentence(eval_cli("--run", tmp_path / "nope"))


@slow
def test_bad_inputs_are_one_sentence(demo_run, tmp_path, tiny_llama):
    demo, run_dir = demo_run
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty.jsonl" in _one_sentence(eval_main("--run", run_dir, "--data", empty))
    missing = _one_sentence(eval_main("--run", run_dir, "--data", tmp_path / "missing.jsonl"))
    assert "does not exist" in missing
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "just words"}) + "\n")
    assert "questions with reference answers" in _one_sentence(eval_main("--run", run_dir, "--data", text))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question": "Uppercase: " + "abcde " * 20, "answer": "X"}) + "\n")
    assert "longer than the model's 64 positions" in _one_sentence(
        eval_main("--run", run_dir, "--data", long)
    )
    other = _one_sentence(eval_main("--run", run_dir, "--base", tiny_llama, "--data", demo / "heldout.jsonl"))
    assert "base it was trained on" in other, other


@slow
def test_a_run_still_training_is_evaluated_at_its_newest_checkpoint(demo_run, tmp_path):
    import shutil

    from core import procs, rundir
    from core.eval.heldout import EvalError
    from core.eval.target import resolve

    _, run_dir = demo_run
    live = tmp_path / "live"
    shutil.copytree(run_dir, live, ignore=shutil.ignore_patterns("eval", "lock", "pid"))
    shutil.rmtree(live / "adapter")
    rundir.write_status(live, state="running")
    fd = procs.claim(live)  # this process plays the trainer: the run is alive
    try:
        target = resolve(live)
        assert target.what == "checkpoint-40" and "still training" in target.note
        shutil.rmtree(live / "checkpoints")
        with pytest.raises(EvalError, match="still training and has saved no checkpoint"):
            resolve(live)
    finally:
        procs.disown(live, fd)


@slow
@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_preference_runs_are_scored_on_their_heldout_rows(demo_run, method, tmp_path):
    from core.demo.prefs import PREFERENCE_DEMOS

    demo, _ = demo_run
    cfg = PREFERENCE_DEMOS[method](demo, demo / "base")
    cfg["training"].update(max_steps=10, eval_steps=10, save_steps=10, eval_samples=2)
    run_dir = tmp_path / f"{method}-run"
    done = train(cfg, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    out = eval_cli("--run", run_dir, "--limit", 16)
    assert out.returncode == 0, out.stderr[-3000:]
    got = lines_of(out.stdout)
    assert "greedy answer in the preferred style" in got, out.stdout
    assert ("preference accuracy" in got) == (method == "dpo"), out.stdout  # likelihood accuracy needs pairs
    assert "eval: reward accuracy" in out.stdout, out.stdout
    summary = json.loads((run_dir / "eval" / "eval-split" / "summary.json").read_text())["summary"]
    assert summary["reward_margin"] > 0, summary  # ten steps already reward the preferred answers more
    rows = [
        json.loads(line) for line in (run_dir / "eval" / "eval-split" / "rows.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 16
    assert all("base_answer" in r and "tuned_answer" in r for r in rows)
    assert all(("reward_margin" if method == "dpo" else "reward") in r for r in rows)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["i"] for s in samples] == [0, 1] and samples[0]["reference"], samples


# ---- the pages ---------------------------------------------------------------------------------------------


def _page(path: str, workspace: Path, **state):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(REPO / path), default_timeout=120)
    at.session_state["workspace"] = str(workspace)
    for key, value in state.items():
        at.session_state[key] = value
    at.run()
    assert not at.exception, at.exception
    return at


@slow
def test_pages_show_stored_evaluations_without_recomputing(demo_run):
    from core.eval.run import evaluate

    _, run_dir = demo_run
    result = evaluate(run_dir, limit=8, name="page-eight")
    ws = run_dir.parent.parent
    at = _page("pages/evaluate.py", ws, eval_run=str(run_dir), ev_result="page-eight")
    assert any(c.value == "\n".join(result.lines) for c in at.code), [c.value for c in at.code]
    figures, rows = at.dataframe[0].value, at.dataframe[1].value
    assert list(figures["metric"])[:4] == ["exact match", "token F1", "ROUGE-L", "chrF"]
    assert len(rows) == 8 and list(rows.columns)[:5] == [
        "row",
        "prompt",
        "reference",
        "base_answer",
        "tuned_answer",
    ]
    changes = [c for c in rows["change"] if c is not None]
    assert changes == sorted(changes, reverse=True)  # largest gain first
    assert not (run_dir / "eval" / "page-eight-2").exists()  # shown, not evaluated again

    runs = _page("pages/runs.py", ws)
    table = runs.dataframe[0].value.set_index("run")
    assert table.loc[run_dir.name, "eval (base → tuned)"].startswith("exact match ")
    compared = runs.dataframe[1].value
    assert set(compared["run"]) == {run_dir.name} and "exact match" in set(compared["metric"])


@slow
def test_monitor_shows_the_newest_answers_beside_the_previous_ones(demo_run):
    _, run_dir = demo_run
    at = _page("pages/monitor.py", run_dir.parent.parent, monitor_run=str(run_dir))
    assert any("Answers on held-out prompts" in m.value for m in at.markdown)
    table = at.table[0].value
    assert "answer (step 40)" in table.columns and set(table["previous step"]) == {20}


LM_TASK = """task: demo_uppercase
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["</s>"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@slow
def test_lm_eval_runs_a_local_task_on_base_and_tuned(demo_run, tmp_path):
    pytest.importorskip("lm_eval")
    demo, run_dir = demo_run
    task = tmp_path / "demo_uppercase.yaml"
    task.write_text(LM_TASK.format(data=demo / "heldout.jsonl"))
    out = eval_cli(
        "--run", run_dir, "--data", demo / "heldout.jsonl", "--limit", 4, "--name", "lm", "--lm-eval", task
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval: lm-eval demo_uppercase exact_match 0 -> 1" in out.stdout, out.stdout
    stored = json.loads((run_dir / "eval" / "lm" / "lm_eval.json").read_text())
    assert stored["figures"]["demo_uppercase exact_match"] == {"base": 0.0, "tuned": 1.0}


def test_lm_eval_tasks_are_names_or_task_files(tmp_path):
    from core.eval.harness import _tasks
    from core.eval.heldout import EvalError

    good = tmp_path / "mine.yaml"
    good.write_text("task: my_task\ndataset_path: json\n")
    assert _tasks(f"arc_easy, {good}") == (["arc_easy", "my_task"], [str(tmp_path.resolve())])
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_path: json\n")
    with pytest.raises(EvalError, match="not a task YAML file"):
        _tasks(str(bad))


@slow
def test_a_merged_export_is_compared_with_its_base_like_its_adapter(demo_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.eval.run import evaluate

    demo, run_dir = demo_run
    base = AutoModelForCausalLM.from_pretrained(demo / "base")
    merged = PeftModel.from_pretrained(base, str(run_dir / "adapter")).merge_and_unload()
    out = tmp_path / "merged"
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(demo / "base").save_pretrained(out)
    data = str(demo / "heldout.jsonl")
    by_model = evaluate(run_dir, model=str(out), data=data, limit=20, name="export")
    by_adapter = evaluate(run_dir, data=data, limit=20, name="adapter-20")
    assert by_model.settings["tuned"] == str(out.resolve()) and by_model.settings["what"] == "model merged"
    assert by_model.lines[:4] == by_adapter.lines[:4]  # the same answers, scored the same
