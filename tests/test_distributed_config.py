"""The run config's distributed section: its validation (one sentence per wrong key or value), the known-bad
combinations refused with reason and fix, the GPU count of this machine (only the GPU driver is mocked: NVML and
torch.cuda's device count), and the accelerate config the engine writes, parsed by accelerate itself."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.launch import prepare_multi_gpu_env

from core import gpu
from core.estimate import from_config
from core.estimate.plan import PlanError
from core.precision import Device, resolve
from core.recipe import distributed
from core.recipe.config import ConfigError, dump_config, validate_config
from core.recipe.engine_args import bnb_config
from core.train.cli import dry_run


def minimal(**sections):
    cfg = {"model": {"path": "some/model"}, "data": {"path": "data.jsonl"}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def refused(**sections) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(minimal(**sections))
    text = str(err.value)
    assert "\n" not in text  # one sentence
    return text


def test_one_gpu_is_the_default_and_a_count_or_ids_validate():
    cfg = validate_config(minimal())
    assert cfg["distributed"]["gpus"] == 1 and cfg["distributed"]["strategy"] == "auto"
    assert distributed.world_size(cfg) == 1
    assert distributed.world_size(validate_config(minimal(distributed={"gpus": [0, 2]}))) == 2
    two_machines = {"gpus": 4, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1"}
    assert distributed.world_size(validate_config(minimal(distributed=two_machines))) == 8


@pytest.mark.parametrize(
    "values, says",
    [
        ({"gpus": 0}, "distributed.gpus must be at least 1"),
        ({"gpus": [0, 0]}, "distributed.gpus lists a GPU twice"),
        ({"gpus": [-1]}, "distributed.gpus must be a count (2) or a non-empty list of GPU ids"),
        ({"gpus": "two"}, "distributed.gpus must be a count (2) or a non-empty list of GPU ids"),
        ({"gpus": True}, "distributed.gpus must be a count (2) or a non-empty list of GPU ids"),
        ({"gpus": None}, "distributed.gpus must be a count (2) or a non-empty list of GPU ids"),
        ({"strategy": "fsd"}, "Did you mean 'fsdp'?"),
        ({"fsdp_version": 3}, "distributed.fsdp_version must be auto, 1 or 2"),
        ({"gpu": 2}, "distributed.gpu: unknown key. Did you mean distributed.gpus?"),
        ({"main_process_port": 70000}, "distributed.main_process_port must be in [1, 65535]"),
        ({"num_machines": 2}, "distributed.main_process_ip is required with num_machines > 1"),
        (
            {"num_machines": 2, "machine_rank": 2, "main_process_ip": "10.0.0.1"},
            "distributed.machine_rank 2 is not below num_machines 2",
        ),
        ({"gpus": 2, "cpu_offload": True}, "distributed.cpu_offload needs a sharding strategy"),
    ],
)
def test_a_wrong_key_or_value_is_one_sentence(values, says):
    assert says in refused(distributed=values)


def test_fsdp2_with_4bit_weights_is_refused_with_the_fsdp1_recipe():
    text = refused(
        distributed={"gpus": 2, "strategy": "fsdp", "fsdp_version": 2}, quantization={"load_in_4bit": True}
    )
    assert "bitsandbytes#1945" in text and "fsdp_version: 1" in text
    for key in (
        "fsdp_use_orig_params: false",
        "fsdp_cpu_ram_efficient_loading: true",
        "bnb_4bit_quant_storage",
    ):
        assert key in text
    # auto picks FSDP1 for a 4-bit base, FSDP2 for a 16-bit one
    qlora = validate_config(
        minimal(distributed={"gpus": 2, "strategy": "fsdp"}, quantization={"load_in_4bit": True})
    )
    assert distributed.fsdp_version(qlora) == 1
    assert (
        distributed.fsdp_version(validate_config(minimal(distributed={"gpus": 2, "strategy": "fsdp"}))) == 2
    )


def test_integer_quant_storage_cannot_be_sharded():
    text = refused(
        distributed={"gpus": 2, "strategy": "fsdp"},
        quantization={"load_in_4bit": True, "bnb_4bit_quant_storage": "uint8"},
    )
    assert "cannot be sharded" in text and "bfloat16" in text


def test_the_engine_stores_4bit_weights_in_the_compute_dtype_on_several_gpus_only():
    pytest.importorskip("bitsandbytes")
    one = validate_config(minimal(quantization={"load_in_4bit": True}))
    two = validate_config(
        minimal(distributed={"gpus": 2, "strategy": "fsdp"}, quantization={"load_in_4bit": True})
    )
    assert bnb_config(one, "bfloat16").bnb_4bit_quant_storage == torch.uint8  # unchanged on one GPU
    assert bnb_config(two, "bfloat16").bnb_4bit_quant_storage == torch.bfloat16


@pytest.mark.parametrize("strategy", ["ddp", "auto"])
def test_reentrant_checkpointing_with_ddp_is_refused(strategy):
    text = refused(
        distributed={"gpus": 2, "strategy": strategy},
        training={"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
    )
    assert "use_reentrant: false" in text and "DDP" in text
    # FSDP takes reentrant checkpointing (Answer.AI's recipe); one GPU is not DDP at all
    fsdp = {"gpus": 2, "strategy": "fsdp"}
    reentrant = {"gradient_checkpointing_kwargs": {"use_reentrant": True}}
    validate_config(minimal(distributed=fsdp, training=reentrant))
    validate_config(minimal(training=reentrant))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_zero3_without_deepspeed_installed_is_refused():
    assert "pip install deepspeed" in refused(distributed={"gpus": 2, "strategy": "deepspeed_zero3"})
    # planned for another machine (the Estimate page): what this one lacks is no problem
    elsewhere = validate_config(minimal(distributed={"gpus": 2, "strategy": "deepspeed_zero3"}), here=False)
    assert elsewhere["distributed"]["strategy"] == "deepspeed_zero3"


def test_engine_owned_library_keys_point_to_the_section():
    assert "distributed.strategy: fsdp" in refused(training={"fsdp": "full_shard"})
    assert "distributed.num_machines" in refused(training={"nnodes": 2})


# ---- the machine's GPU count: only the GPU driver (NVML, torch.cuda's count) is mocked -------------------------


class FakeNvml:
    def __init__(self, count):
        self.count = count

    def init(self):
        return None if self.count else "no NVIDIA GPU found (NVML reports 0 devices)"

    def devices(self):
        return [gpu.GpuInfo(i, "NVIDIA RTX 4090", 24 * 2**30) for i in range(self.count)]


@pytest.fixture
def driver(monkeypatch):
    def install(count):
        monkeypatch.setattr(gpu, "NvmlSource", lambda: FakeNvml(count))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return install


def test_more_gpus_than_the_box_has_is_refused_with_a_mocked_gpu_driver(driver):
    driver(2)
    card = from_config.local_card()
    assert (card.device, card.count) == ("cuda", 2)
    four = validate_config(minimal(distributed={"gpus": 4}))
    assert "asks for 4 GPUs but this machine has 2 CUDA GPUs" in from_config.gpu_problem(four, card)
    assert "names GPU 3" in from_config.gpu_problem(
        validate_config(minimal(distributed={"gpus": [0, 3]})), card
    )
    assert from_config.gpu_problem(validate_config(minimal(distributed={"gpus": [0, 1]})), card) is None
    with pytest.raises(PlanError, match="asks for 4 GPUs"):
        from_config.plan_json(four)  # this machine's card: what --dry-run and the trainer's plan.json do


def test_several_gpus_on_a_machine_without_one_is_refused_with_a_mocked_gpu_driver(driver):
    driver(0)
    card = from_config.local_card()
    problem = from_config.gpu_problem(validate_config(minimal(distributed={"gpus": 2})), card)
    assert "this machine has 0 CUDA GPUs" in problem and "gpus: 1" in problem


# ---- the accelerate config, read back by accelerate's own loader ----------------------------------------------


def write(tmp_path, strategy, **sections):
    cfg = validate_config(minimal(**sections))
    path = distributed.write_accelerate_config(cfg, tmp_path, strategy, resolve(cfg, Device.of("cuda")))
    assert path == tmp_path / "accelerate.yaml"
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)  # accelerate refuses unknown keys when it builds this
    return path, config


def launch_env(path) -> dict:
    """The environment `accelerate launch --config_file path` gives the processes (no process is started), as on
    a CUDA machine: accelerate 1.16 maps gpu_ids to CUDA_VISIBLE_DEVICES only when torch names CUDA its
    accelerator, so that answer is mocked here (the GPU driver, which this machine lacks)."""
    import torch
    from accelerate.utils import launch

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    _validate_launch_command(args)
    real = launch.get_torch_accelerator_backend
    launch.get_torch_accelerator_backend = lambda check_available=True: ("cuda", torch.cuda)
    try:
        return prepare_multi_gpu_env(args)
    finally:
        launch.get_torch_accelerator_backend = real


def test_fsdp_qlora_config_is_the_fsdp1_recipe_as_accelerate_reads_it_cuda_backend_mocked(tmp_path):
    path, config = write(
        tmp_path,
        "fsdp",
        distributed={"gpus": [0, 2], "strategy": "fsdp"},
        quantization={"load_in_4bit": True},
    )
    assert config.distributed_type == DistributedType.FSDP and config.num_processes == 2
    assert config.gpu_ids == "0,2" and config.mixed_precision == "bf16"
    env = launch_env(path)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "1"
    assert env["FSDP_USE_ORIG_PARAMS"] == "false" and env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert env["FSDP_SYNC_MODULE_STATES"] == "true" and env["CUDA_VISIBLE_DEVICES"] == "0,2"


def test_fsdp2_lora_and_ddp_configs_as_accelerate_reads_them(tmp_path):
    path, config = write(tmp_path, "fsdp", distributed={"gpus": 2, "strategy": "fsdp", "cpu_offload": True})
    env = launch_env(path)
    assert env["FSDP_VERSION"] == "2" and env["FSDP_OFFLOAD_PARAMS"] == "true"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    path, config = write(tmp_path, "ddp", distributed={"gpus": 2})
    assert config.distributed_type == DistributedType.MULTI_GPU and config.gpu_ids == "all"
    assert "ACCELERATE_USE_FSDP" not in launch_env(path)


def test_zero3_and_multi_machine_configs_as_accelerate_reads_them(tmp_path):
    machines = {"gpus": 2, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1"}
    _, config = write(tmp_path, "deepspeed_zero3", distributed={**machines, "main_process_port": 29501})
    assert config.distributed_type == DistributedType.DEEPSPEED
    assert config.deepspeed_config["zero_stage"] == 3 and config.deepspeed_config["zero3_init_flag"] is True
    assert (config.num_machines, config.machine_rank, config.num_processes) == (2, 1, 4)
    assert (config.main_process_ip, config.main_process_port) == ("10.0.0.1", 29501)


def test_auto_resolves_by_the_plan_and_one_gpu_writes_nothing(tmp_path):
    small = validate_config(minimal(model={"path": "meta-llama/Llama-2-7b-hf"}, distributed={"gpus": 2}))
    assert (
        from_config.resolve_strategy(small, gpu_gb=24.0) == "ddp"
    )  # a 7B LoRA fits one 24 GiB card... at 512
    big = validate_config(minimal(model={"path": "meta-llama/Llama-2-70b-hf"}, distributed={"gpus": 4}))
    assert from_config.resolve_strategy(big, gpu_gb=24.0) == "fsdp"
    path = from_config.write_accelerate_config(big, tmp_path, gpu_gb=24.0)
    assert load_config_from_file(str(path)).distributed_type == DistributedType.FSDP
    assert (
        from_config.write_accelerate_config(validate_config(minimal()), tmp_path / "one", gpu_gb=24.0) is None
    )


# ---- the engine: --dry-run writes the accelerate config; the launch line the supervisor starts the ranks with -----


def run_yaml(tmp_path, model_dir, **distributed_values):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"instruction": "Say {i}", "output": "{i}"}}\n' for i in range(8)))
    cfg = minimal(model={"path": str(model_dir)}, training={"max_length": 64}, distributed=distributed_values)
    cfg["data"]["path"] = str(data)
    return dump_config(cfg, tmp_path / "run.yaml")


def test_dry_run_with_a_run_dir_writes_the_accelerate_config(tiny_llama, tmp_path, capsys):
    path = run_yaml(tmp_path, tiny_llama, gpus=2, strategy="fsdp")
    assert dry_run(str(path), gpu_gb=24.0, run_dir=str(tmp_path / "run")) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["distributed"]["strategy"] == "fsdp"  # the plan per GPU
    config = load_config_from_file(str(tmp_path / "run" / "accelerate.yaml"))
    assert config.distributed_type == DistributedType.FSDP and config.num_processes == 2
    assert "accelerate config:" in out.err
    # a --run-dir that cannot hold it names --run-dir, not the model folder
    (tmp_path / "a-file").write_text("x")
    assert dry_run(str(path), gpu_gb=24.0, run_dir=str(tmp_path / "a-file")) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: --run-dir {tmp_path / 'a-file'}: accelerate.yaml cannot be written there"
    ), err


# The trainer's CLI under a spy on torch.cuda's first query (the GPU driver, mocked: this box has none).
CUDA_SPY = """
import atexit, json, os, runpy, sys
import torch

