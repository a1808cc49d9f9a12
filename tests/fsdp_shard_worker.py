"""One rank of tests/test_distributed_sharding.py, started by torchrun on gloo (CPU): a tiny Llama with a PEFT LoRA
adapter wrapped by raw torch FSDP2 (per decoder layer, as accelerate's TRANSFORMER_BASED_WRAP does), FSDP1 (PEFT's
wrap policy, use_orig_params=False: the QLoRA recipe) or DDP; one step; this rank's bytes of each term as JSON.
Mode qlora-fsdp1: the same FSDP1 wrap of the model loaded in 4 bits by transformers as the product loads it
(bitsandbytes NF4, double quantization, quant storage = the compute dtype, device_map = this rank's device, under
the environment accelerate's FSDP launch sets), with this rank's bytes right after loading and its quantization
constants.

    torchrun --standalone --nproc-per-node 2 tests/fsdp_shard_worker.py CONFIG_DIR MODE OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM


def local(t) -> int:
    """Bytes this rank holds of a parameter, gradient or state (a DTensor's local shard under FSDP2)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def quant_constants(model) -> int:
    """Bytes of the bitsandbytes QuantStates this rank holds (absmax, code book, the nested ones), each once."""
    held = {}
    for module in model.modules():
        for qs in (
            getattr(module, "quant_state", None),
            getattr(getattr(module, "weight", None), "quant_state", None),
        ):
            if qs is None:
                continue
            nested = [qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else []
            for t in [qs.absmax, qs.code, *nested]:
                held[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
    return sum(held.values())


def load_4bit(model_dir: str):
    """The model as core.train.model.load_model loads it for a QLoRA run on several processes."""
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32,
    )
    return AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=quant, dtype=torch.float32, device_map={"": "cpu"}
    )


def main(model_dir: str, mode: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    loaded = {}
    if mode == "qlora-fsdp1":
        model = load_4bit(model_dir)
        real = [p for p in model.parameters() if not p.is_meta]
        loaded = {"loaded": sum(local(p) for p in real) + quant_constants(model)}
    else:
        # the config only (the planner reads the same folder); the same seed gives every rank the same weights
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    )
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode in ("fsdp1", "qlora-fsdp1"):
        from peft.utils.other import fsdp_auto_wrap_policy
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=fsdp_auto_wrap_policy(model),
            use_orig_params=False,
            device_id=torch.device("cpu"),
        )
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    # as wrapped, before a step: bitsandbytes' CPU backward (0.50) leaves a few QuantState tensors of this tiny
    # model sharing storage (13,528 of 16,496 bytes counted after it); the plan is of the states as loaded
    constants = quant_constants(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3, foreach=False)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = sum(local(p.grad) for p in params if p.grad is not None)
    optimizer.step()
    states = sum(
        local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    out = {
        "frozen": sum(local(p) for p in params if not p.requires_grad),
        "trainable": sum(local(p) for p in params if p.requires_grad),
        "gradients": grads,
        "optimizer_states": states,
        "quant_constants": constants,
        **loaded,
    }
    Path(out_dir, f"{mode}-{rank}.json").write_text(json.dumps(out))
    dist.barrier()  # both ranks leave together: a rank left alone in teardown can wait on gloo forever
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
