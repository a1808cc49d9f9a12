"""Bad input at the start fails fast, once, and leaves nothing behind (issue #40 §3, #42 §5): every CLI checks its
arguments and data before it makes a run folder or loads a model, and says one sentence, once, with exit 2.

"No model loaded" is observed, not timed: the model folder below passes every check made without loading it, but
its weights cannot load (a real torch checkpoint whose embedding has the wrong shape). A command that loaded the
model would end with that load's error (or a traceback) instead of the one sentence about the input.
"""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cli import REPO

ROWS = [{"instruction": f"Say {w}", "output": w} for w in ("cat", "dog", "emu", "fox")] * 8


@pytest.fixture(scope="module")
def unloadable_model(tmp_path_factory, tiny_llama) -> Path:
    """tiny_llama's config and tokenizer, with weights that pass the model-folder checks but do not load."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("unloadable")
    for f in Path(tiny_llama).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    torch.save({"model.embed_tokens.weight": torch.zeros(3, 3)}, folder / "pytorch_model.bin")
    with pytest.raises(RuntimeError):  # the observable has teeth: loading this model fails loudly
        AutoModelForCausalLM.from_pretrained(folder)
    return folder


def _config(tmp_path: Path, model: Path, data: Path, **training) -> Path:
    cfg = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "eval_split": 0.25},
        "training": {"max_steps": 4, "max_length": 128, "logging_steps": 1, **training},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _broken_jsonl(tmp_path: Path) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n" + '{"instruction": "x", "output": \n')
    return data


def _good_jsonl(tmp_path: Path) -> Path:
    data = tmp_path / "good.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return data


def _one_sentence(text: str, err: str, needle: str) -> str:
    """The one `error:` line of stderr: it holds `needle`, which the whole output says once; no traceback."""
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], text[-3000:]
    assert text.count(needle) == 1 and "Traceback" not in text, text[-3000:]
    return errors[0]


def _train_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """core.train's main() in this process (it installs stop handlers: pytest gets its own back)."""
    from core.train.cli import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = main([str(a) for a in argv])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- core.train ---------------------------------------------------------------------------------------------


def test_train_with_a_broken_jsonl_says_the_line_once_and_leaves_no_folder(tmp_path, unloadable_model):
    """Was: the finding on stdout and again as the error (twice), a failed run folder left behind. The one
    subprocess test of core.train: the output exactly as a terminal shows it."""
    cfg = _config(tmp_path, unloadable_model, _broken_jsonl(tmp_path))
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "core.train", str(cfg), "--run-dir", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    _one_sentence(out.stdout + out.stderr, out.stderr, "line 2 of")
    assert "core.train: pid" not in out.stderr  # training never started
    assert not run_dir.exists()


@pytest.mark.parametrize("case", ["malformed-yaml", "alias-bomb", "already-a-run"])
def test_a_refusal_comes_without_the_training_line(tmp_path, unloadable_model, capsys, case):
    """#42 §5: "core.train: pid N training DIR" was printed before these refusals; it is printed once training
    starts."""
    run_dir = tmp_path / "run"
    cfg = _config(tmp_path, unloadable_model, _good_jsonl(tmp_path))
    if case == "malformed-yaml":
        cfg.write_text("model: {path: [unclosed\n")
        needle = "run.yaml"
    elif case == "alias-bomb":
        cfg.write_text(
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            )
        )
        needle = "uses a YAML alias"
    else:
        run_dir.mkdir()  # a finished run: its config, status and metrics
        shutil.copy(cfg, run_dir / "config.yaml")
        (run_dir / "status.json").write_text(json.dumps({"state": "finished", "step": 4}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 1.0}) + "\n")
        needle = "already holds a run"
    before = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None
    code, out, err = _train_main([cfg, "--run-dir", run_dir], capsys)
    assert code == 2
    _one_sentence(out + err, err, needle)
    assert "core.train: pid" not in err
    assert (sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None) == before


def test_a_training_arguments_refusal_keeps_what_it_found(tmp_path, unloadable_model, capsys):
    """transformers says "...but found" and lists what it found on the lines below: the one-line policy cut that
    off. The trainer checks it before its folder and before the model (it was found at the trainer's build)."""
    cfg = _config(
        tmp_path,
        unloadable_model,
        _good_jsonl(tmp_path),
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="epoch",
    )
    for extra in (["--dry-run"], ["--run-dir", tmp_path / "run"]):
        code, out, err = _train_main([cfg, *extra], capsys)
        assert code == 2, err
        line = _one_sentence(out + err, err, "--load_best_model_at_end requires")
        assert (
            "Evaluation strategy: IntervalStrategy.STEPS" in line
            and "Save strategy: SaveStrategy.EPOCH" in line
        )
        assert "core.train: pid" not in err
    assert not (tmp_path / "run").exists()


