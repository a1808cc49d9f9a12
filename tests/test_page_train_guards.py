"""The Train page's guards before a launch (issue #51 section 3), through AppTest on real components: a Python
reward that names a function its file lacks is a preflight error naming the editor's row; a smoke test's result
shows only while the form holds the settings it ran; a launch beside a live run is said and waits for the user."""

import time
from pathlib import Path

import pytest

from core import procs, stopping
from tests.conftest import stand_in_run
from tests.test_page_train import _page, tiny_config
from tests.test_page_train_grpo import grpo_form_config


@pytest.fixture()
def live_run(workspace):
    with stand_in_run(workspace / "runs" / "earlier-run", 120) as run_dir:
        yield run_dir


def _errors(at) -> list[str]:
    return [e.value for e in at.error]


def _own_reward_third(at, path: Path, function: str) -> None:
    """The user's steps: add a Python reward after the two there are (the editor's 'Reward 3'), point it at the
    file, name the function, tick 'Run my reward code'."""
    at.selectbox(key="tr_rw_new").set_value("python").run()
    at.button(key="tr_rw_add").click().run()
    at.text_input(key="tr_rw2_path").set_value(str(path)).run()
    at.text_input(key="tr_rw2_function").set_value(function).run()
    at.checkbox(key="tr_rw2_trust_code").check().run()
    assert not at.exception, at.exception


def _two_rewards(model: Path, data: Path) -> dict:
    return grpo_form_config(
        model, data, rewards=[{"type": "match", "column": "answer"}, {"type": "format", "pattern": "[A-Z]+"}]
    )


def test_a_reward_naming_a_function_its_file_lacks_stops_preflight_naming_the_editors_row(
    workspace, tiny_llama, prompts, own_reward
):
    """Preflight said 'no problems found' and Launch was enabled; only the smoke test failed, naming rewards[0]
    and rewards[2] for the editor's Reward 3, with 'Fix: Fix'."""
    at = _page(workspace, _two_rewards(tiny_llama, prompts))
    _own_reward_third(at, own_reward, "nope")
    said = [e for e in _errors(at) if "nope" in e]
    assert said == [
        f"**reward**: Reward 3: {own_reward} has no top-level function 'nope' (it defines reward): set its "
        "function to one of them, or define nope there."
    ], _errors(at)
    assert not any(s.value.startswith("Preflight: no problems") for s in at.success)
    assert at.button(key="tr_launch").disabled
    at.text_input(key="tr_rw2_function").set_value("reward").run()  # the fix the sentence gives
    assert not _errors(at), _errors(at)
    assert any(s.value.startswith("Preflight: no problems") for s in at.success)
    assert not at.button(key="tr_launch").disabled


@pytest.mark.slow  # a real smoke-test process (it stops in the trainer's preflight): ~15 s
def test_a_smoke_failure_shows_only_while_the_form_holds_the_settings_it_ran(
    workspace, tiny_llama, prompts, own_reward
):
    """A GRPO smoke failure stayed above Launch through later edits (and after Reset, back to SFT)."""
    from core.runs.admin import latest_smoke, smoke_result

    at = _page(workspace, _two_rewards(tiny_llama, prompts))
    _own_reward_third(at, own_reward, "nope")
    at.button(key="tr_smoke").click().run()
    run = latest_smoke(workspace, at.text_input(key="tr_name").value)
    deadline = time.time() + 300
    while smoke_result(run) is None and time.time() < deadline:
        time.sleep(0.2)
    at.run()
    failed = [e for e in _errors(at) if e.startswith("Smoke test failed")]
    assert len(failed) == 1 and "Reward 3:" in failed[0] and "has no top-level function 'nope'" in failed[0]
    assert "Fix: Fix" not in failed[0] and "rewards[" not in failed[0], failed
    at.text_input(key="tr_rw2_function").set_value(
        "reward"
    ).run()  # other settings: the failure is not theirs
    assert not any(e.startswith("Smoke test failed") for e in _errors(at)), _errors(at)
    assert any(
        c.value == f"The last smoke test ({run.name}) ran other settings: run one for these."
        for c in at.caption
    )
    at.number_input(key="tr_num_generations").set_value(4).run()  # and through later edits
    assert not any(e.startswith("Smoke test failed") for e in _errors(at)), _errors(at)
    at.number_input(key="tr_num_generations").set_value(2).run()
    at.text_input(key="tr_rw2_function").set_value("nope").run()  # the settings it ran: its result again
    assert any(e.startswith("Smoke test failed") for e in _errors(at)), _errors(at)


def test_a_launch_beside_a_live_run_is_said_and_waits_for_the_user_to_insist(
    workspace, tiny_llama, live_run, tmp_path
):
    import json

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    at = _page(workspace, tiny_config(tiny_llama, data))
    said = [w.value for w in at.warning if "earlier-run" in w.value]
    assert said == [
        "Run earlier-run (step 3 of 100) is still training on this machine: a run launched now trains beside it "
        "(on one GPU, both can run out of memory), so add this one to the queue to start it when the machine is "
        "free, or launch beside it if you know it fits."
    ]
    assert at.button(key="tr_launch").disabled
    assert not at.button(key="tr_queue").disabled  # the way offered
    at.checkbox(key="tr_beside").check().run()  # the user insists
    assert not at.button(key="tr_launch").disabled
    assert not at.exception, at.exception


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_what_is_queued_beside_a_live_run_waits_for_it_to_end(
    workspace, tiny_llama, live_run, tmp_path, device
):
    """Add to queue, the way the warning offers: the supervisor started a queued run at once beside a run launched
    by hand (it counted only its own runs), on a CPU and on one GPU alike."""
    import json

    from core.recipe.config import validate_config
    from core.runs import queue as Q
    from core.runs.supervisor import next_entry

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    plan = {"verdict": "fits", "device_total_bytes": 1 << 20, "plan": {"device": device}}
    entry = Q.add(workspace, validate_config(tiny_config(tiny_llama, data)), "queued-run", plan=plan)
    assert next_entry(workspace, Q.read_queue(workspace)) is None  # earlier-run still trains
    stopping.kill_tree(procs.read_pid_info(live_run)["pid"])
    assert stopping.wait_gone(live_run, 30)
    assert next_entry(workspace, Q.read_queue(workspace)).id == entry.id  # its turn once the machine is free
