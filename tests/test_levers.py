"""The memory levers (issue #12): each changes the plan by the bytes its term says, the CPU ones move a measured
step as much as the plan, the fit advice combines them, the CLI takes them as flags and a run config as --config,
and the table of docs/planner.md is the planner's own."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from core.demo.toy import tiny_config
from core.estimate.activation_terms import layer_saved_tensors
from core.estimate.bill import estimate
from core.estimate.levers import LEVERS, lever_savings, levers_markdown, modelled_note, what_would_fit
from core.estimate.plan import OFFLOAD_STASH, Plan, batch_shape, largest_batch_tokens
from core.estimate.specs import load_spec, lora_targets, normalize_targets
from core.measure.step import measure_plan
from core.measure.step_plan import step_plan
from tests.cli import train

REPO = Path(__file__).resolve().parent.parent
GOAL = 0.03  # benchmarks/estimator_accuracy.py: median <= 3%
LLAMA8B = "meta-llama/Llama-3.1-8B"


def _targets(spec, plan):
    return lora_targets(spec.model_id, normalize_targets(plan.target_modules))


# -- each lever's term ----------------------------------------------------------------------------------------


def test_padding_free_follows_the_tokens_really_in_the_batch():
    """Real lengths: with padding-free batches every per-token term scales with the batch's tokens, so the
    activations of a batch of 3,000 tokens are 3,000/8,192 of the bound's (flash attention: no mask)."""
    spec = load_spec(LLAMA8B)
    bound = Plan(
        model=LLAMA8B,
        tuning="qlora",
        batch_size=4,
        seq_len=2048,
        attn="flash",
        padding_free=True,
        gradient_checkpointing=False,
    )
    real = replace(bound, batch_tokens=3000)
    assert batch_shape(bound) == (1, 8192) and batch_shape(real) == (1, 3000)
    # one padding-free row of 3,000 tokens costs what one 3,000-token row costs, far below the bound
    single = replace(bound, batch_size=1, seq_len=3000, padding_free=False)
    assert estimate(real, spec).components == estimate(single, spec).components
    assert estimate(real, spec).device_total_bytes < 0.5 * estimate(bound, spec).device_total_bytes
    # padded batches pay for the longest row in every row
    padded = replace(bound, padding_free=False)
    assert largest_batch_tokens([100, 2000, 50, 700, 5000], padded) == 4 * 2048
    assert largest_batch_tokens([100, 2000, 50, 700], padded) == 4 * 2000
    assert largest_batch_tokens([100, 2000, 50, 700], bound) == 2000 + 700 + 100 + 50
    assert largest_batch_tokens([100, 2000], replace(bound, packing=True)) == 4 * 2048  # packed rows are full


def test_padding_free_on_sdpa_pays_for_the_mask_and_the_gqa_copies():
    """Several sequences in one padding-free row: transformers builds a (T x T) bool mask, sdpa converts it to
    the compute dtype per layer and saves it, and grouped-query k/v are repeated to every head (no enable_gqa
    with a mask). Flash attention takes none of it."""
    spec = load_spec(LLAMA8B)
    flash = Plan(
        model=LLAMA8B,
        tuning="lora",
        batch_size=2,
        seq_len=1024,
        attn="flash",
        padding_free=True,
        gradient_checkpointing=False,
    )
    sdpa = replace(flash, attn="sdpa")
    t = 2048
    layer = layer_saved_tensors(spec, sdpa, _targets(spec, sdpa))
    gqa = (layer["k_repeated"] + layer["v_repeated"]) - 2 * spec.num_kv_heads * spec.head_dim * 2
    expected = spec.num_layers * (t * gqa + t * t * 2) + t * t  # bf16 copies per layer + the bool mask
    on, off = estimate(sdpa, spec), estimate(flash, spec)
    assert on.phase_components["forward"]["activations"] - off.phase_components["forward"]["activations"] == (
        pytest.approx(expected, rel=1e-6)
    )
    assert any("flash_attention_2" in w for w in on.warnings)
    # one sequence (batch 1, no packing): no mask to build
    single = estimate(replace(sdpa, batch_size=1, seq_len=2048), spec)
    assert (
        single.phase_components["forward"]["activations"]
        == estimate(replace(flash, batch_size=1, seq_len=2048), spec).phase_components["forward"][
            "activations"
        ]
    )


