"""The evaluation phase of the memory bill (#37 item 4): an eval batch, GRPO's generation of it and the samples
callback's answers are a planned phase, the peak when they outgrow a training step; the fit search answers the
largest eval batch; the CLIs name the phase; a smoke test evaluates one batch and lands within 5% of the plan
(benchmarks/eval_accuracy.py runs more shapes); the Train form proposes the largest eval batch that fits."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from core.estimate.bill import estimate
from core.estimate.fit import eval_batch_for_config, fit_search, largest_eval_batch
from core.estimate.from_config import plan_for_config, plan_for_draft, plan_to_config
from core.estimate.plan import FIT_LIMIT, GiB, Plan, PlanError
from core.estimate.specs import load_spec
from core.recipe.config import validate_config

LLAMA = "meta-llama/Llama-2-7b-hf"
TOLERANCE = 0.05


def sft(**kw) -> Plan:
    return Plan(**{"model": LLAMA, "seq_len": 2048, "batch_size": 2, **kw})


# -- the terms ----------------------------------------------------------------------------------------------------


def test_a_run_without_evaluation_has_no_eval_phase_and_its_record_is_unchanged():
    est = estimate(sft())
    assert "eval" not in est.phases and est.evaluation is None and "evaluation" not in est.to_dict()
    assert not {"eval_batch_size", "eval_samples", "eval_generations"} & set(est.plan)


def test_an_eval_batch_is_a_no_grad_forward_that_becomes_the_peak_as_it_grows():
    one, eight, many = (estimate(sft(eval_batch_size=e)) for e in (1, 8, 32))
    static = ("weights", "lora_params", "optimizer_states")
    for est in (one, eight, many):
        ev = est.phase_components["eval"]
        assert ev.get("gradients", 0) == 0  # between two optimizer steps: zero_grad freed them
        assert all(ev[k] == est.phase_components["optimizer"][k] for k in static)
        assert est.evaluation["moment"] == "forward" and est.evaluation["rows"] in (1, 8, 32)
    # one decoder layer at a time, no saved activations: 8 rows hold less than a training step of 2 with grad...
    assert one.peak_phase == eight.peak_phase == "backward"
    # ...but 32 rows of 2048 tokens do: the plan names the evaluation as its peak
    assert many.peak_phase == "eval" and many.tensor_peak_bytes == many.phases["eval"]
    assert many.components["eval_forward"] > 0 and many.components["activations"] == 0
    # a 7B's layer transients (not the fused head's tile) make the forward: linear in the rows
    grow = eight.phase_components["eval"]["eval_forward"] / one.phase_components["eval"]["eval_forward"]
    assert grow == pytest.approx(8, rel=0.01), grow


def test_a_preference_method_keeps_the_policys_outputs_through_its_reference_forward():
    dpo = Plan(model=LLAMA, method="dpo", seq_len=1024, batch_size=1, eval_batch_size=4)
    with_ref, precomputed = estimate(dpo), estimate(replace(dpo, precompute_ref=True))
    kept = (
        with_ref.evaluation["components"]["eval_forward"]
        - precomputed.evaluation["components"]["eval_forward"]
    )
    # log-probs, entropy, mean_logits (fp32), is_top1 and the label mask, per scored position of 8 rows
    assert kept == 8 * 1023 * (4 + 4 + 1 + 1 + 4)
    # a chosen and a rejected row per example: the eval batch holds 8 rows of ids, masks, labels
    assert with_ref.evaluation["components"]["eval_batch"] >= 8 * 1024 * 8 * 4


def test_the_samples_callback_generates_its_prompts_at_each_evaluation_32_at_a_time():
    spec = load_spec(LLAMA)
    four, many, most = (estimate(sft(eval_samples=n)) for n in (4, 32, 1000))
    assert set(four.evaluation["moments"]) == {"samples prefill", "samples generate"}
    assert many.evaluation["moments"] == most.evaluation["moments"]  # core.generate answers 32 at once
    # the prefill holds the KV cache of every prompt (2048 tokens, the bound): 4 of them
    kv = spec.kv_cache_bytes_per_token_per_byte * 2
    assert four.evaluation["components"]["kv_cache"] == 4 * 2048 * kv
    # a 7B's cache of 32 prompts of 2048 tokens does not fit a 24 GiB card: named as the run's peak
    assert many.peak_phase == "eval" and many.verdict == "does not fit"


def test_grpo_generates_its_eval_batch_then_scores_it():
    grpo = dict(
        model="Qwen/Qwen2.5-1.5B",
        method="grpo",
        lora_dropout=0.0,
        batch_size=8,
        seq_len=1024,
        completion_len=768,
        num_generations=8,
    )
    est = estimate(Plan(**grpo, eval_batch_size=16))
    assert {"prefill", "generate", "forward"} <= set(est.evaluation["moments"])
    # the training's buffered rollouts stay alive through the evaluation too
    assert est.phase_components["eval"]["rollout_batch"] == est.phase_components["optimizer"]["rollout_batch"]
    twice = estimate(Plan(**grpo, eval_batch_size=32))
    assert twice.evaluation["moments"]["generate"] > est.evaluation["moments"]["generate"]
    with pytest.raises(PlanError, match="divide by the completions per prompt"):
        estimate(Plan(**grpo, eval_batch_size=12))
    estimate(Plan(**grpo, eval_batch_size=12, eval_generations=4))  # num_generations_eval 4 divides it


# -- the fit search ----------------------------------------------------------------------------------------------


def test_the_fit_search_answers_the_largest_eval_batch_that_fits():
    plan = sft(eval_batch_size=8)
    fit = fit_search(plan)
    best = fit["max_eval_batch_size"]
    assert best > 8
    at, over = (
        estimate(replace(plan, eval_batch_size=best)),
        estimate(replace(plan, eval_batch_size=best + 1)),
    )
    assert at.device_total_bytes <= FIT_LIMIT * at.gpu_bytes < over.device_total_bytes
    assert over.peak_phase == "eval"
    assert "max_eval_batch_size" not in fit_search(sft())  # a run that does not evaluate
    # "What would make it fit" offers that eval batch when the evaluation is what does not fit
    from core.estimate.levers import what_would_fit

    big = replace(plan, eval_batch_size=64)
    assert estimate(big).verdict == "does not fit" and estimate(big).peak_phase == "eval"
    offer = next(a for a in what_would_fit(big) if "eval_batch_size" in a["settings"])
    assert (
        offer["settings"] == {"eval_batch_size": best}
        and offer["verdict"] == "fits"
        and offer["keeps_training"]
    )
    # GRPO's eval batch in whole groups of num_generations_eval
    grpo = Plan(
        model="Qwen/Qwen2.5-1.5B",
        method="grpo",
        lora_dropout=0.0,
        batch_size=8,
        seq_len=1024,
        completion_len=768,
        num_generations=8,
        eval_batch_size=8,
        eval_generations=4,
        gpu_gb=80.0,
    )
    assert largest_eval_batch(grpo) % 4 == 0 and largest_eval_batch(grpo) >= 8


# -- from a run config, and back ---------------------------------------------------------------------------------


def _config(model, data, **training) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"path": str(data), "eval_split": 0.2},
        "training": {"max_length": 64, "per_device_train_batch_size": 2, **training},
    }


def test_a_config_plans_its_evaluation_as_the_trainer_runs_it(tiny_llama, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": "q", "output": "a"}) + "\n" for _ in range(20)))
    plan = plan_for_config(validate_config(_config(tiny_llama, data)))
    assert plan.eval_batch_size == 8  # TrainingArguments' default when the config leaves it unset
    plan = plan_for_config(
        validate_config(_config(tiny_llama, data, per_device_eval_batch_size=3, eval_samples=2))
    )
    assert (plan.eval_batch_size, plan.eval_samples) == (3, 2)
    assert plan_for_config(validate_config(_config(tiny_llama, data)), smoke=True).eval_batch_size == 1
    off = _config(tiny_llama, data, eval_strategy="no")
    assert plan_for_config(validate_config(off)).eval_batch_size == 0
    assert plan_for_config(validate_config({**off, "data": {"path": str(data)}})).eval_batch_size == 0
    back = plan_to_config(plan, _config(tiny_llama, data))
    assert back["training"]["per_device_eval_batch_size"] == 3 and back["training"]["eval_samples"] == 2
    grpo = plan_for_draft(
        {
            "method": "grpo",
            "model": {"path": str(tiny_llama)},
            "data": {"eval_split": 0.2},
            "rewards": [{"type": "match", "column": "answer"}],
            "training": {"num_generations": 4, "num_generations_eval": 2, "per_device_eval_batch_size": 6},
        }
    )
    assert (grpo.eval_batch_size, grpo.eval_generations) == (6, 2)
    assert plan_to_config(grpo, {"method": "grpo"})["training"]["num_generations_eval"] == 2


def test_the_clis_name_the_evaluation_when_an_eval_batch_makes_it_the_peak(tiny_llama, tmp_path, capsys):
    import yaml

    from core.estimate.cli import main
    from core.train.cli import dry_run

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": "q", "output": "a"}) + "\n" for _ in range(20)))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_config(tiny_llama, data, per_device_train_batch_size=1)))
    # eval batch 8 (the default) on a GPU: the fused head's tile of 8 x 63 tokens outgrows the step's of 63
    assert main(["--config", str(path), "--gpu-gb", "24"]) == 0
    table = capsys.readouterr().out
    assert "peak phase: eval;" in table and "evaluation phase:" in table and "the run's peak" in table
    assert "largest eval batch (per_device_eval_batch_size) that fits:" in table
    assert dry_run(str(path), gpu_gb=24.0) == 0
    out = capsys.readouterr()
    record = json.loads(out.out)
    assert record["peak_phase"] == "eval" and record["evaluation"]["rows"] == 8
    assert "the peak is the evaluation phase" in out.err and "per_device_eval_batch_size that fits" in out.err
    # the same run evaluating one row at a time peaks in its training step
    assert main(["--config", str(path), "--gpu-gb", "24", "--eval-batch-size", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["peak_phase"] != "eval" and one["fit_search"]["max_eval_batch_size"] > 8


def test_nested_marked_phases_are_sub_phases_of_the_outer_one():
    import torch

    from core.tracker import main_phase_peaks, track_live_tensors

    with track_live_tensors(device="cpu") as tracker, tracker.held_phase("eval"):
        a = torch.ones(1000)
        with tracker.held_phase("generation"):
            b = torch.ones(4000)
            del b
        c = torch.ones(2000)  # back in the outer phase
        del a, c
    peaks = tracker.result().phase_peaks
    assert set(peaks) == {"eval", "eval:generation"}
    assert peaks["eval:generation"] == 5000 * 4 and peaks["eval"] == 3000 * 4
    assert main_phase_peaks(peaks) == {"eval": 5000 * 4}


# -- measured: a real smoke test evaluates one batch -------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    from core.demo.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wide"), "llama", hidden_size=128, intermediate_size=256)


def _rows(folder: Path, method: str) -> Path:
    rows = {
        "sft": lambda i: {"instruction": f"Add one to {i}", "output": f"{i + 1}"},
        "dpo": lambda i: {"prompt": f"Add one to {i}", "chosen": f"{i + 1}", "rejected": f"{i + 2}"},
    }[method]
    path = folder / f"{method}.jsonl"
    path.write_text("".join(json.dumps(rows(i)) + "\n" for i in range(40)))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("method", "samples"), [("sft", 32), ("dpo", 0)])
def test_a_smoke_test_evaluates_one_batch_within_five_percent_of_the_plan(
    wide_llama, tmp_path, method, samples
):
    """The smoke test's own measurement (the tracker over Trainer.evaluate after its step, the samples callback's
    answers a sub-phase) against the plan.json the trainer wrote for that step."""
    import yaml

    from core import rundir
    from core.train.run import run_training
    from core.train.smoke import smoke_line

    cfg = {
        "method": method,
        "model": {"path": str(wide_llama), "dtype": "float32"},
        "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0},
        "data": {"path": str(_rows(tmp_path, method)), "eval_split": 0.25},
        "training": {"max_length": 96, "max_steps": 1, "eval_samples": samples},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_training(str(path), str(tmp_path / "run"), smoke=True)
    smoke, plan = rundir.read_smoke(tmp_path / "run"), rundir.read_plan(tmp_path / "run")
    assert smoke["measured_by"] == "tracker" and smoke["eval_peak_bytes"] > 0
    assert abs(plan["phases"]["eval"] / smoke["eval_peak_bytes"] - 1) <= TOLERANCE
    assert smoke["estimate_eval_bytes"] == plan["phases"]["eval"]
    # the training step is compared on its own, beside it
    assert abs(smoke["estimate_bytes"] / smoke["peak_bytes"] - 1) <= TOLERANCE
    assert smoke["peak_phase"] != "eval" and smoke["eval_batch_size"] == 1
    if samples:  # the samples callback's greedy answers: 32 prompts of 96 tokens at once, 128 new tokens each
        measured = smoke["eval_moments"]["eval:callbacks"]
        planned = max(v for k, v in plan["evaluation"]["moments"].items() if k.startswith("samples"))
        assert abs(planned / measured - 1) <= TOLERANCE
        # their KV cache and prefill outgrow the training step: the plan names the evaluation its peak, as measured
        assert plan["peak_phase"] == "eval" and plan["evaluation"]["moment"] == "samples prefill"
        assert smoke["eval_peak_bytes"] > smoke["peak_bytes"]
    else:
        assert plan["peak_phase"] != "eval" and smoke["eval_peak_bytes"] < smoke["peak_bytes"]
    assert "eval step peak" in smoke_line(smoke) and plan["tensor_peak_bytes"] < GiB


# -- the Train form ------------------------------------------------------------------------------------------------


def test_the_train_form_proposes_the_largest_eval_batch_that_fits(
    workspace, tiny_llama, tmp_path, monkeypatch
):
    """A card sized so that 5 eval rows fit and 6 do not (the GPU driver stood in for): the form, left to choose,
    proposes 5 and writes it into the run config; a larger value typed by the user stays, with a warning."""
    from streamlit.testing.v1 import AppTest

    from core.estimate import from_config

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": "a"}) + "\n" for i in range(40)))
    cfg = _config(tiny_llama, data, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=5)
    plan = plan_for_config(validate_config(cfg), device="cuda")
    five = estimate(replace(plan, eval_batch_size=5))
    assert five.peak_phase == "eval"
    gpu_gb = (five.device_total_bytes / FIT_LIMIT + 4096) / GiB
    monkeypatch.setattr(from_config, "local_card", lambda: from_config.Card("cuda", gpu_gb, "a small GPU", 1))
    assert eval_batch_for_config(validate_config(cfg), gpu_gb, "cuda") == 5

    at = AppTest.from_file(
        str(Path(__file__).resolve().parent.parent / "pages" / "train.py"), default_timeout=180
    )
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = cfg
    at.run()
    assert not at.exception, at.exception
    assert at.number_input(key="tr_eval_batch").value == 5
    assert at.session_state["train_config"]["training"]["per_device_eval_batch_size"] == 5
    assert any("the largest eval batch that fits is 5" in c.value for c in at.caption)
    assert not [w.value for w in at.warning if "runs out of memory" in w.value]
    at.number_input(key="tr_eval_batch").set_value(8).run()  # the user's own: kept, and said not to fit
    assert at.number_input(key="tr_eval_batch").value == 8
    assert at.session_state["train_config"]["training"]["per_device_eval_batch_size"] == 8
    warned = [w.value for w in at.warning if "runs out of memory at the first evaluation" in w.value]
    assert warned and "5 is the largest that fits" in warned[0]
