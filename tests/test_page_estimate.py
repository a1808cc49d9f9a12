"""The Estimate page through Streamlit's AppTest: renders, reacts to inputs, reports bad input without crashing."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.estimate.cards import CARDS

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "estimate.py")
CARD = {c.name: c.label for c in CARDS}  # the GPU list's entries by card name


def _app() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    return at


def _verdict(at) -> str:
    texts = [m.value for m in (*at.success, *at.warning, *at.error)]
    return next(t for t in texts if t.startswith("**"))


@pytest.mark.slow  # first import of transformers/peft and the meta builds: ~10 s
def test_renders_the_bill_and_stores_the_plan():
    at = _app()
    assert at.title[0].value == "Estimate"
    assert len(at.get("vega_lite_chart")) >= 3  # the stacked bill + two curves
    assert any("What would make it fit" in s.value for s in at.subheader)
    cfg = at.session_state["estimate_config"]  # the page edits a run config: the Train page's vocabulary
    assert cfg["model"]["path"] == at.selectbox(key="es_model").value and cfg["lora"]["enabled"]
    assert any("max_length" in c.value for c in at.code)  # shown as the YAML it would hand over
    assert [m.label for m in at.metric][:4] == ["Tensor peak", "Reserved peak", "Device total", "Peak phase"]


def test_changing_inputs_changes_the_verdict():
    at = _app()
    at.selectbox(key="es_model").set_value("Qwen/Qwen2.5-0.5B")
    at.number_input(key="es_max_length").set_value(512)
    at.selectbox(key="es_gpu").set_value(CARD["H200"])
    at.run()
    assert not at.exception
    assert _verdict(at).startswith("**FITS**")
    at.selectbox(key="es_model").set_value("meta-llama/Llama-3.1-70B")
    at.radio(key="es_tuning").set_value("full")
    at.selectbox(key="es_gpu").set_value(CARD["RTX 4090"])
    at.run()
    assert not at.exception
    assert _verdict(at).startswith("**DOES NOT FIT**")
    assert at.session_state["estimate_config"]["lora"]["enabled"] is False


def test_bad_inputs_show_an_error_not_an_exception(tmp_path):
    at = _app()
    at.number_input(key="es_batch").set_value(0)
    at.run()
    assert not at.exception
    # issue #51: the field by the label the user sees on the form, the key after it for the YAML
    assert any(
        e.value.startswith("Batch size (per device) (training.per_device_train_batch_size) must be")
        for e in at.error
    ), [e.value for e in at.error]

    at.number_input(key="es_batch").set_value(1)
    at.selectbox(key="es_optim").set_value("sgd")
    at.selectbox(key="es_model").set_value("Local model folder…")
    at.run()
    at.text_input(key="es_model_path").set_value(str(tmp_path))
    at.run()
    assert not at.exception
    assert any("no config.json" in e.value for e in at.error)


def test_estimate_is_the_default_page_of_the_router():
    at = AppTest.from_file(str(Path(PAGE).parent.parent / "dashboard.py"), default_timeout=120)
    at.run()
    assert not at.exception
    assert at.title[0].value == "Estimate"
    assert _verdict(at).startswith("**")


def test_sweeps_stop_where_the_card_line_is_readable_and_every_table_is_labelled():
    """Issue #16: the length sweep ran to 131,072 tokens (Llama-3.1's positions) and flattened the card line;
    'Every term in bytes' ended with an unlabelled JSON."""
    import pyarrow as pa

    at = _app()
    at.selectbox(key="es_model").set_value("meta-llama/Llama-3.1-8B").run()
    assert not at.exception
    frames = [
        pa.ipc.open_stream(d.data.data).read_all().to_pandas()
        for c in at.get("vega_lite_chart")
        for d in c.proto.datasets
    ]
    seq_values = [v for f in frames if "seq_len" in f for v in f["seq_len"]]
    assert seq_values and max(seq_values) < 131_072
    assert not at.json  # the per-phase figures are a labelled table
    assert any("Tensor bytes at the peak of each phase" in c.value for c in at.caption)


def test_the_target_band_is_drawn_over_the_bars_in_a_colour_no_segment_uses():
    """Issue #16: the green 85–90% band was the bill chart's first layer, hidden under the stacked bars (and
    the activations segment was green too)."""
    import json

    at = _app()
    chart, bill = next(
        (c, s)
        for c in at.get("vega_lite_chart")
        for s in [json.loads(c.proto.spec)]
        if any(_mark(layer) == "bar" for layer in s.get("layer", []))
    )
    marks = [_mark(layer) for layer in bill["layer"]]
    assert marks.index("rect") > marks.index("bar"), marks  # drawn after (over) the bars
    bars = bill["layer"][marks.index("bar")]
    band = bill["layer"][marks.index("rect")]["mark"]
    segment_colours = {c.lower() for c in bars["encoding"]["color"]["scale"]["range"]}
    components = {v for d in chart.proto.datasets for v in _column(d, "component")}
    assert components and len(segment_colours) >= len(components)  # every segment has its own colour
    for key in ("fill", "stroke"):
        assert band[key].lower() not in segment_colours, (key, band[key])
    assert band["fillOpacity"] < 1  # the bars stay readable through it
    caption = next(c.value for c in at.caption if "target" in c.value)
    assert caption.startswith("Green band: the 85–90% target")


def _mark(layer: dict) -> str:
    mark = layer.get("mark")
    return mark.get("type") if isinstance(mark, dict) else mark


def _column(dataset, name: str) -> list:
    import pyarrow as pa

    frame = pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()
    return list(frame[name]) if name in frame else []


def test_levers_are_toggles_with_their_savings_costs_and_modelled_markers():
    """Issue #12: the levers as toggles; a plan that no single change fits gets a combined suggestion first,
    each suggestion with its cost; GPU-only levers are marked as modelled; offloading shows its pinned CPU RAM."""
    at = _app()
    at.selectbox(key="es_model").set_value("meta-llama/Llama-3.1-8B")
    at.number_input(key="es_batch").set_value(8)
    at.number_input(key="es_max_length").set_value(16384)
    at.selectbox(key="es_gpu").set_value(CARD["RTX 4090"])
    at.run()
    assert not at.exception
    assert _verdict(at).startswith("**DOES NOT FIT**")
    advice = [m.value for m in at.markdown if m.value[:3] in ("1. ", "2. ", "3. ")]
    assert advice and advice[0].startswith("1. **Combined:**") and "→ fits" in advice[0], advice
    assert all("cost:" in a for a in advice)
    levers = at.dataframe[-1].value
    assert {"lever", "saves GiB", "costs", "planner term"} <= set(levers.columns)
    assert "modelled, not yet measured" in set(levers["planner term"])
    assert not any("pinned CPU RAM" in i.value for i in at.info)
    for key in ("es_ckpt", "es_offload", "es_liger"):
        at.checkbox(key=key).check()
    at.run()
    assert not at.exception
    assert any("pinned CPU RAM" in i.value for i in at.info)
    assert any("not yet measured" in c.value for c in at.caption)
    training = at.session_state["estimate_config"]["training"]  # the levers as the run config's keys
    assert (
        training["activation_offloading"]
        and training["use_liger_kernel"]
        and training["gradient_checkpointing"]
    )


def test_the_data_lengths_from_the_train_page_give_the_real_batch_next_to_the_bound():
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["data_lengths"] = [100, 300, 250, 90, 40]
    at.run()
    at.checkbox(key="es_padding_free").check()
    at.selectbox(key="es_attn").set_value("flash_attention_2")
    at.number_input(key="es_batch").set_value(4)
    at.number_input(key="es_max_length").set_value(2048)
    at.run()
    assert not at.exception
    text = next(i.value for i in at.info if "largest batch the sampler" in i.value)
    assert "740 tokens" in text and "bound: 8,192" in text  # 300 + 250 + 100 + 90 of 4 x 2048


def test_a_plan_that_fits_is_told_it_needs_nothing():
    """Issue #21 item 21: 'What would make it fit' listed changes for a plan at 31% of the card."""
    at = _app()
    at.selectbox(key="es_model").set_value("Qwen/Qwen2.5-0.5B")
    at.selectbox(key="es_gpu").set_value(CARD["H200"])
    at.run()
    assert not at.exception and _verdict(at).startswith("**FITS**")
    assert any(m.value.startswith("Nothing: it fits (") for m in at.markdown)
    assert not [m.value for m in at.markdown if m.value[:3] in ("1. ", "2. ")]
    every = next(m.value for m in at.markdown if m.value.startswith("**With every memory lever on**"))
    assert "LoRA dropout 0" in every  # named as left out, though the table lists it