def test_liger_removes_the_fp32_norm_copies_and_silu_output():
    spec = load_spec(LLAMA8B)
    plan = Plan(
        model=LLAMA8B,
        tuning="qlora",
        batch_size=1,
        seq_len=4096,
        lora_dropout=0.0,
        gradient_checkpointing=False,
    )
    liger = replace(plan, liger=True)
    before = layer_saved_tensors(spec, plan, _targets(spec, plan))
    after = layer_saved_tensors(spec, liger, _targets(spec, liger))
    h, inter = spec.hidden_size, spec.intermediate_size
    assert sum(before.values()) - sum(after.values()) == 2 * (4 * h - 2 * h) + inter * 2
    assert "act_gate" not in after and "input_layernorm.fp32_input" not in after
    saved = estimate(plan).components["activations"] - estimate(liger).components["activations"]
    assert saved > 0
    # on a CPU the run does without Liger: nothing changes, and the plan says why
    cpu = estimate(replace(liger, device="cpu"))
    assert cpu.components == estimate(replace(plan, device="cpu")).components
    assert any("CUDA GPU only" in w for w in cpu.warnings)


def test_activation_offloading_moves_saved_activations_to_pinned_cpu_ram():
    spec = load_spec(LLAMA8B)
    plan = Plan(model=LLAMA8B, tuning="qlora", batch_size=1, seq_len=16384, gradient_checkpointing=True)
    off = estimate(plan, spec)
    on = estimate(replace(plan, activation_offloading=True), spec)
    layer_input = 16384 * spec.hidden_size * 2
    assert on.cpu_pinned_bytes == off.phase_components["forward"]["activations"]
    assert on.phase_components["forward"]["activations"] == OFFLOAD_STASH * layer_input
    assert on.device_total_bytes < off.device_total_bytes
    assert "not yet measured" in modelled_note(replace(plan, activation_offloading=True))
    assert off.cpu_pinned_bytes == 0 and modelled_note(plan) is None


def test_lever_savings_are_re_estimates_and_cover_every_lever():
    spec = load_spec(LLAMA8B)
    plan = Plan(model=LLAMA8B, tuning="qlora", batch_size=2, seq_len=4096, lora_dropout=0.05)
    rows = {r["lever"]: r for r in lever_savings(plan, spec)}
    assert set(rows) == {lv.field for lv in LEVERS}
    for field, row in rows.items():
        lever = next(lv for lv in LEVERS if lv.field == field)
        on = estimate(replace(plan, **{field: lever.on}), spec).device_total_bytes
        off = estimate(replace(plan, **{field: lever.off_value(plan)}), spec).device_total_bytes
        assert row["saves_bytes"] == off - on
    assert rows["gradient_checkpointing"]["saves_bytes"] > 0 and rows["fused_lm_head"]["on"] is True
    assert rows["activation_offloading"]["measured"] is False and rows["padding_free"]["measured"] is True


def test_what_would_fit_combines_levers_when_no_single_change_is_enough():
    """8B, batch 8 x 4096 on 24 GiB (the issue's case): no single change that keeps what is trained fits (a
    shorter length does, but truncates the data), so the first suggestion is a combination that does, each entry
    with its cost."""
    spec = load_spec(LLAMA8B)
    plan = Plan(model=LLAMA8B, batch_size=8, seq_len=4096, gpu_gb=24.0, gradient_checkpointing=False)
    advice = what_would_fit(plan, spec)
    singles = [a for a in advice if not a["combined"]]
    assert singles and all(a["verdict"] != "fits" for a in singles if a["keeps_training"])
    assert any(a["verdict"] == "fits" and not a["keeps_training"] for a in singles)  # the shortest length
    combo = advice[0]
    assert combo["combined"] and combo["verdict"] == "fits" and " + " in combo["change"]
    assert (
        estimate(replace(plan, **combo["settings"]), spec).device_total_bytes == combo["device_total_bytes"]
    )
    assert "Gradient checkpointing" in combo["change"]
    assert all(a["costs"] for a in advice)


