"""The tracker against hand-counted bytes, against itself (steady state, depth extrapolation) and on the real
stacks it must survive: peft LoRA, bitsandbytes 4-bit, gradient checkpointing, transformers Trainer."""

import warnings

import pytest
import torch

from core.demo.toy import tiny_config
from core.measure.step import measure_depths, measure_plan
from core.measure.step_plan import plan_of_config, step_plan
from core.tracker import TrackerError, track_live_tensors

warnings.filterwarnings("ignore")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_step(model, batch, optimizer, *, loss_fn=None, saved_tensors=True):
    """One real training step (forward + loss, backward, optimizer.step, zero_grad(set_to_none)) under the
    tracker, with its phases named; the model output dies before backward, as in Trainer.compute_loss."""
    model.train()
    with track_live_tensors(model, optimizer, tensors=batch, saved_tensors=saved_tensors) as tr:
        tr.reset_peaks()
        with tr.phase("forward"):
            out = model(**batch) if isinstance(batch, dict) else model(batch)
            loss = loss_fn(out, batch) if loss_fn is not None else out.loss
            del out
        with tr.phase("backward"):
            loss.backward()
            del loss
        with tr.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return tr.result()


def test_single_linear_adam_step_counted_by_hand():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)  # fp32
    opt = torch.optim.AdamW(lin.parameters(), foreach=False)  # single-tensor AdamW: the temporaries below
    x = torch.randn(8, 64)
    W, b, X, OUT = 32 * 64 * 4, 32 * 4, 8 * 64 * 4, 8 * 32 * 4
    r = measure_step(lin, {"input": x}, opt, loss_fn=lambda out, batch: out.sum())

    base = W + b + X
    assert r.baseline_bytes == base
    # forward: the output and the 4-byte loss scalar
    assert r.phase_peaks["forward"] == base + OUT + 4
    # backward: the output died with the forward (nothing saves it); loss + ones_like(loss) + dW + db
    assert r.phase_peaks["backward"] == base + 4 + 4 + W + b
    # Adam state: exp_avg and exp_avg_sq per parameter + a 4-byte step counter per parameter
    state = 2 * (W + b) + 2 * 4
    assert r.optimizer_state_bytes == state
    assert r.end_bytes == base + state  # grads freed by zero_grad(set_to_none=True)
    # optimizer peak: grads + state + the weight's denominator: sqrt(exp_avg_sq) and its quotient (2 x W)
    assert r.phase_peaks["optimizer"] == base + W + b + state + 2 * W
    assert (r.peak_bytes, r.peak_phase) == (base + W + b + state + 2 * W, "optimizer")
    assert r.adopted_bytes == 0
    # nothing the Linear saves is new: it saves its input (the batch) and weight, both baseline
    assert r.saved_bytes == 0


def test_views_and_inplace_ops_are_not_new_storage():
    with track_live_tensors() as tr:
        a = torch.zeros(1000)  # 4000 B
        v = a.view(10, 100).t()  # views share a's storage
        a.add_(1)  # in place
        v2 = v[1:3]
        peak = tr.current_bytes
    assert peak == 4000 and tr.peak_bytes == 4000
    del a, v, v2


def test_tensor_made_from_python_data_is_counted():
    # torch.tensor() builds its tensor in C++ outside the dispatcher; lift_fresh is where we see it
    with track_live_tensors() as tr:
        t = torch.tensor([1.0] * 100)
        assert tr.current_bytes == 400
        assert tr.adopted_bytes == 0
        del t
        assert tr.current_bytes == 0


def test_freed_tensors_are_subtracted():
    with track_live_tensors() as tr:
        a = torch.ones(256)
        b = a * 2
        del a
        c = b + 1
        assert tr.current_bytes == 2 * 1024
        del b, c
        assert tr.current_bytes == 0
    assert tr.peak_bytes == 2 * 1024  # never more than two of a, b, c alive at once
    assert tr.peak_phase == "step"


@pytest.fixture(scope="module")
def lora_llama(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05))


