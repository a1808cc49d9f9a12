"""Peak RAM and wall time: our streaming merge vs peft's merge_and_unload + save_pretrained.

Builds a synthetic Llama-style base (>= 1.5B parameters, bf16, several safetensors shards) tensor by tensor
without ever holding the whole model, and a LoRA adapter on every linear layer; then runs each merge in its
own subprocess and reads that child's peak RSS from os.wait4 (ru_maxrss of exactly that process).

Goal: our peak RSS <= 1.25 x (largest base shard + adapter file), and our wall time <= peft's.
Our side runs with --verify quick (structure, merged rows re-read, config/tokenizer load): the logits check
loads a whole fp32 model and is chosen by `--verify auto` only when RAM allows; peft's side verifies nothing.

    python benchmarks/merge_memory.py            # the full >= 1.5B run (~10 GB of temp files, removed after)
    python benchmarks/merge_memory.py --layers 2 # a quick dry run of the script itself (goal not judged)
    python benchmarks/merge_memory.py --quick    # seconds: 1 layer at 1/8 width, 10 MB shards (the suite's run)

`--quick` shows the script still runs: headline printed, exit 0 even on a goal miss, non-zero on an error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GB = 1024**3

PEFT_SIDE = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
model.save_pretrained(out, max_shard_size="1GB")
"""


def llama_config(layers: int, quick: bool = False) -> dict:
    """A Llama 2048 wide (1.59B parameters at 24 layers) of `layers` layers; `quick`: its widths cut to 1/8."""
    width = 8 if quick else 1
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=32000,
        hidden_size=2048 // width,
        intermediate_size=8192 // width,
        num_hidden_layers=layers,
        num_attention_heads=32 // width,
        num_key_value_heads=8 // width,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )


def weight_shapes(cfg: dict) -> list[tuple[str, tuple]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    shapes = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def build_base(out: Path, cfg: dict, shard_bytes: int) -> tuple[int, int]:
    """Random bf16 weights written shard by shard (one shard in memory at most). Returns (params, largest shard)."""
    import torch
    from safetensors.torch import save_file

    from core.demo.toy import build_tokenizer

    out.mkdir(parents=True)
    shapes = weight_shapes(cfg)
    groups, size = [[]], 0
    for key, shape in shapes:
        nbytes = 2 * math.prod(shape)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, shape))
        size += nbytes
    weight_map, total, params = {}, 0, 0
    gen = torch.Generator().manual_seed(0)
    for g, group in enumerate(groups):
        name = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key, shape in group:
            if key.endswith("norm.weight"):
                tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            weight_map[key] = name
            params += tensors[key].numel()
            total += tensors[key].numel() * 2
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(cfg))
    build_tokenizer(out)
    largest = max(f.stat().st_size for f in out.glob("*.safetensors"))
    return params, largest