def test_several_gpus_give_a_verdict_per_gpu():
    """Issue #22: the number of GPUs and the strategy on the page; the verdict is per GPU."""
    at = _app()
    at.selectbox(key="es_model").set_value("meta-llama/Llama-2-70b-hf")
    at.radio(key="es_tuning").set_value("qlora")
    at.selectbox(key="es_gpu").set_value(CARD["RTX 4090"])
    at.run()
    assert _verdict(at).startswith("**DOES NOT FIT**")
    assert not [w for w in at.warning if "Per-GPU figures" in w.value]
    at.text_input(key="es_gpus").set_value("4")
    at.selectbox(key="es_strategy").set_value("fsdp")
    at.run()
    assert not at.exception
    # every GPU first loads the whole 4-bit model (34 GiB): FSDP divides the step, not that moment
    assert _verdict(at).startswith("**DOES NOT FIT**")
    assert [w for w in at.warning if w.value.startswith("Every GPU first loads the whole 4-bit model")]
    at.selectbox(key="es_gpu").set_value(CARD["RTX A6000 / RTX 6000 Ada"])
    at.run()
    verdict = _verdict(at)
    assert verdict.startswith("**FITS**") and "per GPU (4 GPUs, fsdp)" in verdict, verdict
    assert at.session_state["estimate_config"]["distributed"]["gpus"] == 4
    # the per-GPU model is checked against published figures only: the page says how far to trust it
    assert [w for w in at.warning if w.value.startswith("Per-GPU figures are checked against published")]