def _batch(vocab=102, b=2, s=48):
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_peft_lora_step_on_tiny_llama(lora_llama):
    model = lora_llama
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    batch = _batch()
    r = measure_step(model, batch, opt)
    weights = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(b) for b in model.buffers())  # + rotary
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in trainable)  # peft keeps adapters in fp32
    assert r.baseline_bytes == weights + nbytes(batch["input_ids"])  # labels is the same tensor: counted once
    assert r.adopted_bytes == 0  # every storage the step used was registered or seen being made
    # the lazily made Adam state: 2 fp32 copies of the adapter + one step counter per adapter tensor
    assert r.optimizer_state_bytes == sum(2 * nbytes(p) + 4 for p in trainable)
    assert r.end_bytes == r.baseline_bytes + r.optimizer_state_bytes
    assert set(r.phase_peaks) == {"forward", "backward", "optimizer"}
    assert r.saved_bytes > 0 and r.peak_bytes > r.baseline_bytes + r.saved_bytes
    # a second step holds the optimizer state during forward and backward: derived from step one = measured
    r2 = measure_step(model, batch, opt)
    assert r.steady_peak_bytes == r2.peak_bytes
    assert r.steady_phase_peaks == r2.phase_peaks
    # the saved-tensor hooks observe, they do not change what is held
    r3 = measure_step(model, batch, opt, saved_tensors=False)
    assert r3.phase_peaks == r2.phase_peaks


def test_bnb_4bit_qlora_step_works_under_the_mode():
    pytest.importorskip("bitsandbytes")
    plan = step_plan("qlora", double_quant=True, batch_size=2, seq_len=32, optim="paged_adamw_8bit")
    r = measure_plan(tiny_config("llama"), plan)
    assert r.adopted_bytes == 0
    assert r.peak_bytes > r.baseline_bytes > 0
    assert r.optimizer_state_bytes > 0


def test_bnb_4bit_weights_are_counted_with_their_quantization_state(tmp_path):
    pytest.importorskip("bitsandbytes")
    from core.measure.build import build_model
    from core.tracker import module_tensors

    plan = step_plan("qlora", double_quant=False, prepare_kbit=False, lora_r=4)
    model, _ = build_model(tiny_config("llama"), plan, tmp_path)
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    n = q.in_features * q.out_features
    held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in module_tensors(q)}
    # NF4: 4 bits per weight packed in uint8, one fp32 absmax per block of 64, a 16-entry fp32 code map
    assert sum(held.values()) == n // 2 + (n // 64) * 4 + 16 * 4


@pytest.mark.slow
def test_extrapolation_from_two_and_three_layers_equals_full_depth():
    from core.tracker import main_phase_peaks

    for config, plan in (
        # LoRA with dropout under Trainer's bf16 autocast: the first layer saves less than the others
        (
            tiny_config("llama", num_hidden_layers=6),
            step_plan("lora", batch_size=2, seq_len=32, lora_dropout=0.05),
        ),
        # full fine-tuning with checkpointing and a tied embedding on the plain path (full logits): backward's
        # peak moves from its start (logits) at 2-3 layers to its end (all gradients + the tied gradient's
        # out-of-place sum) at 6 layers. (TRL's fused head on a CPU keeps backward's start the peak.)
        (
            tiny_config(
                "llama", num_hidden_layers=6, tie_word_embeddings=True, vocab_size=2000, intermediate_size=512
            ),
            step_plan("full", batch_size=1, seq_len=64, gradient_checkpointing=True, fused_lm_head=False),
        ),
    ):
        fit = measure_depths(config, plan)[plan.seq_len]
        full = measure_plan(config, plan)
        small, large = (main_phase_peaks(m.steady_phase_peaks) for m in (fit.small, fit.large))
        folded = small["backward"] + 4 * (large["backward"] - small["backward"])  # phases folded first
        if plan.tuning == "full":
            assert folded < main_phase_peaks(full.steady_phase_peaks)["backward"]  # why sub-phases exist
        assert fit.phase_peaks_at(6) == main_phase_peaks(full.steady_phase_peaks), plan
        assert fit.peak_at(6) == (full.steady_peak_bytes, full.steady_peak_phase)
        assert fit.saved_at(6) == full.saved_bytes


@pytest.mark.slow
def test_mode_around_trainer_train(tmp_path, lora_llama):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = [[1] + [5 + i % 50 for i in range(31)] for _ in range(4)]
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    trainer = Trainer(model=lora_llama, args=args, train_dataset=ds)
    with track_live_tensors(model=lora_llama) as tr:
        trainer.train()
    plain = tr.result()
    assert plain.peak_phase == "step" and plain.peak_bytes > plain.baseline_bytes
    assert tr.summary()["peak_bytes"] == plain.peak_bytes
    trainer = Trainer(model=lora_llama, args=args, train_dataset=ds)
    with track_live_tensors(model=lora_llama, auto_phases=True) as tr:
        trainer.train()
    named = tr.result()
    assert {"forward", "backward", "optimizer"} <= set(named.phase_peaks)
    assert named.peak_phase in ("forward", "backward", "optimizer")