@pytest.mark.parametrize(
    "model,method", [("meta-llama/Llama-2-13b-hf", "lora"), ("Qwen/Qwen2.5-14B", "qlora")]
)
def test_what_would_fit_one_12_gb_card_offers_what_that_card_can_do_first(model, method):
    """Issue #51: on one RTX 3060 the first suggestion was '8 GPUs' / '4 GPUs with FSDP' (it saves the most), above
    QLoRA or a smaller batch that fit the card the user has. More GPUs come last."""
    from core.estimate.cards import CARDS

    card = next(c for c in CARDS if c.name == "RTX 3060")
    plan = Plan(model=model, tuning=method, batch_size=4, seq_len=512, gpu_gb=card.gib)
    assert estimate(plan).verdict == "does not fit"
    advice = what_would_fit(plan)
    more = [a for a in advice if "gpus" in a["settings"]]
    assert more and advice[-len(more) :] == more, [a["change"] for a in advice]
    first = advice[0]
    assert "gpus" not in first["settings"] and first["verdict"] == "fits", first


# -- measured on the CPU: the levers that run there ---------------------------------------------------------


def _folder(tmp_path, name):
    config = tiny_config(
        "llama",
        num_hidden_layers=3,
        vocab_size=2000,
        intermediate_size=256,
        hidden_size=128,
        num_key_value_heads=2,
    )
    folder = tmp_path / name
    folder.mkdir()
    config.to_json_file(str(folder / "config.json"))
    return config, str(folder)


@pytest.mark.parametrize(
    "plan",
    [
        step_plan("lora", batch_size=2, seq_len=64, padding_free=True),
        step_plan("lora", batch_size=2, seq_len=64, padding_free=True, gradient_checkpointing=True),
        step_plan("lora", batch_size=2, seq_len=64, packing=True),
        step_plan("lora", batch_size=2, seq_len=64, packing=True, packing_strategy="wrapped"),
        step_plan("qlora", batch_size=2, seq_len=64, padding_free=True),
        # uneven rows (issue #25 item 3): 64 + 40 tokens of the bound 128, one row of 104 through the model
        step_plan("lora", batch_size=2, seq_len=64, padding_free=True, batch_tokens=104),
        step_plan(
            "lora", batch_size=2, seq_len=64, padding_free=True, batch_tokens=104, gradient_checkpointing=True
        ),
    ],
    ids=[
        "padding-free",
        "padding-free-gc",
        "packing-bfd",
        "packing-wrapped",
        "qlora-padding-free",
        "uneven-rows",
        "uneven-rows-gc",
    ],
)
def test_cpu_levers_agree_with_a_measured_step(tmp_path, plan):
    if plan.tuning == "qlora":
        pytest.importorskip("bitsandbytes")
    config, folder = _folder(tmp_path, "m")
    measured = measure_plan(config, plan, cache_dir=tmp_path)
    est = estimate(replace(plan, model=folder))
    error = est.tensor_peak_bytes / measured.steady_peak_bytes - 1
    assert abs(error) <= GOAL, (error, est.phases, measured.steady_phase_peaks)


def test_padding_free_moves_the_measurement_as_much_as_the_plan(tmp_path):
    """Switching a batch of two rows to padding-free on sdpa: the measured change of the peak (mask, GQA copies)
    is the planned one."""
    base = step_plan("lora", batch_size=2, seq_len=96)
    flipped = replace(base, padding_free=True)
    config, folder = _folder(tmp_path, "m")
    m0, m1 = (measure_plan(config, p, cache_dir=tmp_path).steady_peak_bytes for p in (base, flipped))
    e0, e1 = (estimate(replace(p, model=folder)).tensor_peak_bytes for p in (base, flipped))
    assert m1 != m0
    assert abs((e1 - e0) - (m1 - m0)) <= GOAL * m0, (e1 - e0, m1 - m0)


# -- the CLI and the docs ------------------------------------------------------------------------------------


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "core.estimate", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def _main(*args) -> subprocess.CompletedProcess:
    """core.estimate's main(argv) in this process (tests/cli.py: in_process), for the refusals beside each
    real `python -m core.estimate` run (_cli)."""
    from core.estimate.cli import main
    from tests.cli import in_process

    return in_process(main, *args)


