"""`python -m core.estimate` as a real subprocess, offline: JSON output, the table, and bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=180):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "core.estimate", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def estimate_main(*args) -> subprocess.CompletedProcess:
    """core.estimate's main(argv) in this process (tests/cli.py: in_process), for the error paths; the real
    `python -m core.estimate` keeps its exit-status test (test_a_folder_that_does_not_exist_is_said_so) and the
    JSON and table tests."""
    from core.estimate.cli import main
    from tests.cli import in_process

    return in_process(main, *args)


@pytest.mark.slow
def test_json_for_llama2_7b_lora_offline():
    proc = run_cli(
        "--model",
        "meta-llama/Llama-2-7b-hf",
        "--tuning",
        "lora",
        "--batch-size",
        "2",
        "--seq-len",
        "1024",
        "--lora-r",
        "16",
        "--lora-alpha",
        "32",
        "--target-modules",
        "q_proj,v_proj",
        "--gradient-checkpointing",
        "--optim",
        "paged_adamw_8bit",
        "--attn",
        "sdpa",
        "--no-double-quant",
        "--gpu-gb",
        "24",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in (
        "components",
        "tensor_peak_bytes",
        "reserved_peak_bytes",
        "device_total_bytes",
        "peak_phase",
        "gpu_bytes",
        "fits",
        "trainable_params",
        "total_params",
    ):
        assert key in out
    assert out["total_params"] == 6_738_415_616
    assert out["trainable_params"] == 16 * (4096 + 4096) * 2 * 32
    assert out["gpu_bytes"] == 24 * 2**30
    assert sum(out["components"].values()) == out["device_total_bytes"]
    assert out["plan"]["gradient_checkpointing"] is True and out["plan"]["double_quant"] is False


@pytest.mark.slow
def test_human_table_and_long_sequence_warning(tiny_llama):
    proc = run_cli("--model", str(tiny_llama), "--tuning", "qlora", "--seq-len", "1000", "--gpu-gb", "8")
    assert proc.returncode == 0, proc.stderr
    assert "device total" in proc.stdout and "verdict:" in proc.stdout and "peak phase:" in proc.stdout
    assert "max_position_embeddings" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "nobody/unknown-model"], "Unknown model 'nobody/unknown-model'"),
        (
            ["--model", "meta-llama/Llama-2-7b-hf", "--optim", "adamw_magic"],
            "Unknown optimizer 'adamw_magic'",
        ),
        (["--model", "meta-llama/Llama-2-7b-hf", "--batch-size", "0"], "batch_size must be a whole number"),
        (["--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "-1"], "seq_len must be"),
        (["--model", "meta-llama/Llama-2-7b-hf", "--gpu-gb", "-24"], "gpu_gb must be a positive"),
        (["--model", "meta-llama/Llama-2-7b-hf", "--batch-size", "two"], "invalid int value"),
    ],
)
def test_bad_input_one_sentence_non_zero_exit(args, needle):
    proc = estimate_main(*args)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_folder_problems(tmp_path):
    proc = estimate_main("--model", str(tmp_path))
    assert proc.returncode != 0 and "no config.json" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    proc = estimate_main("--model", str(tmp_path))
    assert proc.returncode != 0 and "not a causal language model" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_rank_larger_than_the_layer(tiny_llama):
    proc = estimate_main("--model", str(tiny_llama), "--lora-r", "4096")
    assert proc.returncode != 0
    assert "larger than every layer it adapts" in proc.stderr and "Traceback" not in proc.stderr


def test_a_folder_that_does_not_exist_is_said_so():
    """Issue #16: a mistyped folder was reported as 'Unknown model'."""
    out = run_cli("--model", "/nonexistent/model-folder", "--json")
    assert out.returncode == 2
    assert "The folder '/nonexistent/model-folder' does not exist" in out.stderr


def test_gpu_gb_help_lists_the_cards_by_name_from_the_one_table():
    """Issue #40 item 4: the Estimate page's GPU list and --gpu-gb's help read the same table of cards."""
    from core.estimate.cards import CARDS

    proc = estimate_main("--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps the help
    for card in CARDS:
        assert f"{card.name} {card.gib:.2f}" in text, card


def test_the_default_batch_and_length_are_the_estimate_pages_and_the_table_says_them():
    """Issue #51: `python -m core.estimate` planned 1 x 2048 where the Estimate page plans 4 x 512, and its table
    never said which batch and length its figures were for. One default (a run config's), said on the first line;
    the JSON keeps its keys."""
    from streamlit.testing.v1 import AppTest

    page = AppTest.from_file(str(REPO / "pages" / "estimate.py"), default_timeout=120).run()
    assert not page.exception, page.exception
    batch, length = page.number_input(key="es_batch").value, page.number_input(key="es_max_length").value
    table = estimate_main("--model", "meta-llama/Llama-2-7b-hf")
    assert table.returncode == 0, table.stderr
    first = table.stdout.splitlines()[0]
    assert first.endswith(f" trainable; batch size {batch} x {length:,} tokens"), first
    out = json.loads(estimate_main("--model", "meta-llama/Llama-2-7b-hf", "--json").stdout)
    assert (out["plan"]["batch_size"], out["plan"]["seq_len"]) == (batch, length)
    assert "components" in out and "fit_search" in out


def test_the_older_spellings_of_tuning_and_method_still_plan_with_a_note():
    """Issue #48: --method said full / lora / qlora and --objective the run config's method; now --tuning and
    --method. The old spellings plan the same, each with a one-line note on stderr; --dpo stays."""
    llama = ("--model", "meta-llama/Llama-2-7b-hf", "--batch-size", "1", "--seq-len", "256", "--json")
    new = estimate_main(*llama, "--tuning", "qlora", "--method", "dpo")
    assert new.returncode == 0 and new.stderr == "", new.stderr
    plan = json.loads(new.stdout)["plan"]
    assert (plan["tuning"], plan["method"]) == ("qlora", "dpo") and "objective" not in plan
    for old in (("--method", "qlora", "--objective", "dpo"), ("--method", "qlora", "--dpo")):
        proc = estimate_main(*llama, *old)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == json.loads(new.stdout)
        notes = proc.stderr.splitlines()
        assert notes[0] == (
            "note: --method qlora is the older spelling of --tuning qlora (--method is now sft, dpo, kto or grpo)."
        )
        assert notes[1:] == (
            ["note: --objective is the older spelling of --method (--method dpo)."]
            if "--objective" in old
            else []
        )
    clash = estimate_main(*llama, "--method", "kto", "--dpo")
    assert clash.returncode == 2 and "--method kto and --method dpo both given" in clash.stderr


@pytest.mark.parametrize(
    "flags", [("--tuning", "full"), ("--method", "dpo"), ("--dpo",), ("--method", "qlora")]
)
def test_a_run_configs_plan_is_not_silently_changed_by_a_tuning_or_method_flag(tiny_llama, tmp_path, flags):
    """With --config the run config says the tuning and the method (one description of the run): a flag that
    would change them is refused in one sentence, not ignored."""
    from core.recipe.config import dump_config, validate_config

    cfg = validate_config({"model": {"path": str(tiny_llama)}, "data": {"path": str(tmp_path / "d.jsonl")}})
    path = dump_config(cfg, tmp_path / "run.yaml")
    proc = estimate_main("--config", path, *flags)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {flags[0]} cannot change a run config's plan") and "edit it" in line
    assert estimate_main("--config", path, "--json").returncode == 0  # the config alone plans