def test_measure_config_on_a_model_folder(tiny_llama):
    from core.measure.step import measure_config

    run_config = {
        "model": {"path": str(tiny_llama), "dtype": "float32"},
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"max_length": 32},
        "training": {"per_device_train_batch_size": 1, "optim": "adamw_torch"},
    }
    out = measure_config(tiny_llama, run_config)
    m = out["measured"]
    assert m["peak_bytes"] > m["baseline_bytes"] > 0 and m["adopted_bytes"] == 0
    assert out["estimated"]["peak_phase"] == m["steady_peak_phase"]
    assert abs(out["error"]) < 0.02  # a 2-layer fp32 model: small constant terms weigh most here


def test_bad_inputs_say_what_to_fix(tmp_path):
    from core.measure.step import measure_config

    with pytest.raises(TrackerError, match="no config.json"):
        measure_config(tmp_path, {"method": "lora"})
    with pytest.raises(TrackerError, match="tuning 'dora' is not one of"):
        step_plan("dora")
    with pytest.raises(TrackerError, match="seq_len must be a whole number above zero"):
        step_plan(seq_len=0)
    with pytest.raises(TrackerError, match="attention 'flash' is not measurable here"):
        step_plan(attn="flash")
    with pytest.raises(TrackerError, match="lora.r must be"):
        plan_of_config({"lora": {"r": -1}})
    with pytest.raises(TrackerError, match="must be a torch.nn.Module"):
        track_live_tensors(model="llama")


def test_plan_of_a_run_config_reads_the_sections():
    from core.measure.step_plan import autocast_dtype

    cfg = {
        "model": {"path": "x", "dtype": "bfloat16", "attn_implementation": "eager"},
        "quantization": {"load_in_4bit": True, "bnb_4bit_use_double_quant": True},
        "lora": {"r": 32, "lora_dropout": 0.1, "target_modules": "all-linear"},
        "data": {"max_length": 1024},
        "training": {"per_device_train_batch_size": 4, "gradient_checkpointing": True, "bf16": True},
    }
    # through the one config -> plan mapping: on a CPU the trainer never autocasts, on a GPU bf16 does
    assert autocast_dtype(plan_of_config(cfg)) is None
    plan = plan_of_config(cfg, device="cuda")
    assert (plan.tuning, plan.attn, plan.lora_r, plan.seq_len, plan.batch_size) == (
        "qlora",
        "eager",
        32,
        1024,
        4,
    )
    assert plan.double_quant and plan.gradient_checkpointing and autocast_dtype(plan) == torch.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, overrides, plan",
    [
        ("lora-dropout", {}, step_plan("lora", batch_size=2, seq_len=64, lora_dropout=0.05)),
        # the plain-Trainer QLoRA path, stated explicitly (the defaults follow TRL: tests/test_estimate_trl.py)
        (
            "qlora-prepare",
            {},
            step_plan(
                "qlora",
                batch_size=2,
                seq_len=64,
                target_modules="q_proj,v_proj",
                prepare_kbit=True,
                fused_lm_head=False,
            ),
        ),
        (
            "full-gc-tied",
            {"tie_word_embeddings": True},
            step_plan("full", batch_size=1, seq_len=64, gradient_checkpointing=True),
        ),
        (
            "lora-gc-eager-8bit",
            {},
            step_plan(
                "lora",
                batch_size=2,
                seq_len=64,
                gradient_checkpointing=True,
                attn="eager",
                optim="adamw_8bit",
            ),
        ),
    ],
)
def test_planner_agrees_with_the_measured_step_on_tiny_models(tmp_path, name, overrides, plan):
    """core.estimate (device cpu) against one measured step of the same plan: the planner's terms come from
    the module code, so even a tiny model, where small terms weigh more, lands within 1%."""
    from core.measure.step_plan import estimate_for

    config = tiny_config(
        "llama", num_hidden_layers=4, vocab_size=2000, intermediate_size=256, hidden_size=128
    )
    for k, v in overrides.items():
        setattr(config, k, v)
    config.to_json_file(str(tmp_path / "config.json"))
    measured = measure_plan(config, plan)
    est = estimate_for(str(tmp_path), plan)  # the very Plan the step ran
    assert est["peak_phase"] == measured.steady_peak_phase
    assert abs(est["tensor_peak_bytes"] / measured.steady_peak_bytes - 1) < 0.01, (
        est["phases"],
        measured.phase_peaks,
    )