def test_cli_takes_levers_as_flags_and_lists_per_lever_savings():
    out = _cli(
        "--model",
        LLAMA8B,
        "--tuning",
        "qlora",
        "--gradient-checkpointing",
        "--activation-offloading",
        "--liger",
        "--padding-free",
        "--attn",
        "flash",
        "--batch-tokens",
        "3000",
        "--batch-size",
        "2",
        "--seq-len",
        "4096",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    plan = data["plan"]
    assert (
        plan["activation_offloading"]
        and plan["liger"]
        and plan["padding_free"]
        and plan["batch_tokens"] == 3000
    )
    assert data["cpu_pinned_bytes"] > 0 and "not yet measured" in data["modelled_not_measured"]
    levers = {r["lever"]: r for r in data["levers"]}
    assert levers["activation_offloading"]["on"] and levers["activation_offloading"]["saves_bytes"] > 0
    bad = _main("--model", LLAMA8B, "--packing-strategy", "zigzag")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "packing_strategy" in bad.stderr


def test_cli_plans_a_run_config_through_the_engines_mapping(tmp_path):
    from core.estimate.from_config import plan_for_config
    from core.recipe.config import dump_config, validate_config

    cfg = validate_config(
        {
            "model": {"path": LLAMA8B},
            "quantization": {"load_in_4bit": True},
            "data": {"path": str(tmp_path / "train.jsonl")},
            "training": {"per_device_train_batch_size": 2, "max_length": 4096, "padding_free": True},
        }
    )
    dump_config(cfg, tmp_path / "run.yaml")
    out = _cli("--config", str(tmp_path / "run.yaml"), "--gpu-gb", "48", "--device", "cuda", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["plan"] == plan_for_config(cfg, 48.0, "cuda").to_dict()
    assert json.loads(out.stdout)["plan"]["padding_free"] is True
    (tmp_path / "broken.yaml").write_text("training: {per_device_train_batch_size: -3}\n")
    bad = _main("--config", str(tmp_path / "broken.yaml"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_the_planner_page_has_the_lever_table():
    page = (REPO / "docs" / "planner.md").read_text()
    assert levers_markdown() in page, "the lever table of docs/planner.md is not core.estimate.levers' own"


# -- the engine runs them ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uneven_rows(tmp_path_factory):
    """Rows of very different lengths (some beyond max_length): what padding-free and packing are for."""
    path = tmp_path_factory.mktemp("uneven") / "train.jsonl"
    rows = [
        {"instruction": "Repeat: " + "ab" * (1 + i % 40), "output": "ok" * (1 + i % 7)} for i in range(48)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "levers",
    [
        {"padding_free": True},
        {"packing": True},
        {"packing": True, "packing_strategy": "wrapped"},
        {"activation_offloading": True},
    ],
    ids=["padding-free", "packing-bfd", "packing-wrapped", "offloading-on-a-cpu"],
)
def test_core_train_runs_the_cpu_levers(tmp_path, tiny_llama, uneven_rows, levers):
    """A real run through python -m core.train with each lever on: TRL refuses padding_free without packing when
    max_length is set, so the engine truncates the rows itself and hands TRL max_length None. Activation
    offloading (CUDA only; TRL's raises without an accelerator) is left out on a CPU, with a note."""
    from core import rundir
    from core.recipe.config import validate_config

    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama)},
            "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
            "data": {"path": str(uneven_rows)},
            "training": {
                "max_length": 48,
                "per_device_train_batch_size": 4,
                "max_steps": 4,
                "logging_steps": 1,
                "save_steps": 4,
                "gradient_checkpointing": False,
                **levers,
            },
        }
    )
    run_dir = tmp_path / "run"
    proc = train(cfg, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((run_dir / rundir.PLAN).read_text())["plan"]
    assert all(plan[k] == v for k, v in levers.items())
    if "activation_offloading" in levers:
        assert "training.activation_offloading works on a CUDA GPU only" in proc.stdout
    losses = [json.loads(line).get("loss") for line in (run_dir / rundir.METRICS).read_text().splitlines()]
    assert len([x for x in losses if x is not None]) == 4


@pytest.mark.slow
def test_smoke_test_of_a_padding_free_config_measures_its_one_full_row(workspace, tiny_llama, uneven_rows):
    """The smoke step is one full max_length row at batch size 1, padded or padding-free alike; its measured peak
    agrees with the plan made for it (padding-free and packing off, as the engine runs it)."""
    from core.estimate.from_config import estimate_for_config, plan_record
    from core.recipe.config import validate_config
    from core.runs.admin import start_smoke_test
    from core.runs.launcher import wait_for_smoke

    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama)},
            "data": {"path": str(uneven_rows)},
            "training": {"max_length": 96, "per_device_train_batch_size": 4, "padding_free": True},
        }
    )
    plan = plan_record(estimate_for_config(cfg, 24.0, "cpu", smoke=True))
    assert plan["plan"]["padding_free"] is False and plan["batch_rows"] == 1
    result = wait_for_smoke(start_smoke_test(workspace, "pf-smoke", cfg), timeout=300)
    assert result is not None and result["state"] == "finished", result
    assert abs(result["peak_bytes"] / result["estimate_bytes"] - 1) <= 0.10, result