def test_the_libraries_check_sees_the_held_out_split(tmp_path, unloadable_model, capsys):
    """load_best_model_at_end with matching strategies and a held-out split is a valid run: the libraries' check
    builds the arguments with evaluation on, as the run does (it refused this as "eval strategy no")."""
    cfg = _config(
        tmp_path,
        unloadable_model,
        _good_jsonl(tmp_path),
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="steps",
        eval_steps=2,
        save_steps=2,
    )
    code, out, err = _train_main([cfg, "--dry-run"], capsys)
    assert code == 0, err
    assert json.loads(out)["plan"]


@pytest.mark.slow
def test_the_training_line_is_printed_once_training_starts(tmp_path, tiny_llama, capsys):
    """The counterpart of the refusals above: a run that starts says so, once (and the held-out check of
    load_best_model_at_end lets it train)."""
    cfg = _config(
        tmp_path,
        tiny_llama,
        _good_jsonl(tmp_path),
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="steps",
        eval_steps=2,
        save_steps=2,
    )
    code, out, err = _train_main([cfg, "--run-dir", tmp_path / "run"], capsys)
    assert code == 0, err[-3000:]
    assert err.count("core.train: pid") == 1 and "run finished at step 4" in out


# ---- core.runs launch ---------------------------------------------------------------------------------------


def test_runs_launch_with_bad_data_refuses_before_the_run_exists(
    workspace, tmp_path, unloadable_model, capsys
):
    """Was: exit 0, a run folder, and a trainer that failed a minute later."""
    from core.runs.__main__ import main

    cfg = _config(tmp_path, unloadable_model, _broken_jsonl(tmp_path))
    code = main(["launch", str(cfg), "--name", "bad-data"])
    out = capsys.readouterr()
    assert code == 2
    _one_sentence(out.out + out.err, out.err, "line 2 of")
    assert not (workspace / "runs" / "bad-data").exists()  # no folder: no trainer was started either


# ---- core.preflight -----------------------------------------------------------------------------------------


def test_preflight_names_the_line_and_column_of_a_json_array(tmp_path, tiny_llama, capsys):
    """A .json file holding one array: the loader said "position 70"."""
    from core.train.preflight import main

    data = tmp_path / "data.json"
    data.write_text('[{"instruction": "a", "output": "b"},\n {"instruction": "x", "output": }\n]\n')
    code = main([str(_config(tmp_path, tiny_llama, data))])
    out = capsys.readouterr()
    assert code == 2
    assert f"{data} is not valid JSON at line 2, column 33" in out.err and "position" not in out.err


# ---- core.demo ----------------------------------------------------------------------------------------------


def _demo(argv: list[str], capsys) -> tuple[int, str]:
    from core.demo.__main__ import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--run", "--adapter", "MISSING"], "--run trains a new adapter and --adapter names one"),
        (
            ["--run-dpo", "--adapter", "BROKEN"],
            "adapter_config.json is not valid JSON (Expecting value: line 1",
        ),
        (["--run-dpo", "--adapter", "MISSING"], "Adapter folder"),
    ],
)
def test_demo_checks_adapter_before_it_builds_anything(tmp_path, capsys, flags, needle):
    """Was: --run ignored --adapter and trained for minutes (exit 0); --run-dpo with a broken adapter said only
    "Expecting value: line 1 column 24" (exit 1); a missing one failed after half a minute of work with peft's
    message. The demo folder is never made: nothing was built, loaded or trained."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": }')
    paths = {"MISSING": str(tmp_path / "missing"), "BROKEN": str(broken)}
    out_dir = tmp_path / "demo"
    code, text = _demo(["--out", str(out_dir), *[paths.get(f, f) for f in flags]], capsys)
    assert code == 2
    _one_sentence(text, text, needle)
    if "BROKEN" in flags:
        assert str(broken / "adapter_config.json") in text  # the file is named
    assert not out_dir.exists()


def test_demo_out_that_is_not_a_demo_folder_is_bad_input(tmp_path, capsys):
    """Was exit 1, as if the demo had failed; the folder is the user's and stays as it was."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, text = _demo(["--out", str(mine)], capsys)
    assert code == 2
    _one_sentence(text, text, "exists and is not a demo folder")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


# ---- core.fmt.error_line --------------------------------------------------------------------------------------


def test_error_line_keeps_a_message_s_lines_and_cuts_at_a_word():
    from core.fmt import error_line

    found = ValueError("needs x to match y, but found\n- x: 1\n- y: 2\n")
    assert error_line(found) == "needs x to match y, but found: x: 1; y: 2"
    assert error_line(ValueError("One sentence.\n\nAnother.")) == "One sentence. Another."
    long = error_line(ValueError("word " * 100), limit=50)
    assert len(long) <= 50 and long.endswith("word...")
    assert error_line(KeyError()) == "KeyError"