def build_adapter(out: Path, base: Path, cfg: dict, r: int = 16) -> int:
    """A LoRA adapter on every linear layer of every block (what `all-linear` selects)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for key, shape in weight_shapes(cfg):
        mod = key.removesuffix(".weight")
        if mod.rsplit(".", 1)[-1] in targets:
            out_f, in_f = shape
            tensors[f"base_model.model.{mod}.lora_A.weight"] = torch.randn(r, in_f, generator=gen) * 0.01
            tensors[f"base_model.model.{mod}.lora_B.weight"] = torch.randn(out_f, r, generator=gen) * 0.01
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=targets,
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base),
    ).save_pretrained(str(out))
    return (out / "adapter_model.safetensors").stat().st_size


def run_measured(cmd: list[str], env: dict) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS bytes from wait4, peak RSS from polling, stderr tail) of one child process."""
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    polled = {"peak": 0}

    def poll():
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                polled["peak"] = max(polled["peak"], p.memory_info().rss)
            except psutil.Error:
                break
            time.sleep(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    watcher.join(timeout=1)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return wall, usage.ru_maxrss * 1024, polled["peak"], stderr[-2000:]


def warm_cache(folder: Path) -> None:
    # Both sides should read the base from the page cache, not one from disk and one from memory.
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 * 1024 * 1024):
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="24 gives 1.59B parameters")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--tmp", default=None, help="folder for the temporary models (default: system temp)")
    ap.add_argument("--build-into", default=None, help=argparse.SUPPRESS)  # internal: the builder child
    ap.add_argument(
        "--quick", action="store_true", help="1 layer at 1/8 width, 10 MB shards (goal not judged)"
    )
    args = ap.parse_args()
    if args.quick:
        args.layers, args.shard_gb = 1, 0.01
    if args.build_into:
        root, cfg = Path(args.build_into), llama_config(args.layers, args.quick)
        params, largest = build_base(root / "base", cfg, int(args.shard_gb * GB))
        adapter_bytes = build_adapter(root / "adapter", root / "base", cfg)
        info = {"params": params, "largest_shard": largest, "adapter_bytes": adapter_bytes}
        (root / "built.json").write_text(json.dumps(info))
        return 0

    root = Path(tempfile.mkdtemp(prefix="merge-bench-", dir=args.tmp))
    try:
        t0 = time.time()
        # Built in a child process: a child's ru_maxrss starts from its parent's RSS at fork, so the parent
        # must stay small for wait4's figures to mean anything.
        build = [
            sys.executable,
            __file__,
            "--build-into",
            str(root),
            "--layers",
            str(args.layers),
            "--shard-gb",
            str(args.shard_gb),
        ] + (["--quick"] if args.quick else [])
        subprocess.run(build, check=True, cwd=REPO)
        info = json.loads((root / "built.json").read_text())
        params, largest_shard, adapter_bytes = info["params"], info["largest_shard"], info["adapter_bytes"]
        n_shards = len(list((root / "base").glob("*.safetensors")))
        print(
            f"base: {params / 1e9:.2f}B params bf16 in {n_shards} shards (largest {largest_shard / GB:.2f} GB), "
            f"adapter {adapter_bytes / GB:.3f} GB; built in {time.time() - t0:.0f} s"
        )
        ws = root / "ws"
        ws.mkdir()
        env = dict(
            os.environ, LORA_COCKPIT_WORKSPACE=str(ws), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
        )
        warm_cache(root / "base")
        ours_cmd = [
            sys.executable,
            "-m",
            "core.merge",
            "--base",
            str(root / "base"),
            "--adapter",
            str(root / "adapter"),
            "--out",
            str(ws / "exports" / "ours"),  # the CLI resolves relative paths from its current folder
            "--shard-size",
            f"{args.shard_gb}GB",
            "--verify",
            "quick",
        ]
        ours = run_measured(ours_cmd, env)
        shutil.rmtree(ws / "exports", ignore_errors=True)  # free the disk before peft's copy
        warm_cache(root / "base")
        peft_cmd = [
            sys.executable,
            "-c",
            PEFT_SIDE,
            str(root / "base"),
            str(root / "adapter"),
            str(root / "peft"),
        ]
        theirs = run_measured(peft_cmd, env)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    budget = 1.25 * (largest_shard + adapter_bytes)
    print(f"ours: wall {ours[0]:.1f} s, peak RSS {ours[1] / GB:.2f} GB (polled {ours[2] / GB:.2f} GB)")
    print(
        f"peft merge_and_unload + save_pretrained: wall {theirs[0]:.1f} s, peak RSS {theirs[1] / GB:.2f} GB "
        f"(polled {theirs[2] / GB:.2f} GB)"
    )
    print(
        f"peak RSS ratio peft/ours: {theirs[1] / ours[1]:.2f}x; wall time ratio ours/peft: {ours[0] / theirs[0]:.2f}"
    )
    ratio = ours[1] / (largest_shard + adapter_bytes)
    judged = params >= 1.5e9 and not args.quick
    ok = ours[1] <= budget and ours[0] <= theirs[0]
    goal = "goal <= 1.25x and wall time <= peft's" + ("" if judged else "; not judged: model below 1.5B")
    print(
        f"merge_memory: peak RSS {ratio:.2f}x (largest shard + adapter), wall {ours[0] / theirs[0]:.2f}x peft's "
        f"({goal})"
    )
    return 0 if ok or not judged else 1


if __name__ == "__main__":
    sys.exit(main())