first = {}

def spy(answer):
    def query(*args, **kwargs):
        first.setdefault("env", {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")})
        return answer
    return query

torch.cuda.is_available, torch.cuda.device_count = spy(False), spy(0)
atexit.register(lambda: print("first CUDA query: " + json.dumps(first), flush=True))
sys.argv = ["core.train", *sys.argv[1:]]
runpy.run_module("core.train", run_name="__main__")
"""


@pytest.mark.slow
def test_one_process_trains_on_the_named_gpu_pinned_before_cuda_starts_mocked_gpu_driver(
    tiny_llama, tmp_path
):
    """`gpus: [1]` on one process: the trainer's CLI sets CUDA_VISIBLE_DEVICES=1 (nvidia-smi's numbering) before
    anything asks CUDA about the machine, whatever the shell had, and trains (here on the CPU)."""
    cfg = run_yaml(tmp_path, tiny_llama, gpus=[1])
    text = cfg.read_text().replace("max_length: 64", "max_length: 64\n  max_steps: 2")
    cfg.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"}
    env["CUDA_VISIBLE_DEVICES"] = "0,1"  # the shell's choice, replaced by the config's
    out = subprocess.run(
        [sys.executable, "-c", CUDA_SPY, str(cfg), "--run-dir", str(tmp_path / "run")],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    first = json.loads(out.stdout.split("first CUDA query: ")[-1].splitlines()[0])
    assert first["env"] == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "finished"


def test_pinning_picks_one_card_for_one_process_and_leaves_ranks_to_accelerate():
    def pinned(env, one_process=None, **values):
        cfg = validate_config(minimal(distributed=values))
        one = distributed.world_size(cfg) == 1 if one_process is None else one_process
        said = distributed.pin_gpus(cfg, one_process=one, environ=env)
        return env, said

    env, said = pinned({}, gpus=[2])
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2"}
    assert said == "GPU 2 (nvidia-smi's numbering: CUDA_VISIBLE_DEVICES=2)"
    env, said = pinned({"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, gpus=[2])
    assert env == {"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "CUDA_VISIBLE_DEVICES": "2"}  # the user's order kept
    assert said.endswith("in place of CUDA_VISIBLE_DEVICES=0,1)")
    # A count on one process: the first card the shell left visible, never all of them (nn.DataParallel).
    assert pinned({"CUDA_VISIBLE_DEVICES": "3,1"})[0]["CUDA_VISIBLE_DEVICES"] == "3"
    assert pinned({})[0]["CUDA_VISIBLE_DEVICES"] == "0"
    assert pinned({"CUDA_VISIBLE_DEVICES": ""})[0]["CUDA_VISIBLE_DEVICES"] == ""  # GPUs hidden: stays CPU
    # Several processes: accelerate's gpu_ids gives each rank its card; only the numbering is set here.
    assert pinned({}, gpus=[1, 3]) == ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, None)
    # ...and the smoke test of that run is one process, on the first card the config names.
    assert pinned({}, gpus=[1, 3], one_process=True)[0]["CUDA_VISIBLE_DEVICES"] == "1"


def test_one_process_that_still_sees_several_cards_is_refused_mocked_gpu_driver(monkeypatch):
    """CUDA started before the run could pin its card (an in-process caller): the Trainer would spread the one
    process over every card (nn.DataParallel), so the run is refused with the way out."""
    from core.train.model import refuse_several_cards
    from core.train.state import TrainError

    prec = resolve(validate_config(minimal()), Device.of("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(TrainError, match="sees 2 CUDA GPUs .* CUDA_VISIBLE_DEVICES"):
        refuse_several_cards(prec)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert refuse_several_cards(prec) is None


def test_the_plan_is_made_for_the_cards_the_config_names_mocked_gpu_driver():
    cards = (gpu.GpuInfo(0, "NVIDIA RTX 4090", 24 * 2**30), gpu.GpuInfo(1, "NVIDIA RTX A6000", 48 * 2**30))
    box = from_config.Card("cuda", 24.0, "the NVIDIA RTX 4090", 2, cards)

    def card(**values):
        return box.of(validate_config(minimal(distributed=values)))

    assert (card(gpus=[1]).gpu_gb, card(gpus=[1]).label) == (48.0, "the NVIDIA RTX A6000")
    assert card(gpus=[0, 1]).gpu_gb == 24.0  # several cards: the plan per GPU holds on the smallest
    assert card().gpu_gb == 24.0 and card(gpus=2).gpu_gb == 24.0
    # A process pinned to GPU 1 sees one CUDA device, yet GPU 1 is still one of the machine's.
    pinned = from_config.Card("cuda", 24.0, "the NVIDIA RTX 4090", 1, cards)
    assert from_config.gpu_problem(validate_config(minimal(distributed={"gpus": [1]})), pinned) is None
    problem = from_config.gpu_problem(validate_config(minimal(distributed={"gpus": [2]})), pinned)
    assert problem.startswith("distributed.gpus names GPU 2 but this machine has 2 CUDA GPUs")


def test_the_launch_lines_parse_as_accelerate_and_torchrun_read_them(tiny_llama, tmp_path):
    """The supervisor's command for the ranks, read back by the launchers' own parsers: accelerate with the run's
    accelerate.yaml on GPUs, torchrun (gloo) on a machine without CUDA; several machines keep their rank."""
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.run import get_args_parser

    from core.train import ranks

    cfg = validate_config(
        minimal(
            model={"path": str(tiny_llama)},
            distributed={"gpus": 2, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1"},
        )
    )
    run = tmp_path / "run"
    gpu = ranks.launch_argv(cfg, run / "config.yaml", run, on_cuda=True)
    assert gpu[1:3] == ["-m", "accelerate.commands.launch"]
    args = launch_command_parser().parse_args(gpu[3:])
    assert args.config_file == str(run / "accelerate.yaml") and args.module
    assert args.training_script == "core.train" and args.training_script_args[-1] == str(run)
    cpu = ranks.launch_argv(cfg, run / "config.yaml", run, on_cuda=False)
    assert cpu[1:3] == ["-m", "torch.distributed.run"]
    targs = get_args_parser().parse_args(cpu[3:])
    assert (targs.nproc_per_node, targs.nnodes, targs.node_rank) == ("2", "2", 1)
    assert (targs.master_addr, targs.master_port, targs.module) == ("10.0.0.1", 29500, True)
    # one machine and no port named: torchrun takes a free port (two runs of one box at once)
    cfg["distributed"].update(num_machines=1, machine_rank=0, main_process_ip=None)
    targs = get_args_parser().parse_args(ranks.launch_argv(cfg, run / "config.yaml", run, on_cuda=False)[3:])
    assert targs.standalone and (targs.nproc_per_node, targs.nnodes) == ("2", "1:1")