def test_cli_plans_the_largest_batch_of_a_configs_real_rows(tmp_path, tiny_llama, uneven_rows):
    from core.recipe.config import dump_config, validate_config

    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama)},
            "data": {"path": str(uneven_rows)},
            "training": {"max_length": 200, "per_device_train_batch_size": 4, "padding_free": True},
        }
    )
    dump_config(cfg, tmp_path / "run.yaml")
    out = _cli("--config", str(tmp_path / "run.yaml"), "--data-lengths", "--device", "cpu", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    batch = data["data_batch"]
    assert batch["rows"] == 48 and 0 < batch["batch_tokens"] < 4 * 200
    assert batch["device_total_bytes"] < data["device_total_bytes"]
    bad = _main("--model", LLAMA8B, "--data-lengths")
    assert bad.returncode == 2 and "--config" in bad.stderr and "Traceback" not in bad.stderr


def test_max_context_benchmark_meets_its_goal():
    """benchmarks/max_context.py (planner only, about a second): engine >= 4x the plain path, every lever >= 80k."""
    out = subprocess.run(
        [sys.executable, "benchmarks/max_context.py"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    headline = out.stdout.strip().splitlines()[-1]
    assert headline.startswith("max_context: ") and "(goal >= 80000, >= 4x)" in headline
    assert int(headline.split()[1]) >= 80_000


@pytest.mark.slow
def test_uneven_rows_on_a_large_tied_vocabulary_agree_with_a_measured_step(tmp_path):
    """Issue #25 item 3: two rows of 64 and 40 tokens, padding-free, on a model whose tied LM head dominates the
    step (vocab 8000 x hidden 128): the plan follows the 104 real tokens, not the padded bound of 128."""
    config = tiny_config(
        "llama",
        num_hidden_layers=3,
        vocab_size=8000,
        intermediate_size=256,
        hidden_size=128,
        tie_word_embeddings=True,
    )
    folder = tmp_path / "tied"
    folder.mkdir()
    config.to_json_file(str(folder / "config.json"))
    uneven = step_plan(
        "lora", batch_size=2, seq_len=64, padding_free=True, batch_tokens=104, gradient_checkpointing=True
    )
    bound = replace(uneven, padding_free=False, batch_tokens=0)
    measured = {
        k: measure_plan(config, p, cache_dir=tmp_path).steady_peak_bytes
        for k, p in (("u", uneven), ("b", bound))
    }
    planned = {
        k: estimate(replace(p, model=str(folder))).tensor_peak_bytes for k, p in (("u", uneven), ("b", bound))
    }
    assert measured["u"] < measured["b"]  # the real tokens save memory ...
    for k in measured:  # ... and the plan says how much
        assert abs(planned[k] / measured[k] - 1) <= GOAL, (k, planned, measured)


def test_a_smaller_batch_or_length_is_the_largest_that_fits_not_a_halving():
    """Issue #21 item 21: the advice said batch 4 where 5 fits, 2,048 tokens where 2,752 fit."""
    from core.estimate.fit import fit_search
    from core.estimate.levers import what_would_fit

    plan = Plan(model="meta-llama/Llama-3.1-8B", tuning="qlora", batch_size=8, seq_len=4096, gpu_gb=24.0)
    fit = fit_search(plan)
    assert 1 <= fit["max_batch_size"] < plan.batch_size and fit["max_seq_len"] < plan.seq_len  # over the card
    advice = {tuple(a["settings"]): a for a in what_would_fit(plan)}
    batch = advice[("batch_size", "batch_tokens")]["settings"]["batch_size"]
    seq = advice[("seq_len", "batch_tokens")]["settings"]["seq_len"]
    assert (batch, seq) == (fit["max_batch_size"], fit["max_seq_len"])
    assert advice[("batch_size", "batch_tokens")]["verdict"] == "fits"