def test_the_gpu_list_names_the_cards_users_own_and_takes_a_size_of_its_own():
    """Issue #40 item 4: sizes only (24/32/48/80/141 GiB), no 12 or 16 GiB, no custom size."""
    at = _app()
    gpu = at.selectbox(key="es_gpu")
    for name in ("RTX 3060", "RTX 4060 Ti", "RTX 3090", "RTX 4090", "RTX 5090", "L40S / L40", "A100 40GB"):
        assert CARD[name] in gpu.options, gpu.options
    assert {"A100 80GB", "H100 80GB", "H200", "RTX A6000 / RTX 6000 Ada"} <= set(CARD)
    assert gpu.value == CARD["RTX 4090"]  # no GPU here: the card most users of the app own
    assert "RTX 4090 · 24 GB (23.99 GiB)" in gpu.options  # the box's size and what nvidia-smi reports
    gpu.set_value(CARD["RTX 3060"]).run()
    assert " of 12.00 GiB (" in _verdict(at)
    at.selectbox(key="es_gpu").set_value("Custom size…").run()
    at.number_input(key="es_gpu_custom_gib").set_value(20.0).run()
    assert not at.exception
    assert " of 20.00 GiB (" in _verdict(at)


def test_qlora_is_a_fine_tuning_choice_beside_lora():
    """Issue #40 item 4: QLoRA was 'LoRA + 4-bit', two checkboxes; the CLI has --tuning qlora."""
    at = _app()
    tuning = at.radio(key="es_tuning")
    assert tuning.options == ["LoRA", "QLoRA (4-bit base)", "Full fine-tune"] and tuning.value == "lora"
    assert at.selectbox(key="es_quant_type").disabled  # the 4-bit settings wait for QLoRA
    lora_total = at.metric[2].value
    tuning.set_value("qlora").run()
    assert not at.exception
    cfg = at.session_state["estimate_config"]
    assert cfg["lora"]["enabled"] and cfg["quantization"]["load_in_4bit"]
    assert not at.selectbox(key="es_quant_type").disabled
    assert at.metric[2].value != lora_total  # the 4-bit base plans less
    at.radio(key="es_tuning").set_value("full").run()
    cfg = at.session_state["estimate_config"]
    assert not cfg["lora"]["enabled"] and not cfg["quantization"]["load_in_4bit"]
    assert at.number_input(key="es_r").disabled


def test_an_unreachable_hub_id_suggests_the_nearest_preset_by_name(monkeypatch):
    """Issue #40 item 4: 'Qwen/Qwen2.5-7B-Instruct' offline and not in the cache suggested Llama-2 presets."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-hub-cache")  # nothing cached: the id cannot be reached
    at = _app()
    at.selectbox(key="es_model").set_value("Local model folder…").run()
    at.text_input(key="es_model_path").set_value("Qwen/Qwen2.5-7B-Instruct").run()
    assert not at.exception
    error = next(e.value for e in at.error if "Unknown model" in e.value)
    assert "The nearest bundled preset by name is Qwen/Qwen2.5-7B (the same architecture" in error, error
    assert "Llama-2" not in error
    at.text_input(key="es_model_path").set_value("nobody/unrelated-thing").run()
    error = next(e.value for e in at.error if "Unknown model" in e.value)
    assert "Pick a bundled preset such as" in error  # nothing near by name: a few to pick from


def test_a_hybrids_recurrent_layers_are_planned_on_the_path_the_user_picks(tmp_path):
    """The target machine's choice: the plan of a Qwen3.5 twin differs on transformers' torch code and on the
    CUDA kernels, and says which one it planned."""
    from transformers import AutoConfig

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    AutoConfig.for_model("qwen3_5_text", num_key_value_heads=2, **fields).save_pretrained(tmp_path)
    at = _app()
    at.selectbox(key="es_model").set_value("Local model folder…")
    at.run()
    at.text_input(key="es_model_path").set_value(str(tmp_path))
    at.number_input(key="es_max_length").set_value(2048)
    peaks, notes = {}, {}
    for path in ("torch", "kernels"):
        at.selectbox(key="es_recurrent_kernels").set_value(path)
        at.run()
        assert not at.exception, at.exception
        assert at.session_state["estimate_options"]["recurrent_kernels"] == path
        peaks[path] = next(m.value for m in at.metric if m.label == "Tensor peak")
        notes[path] = [w.value for w in at.warning if "Recurrent layers planned" in w.value]
    assert peaks["torch"] != peaks["kernels"], peaks
    assert "the torch path (recurrent_kernels torch)" in notes["torch"][0]
    assert "its CUDA kernels (recurrent_kernels kernels)" in notes["kernels"][0]
