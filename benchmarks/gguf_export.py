"""Peak RAM and wall time of `python -m core.gguf` on the synthetic 1.6B Llama-style base.

The base is the one benchmarks/merge_memory.py builds (its builder is imported, not copied): bf16, 1 GB
safetensors shards, written tensor by tensor in a child process. The export runs in its own child process and
its peak RSS comes from os.wait4 (ru_maxrss of exactly that process).

Goal: peak RSS <= 1.25 x the largest source shard. Verification runs as --verify quick (tensors compared block
by block, config and tokenizer read back): the logits check loads the model twice in fp32, which `--verify
auto` only chooses when RAM allows.

    python benchmarks/gguf_export.py               # the full 1.6B run (~3 GB base + ~3 GB GGUF, removed after)
    python benchmarks/gguf_export.py --layers 2    # a quick dry run of the script itself (goal not judged)
    python benchmarks/gguf_export.py --quick       # seconds: 1 layer at 1/8 width, 10 MB shards (the suite's run)

`--quick` shows the script still runs: headline printed, exit 0 even on a goal miss, non-zero on an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from merge_memory import GB, build_base, llama_config, run_measured, warm_cache  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="24 gives 1.59B parameters")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--type", default="f16", help="GGUF type to export (default f16)")
    ap.add_argument("--tmp", default=None, help="folder for the temporary files (default: system temp)")
    ap.add_argument("--build-into", default=None, help=argparse.SUPPRESS)  # internal: the builder child
    ap.add_argument(
        "--quick", action="store_true", help="1 layer at 1/8 width, 10 MB shards (goal not judged)"
    )
    args = ap.parse_args()
    if args.quick:
        args.layers, args.shard_gb = 1, 0.01
    if args.build_into:
        root = Path(args.build_into)
        cfg = llama_config(args.layers, args.quick)
        params, largest = build_base(root / "base", cfg, int(args.shard_gb * GB))
        (root / "built.json").write_text(json.dumps({"params": params, "largest_shard": largest}))
        return 0

    root = Path(tempfile.mkdtemp(prefix="gguf-bench-", dir=args.tmp))
    try:
        t0 = time.time()
        # A child's ru_maxrss starts from its parent's RSS at fork: the builder runs apart so ours stays small.
        build = [sys.executable, __file__, "--build-into", str(root), "--layers", str(args.layers)]
        build += ["--shard-gb", str(args.shard_gb)] + (["--quick"] if args.quick else [])
        subprocess.run(build, check=True, cwd=REPO)
        info = json.loads((root / "built.json").read_text())
        params, largest = info["params"], info["largest_shard"]
        n_shards = len(list((root / "base").glob("*.safetensors")))
        print(
            f"base: {params / 1e9:.2f}B params bf16 in {n_shards} shards (largest {largest / GB:.2f} GB); "
            f"built in {time.time() - t0:.0f} s"
        )
        warm_cache(root / "base")
        out = root / "model.gguf"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "core.gguf", "--model", str(root / "base"), "--out", str(out)]
        cmd += ["--type", args.type, "--verify", "quick", "--no-modelfile"]
        wall, peak, polled, _ = run_measured(cmd, env)
        size = out.stat().st_size
        report = json.loads(out.with_name(out.name + ".verify.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ratio = peak / largest
    print(f"source: largest shard {largest / GB:.2f} GB; output {size / GB:.2f} GB ({args.type})")
    print(
        f"export: wall {wall:.1f} s ({params / 1e6 / wall:.0f} M params/s), peak RSS {peak / GB:.2f} GB (polled {polled / GB:.2f} GB)"
    )
    worst = report["tensors"]["worst"]
    print(
        f"verify quick: {report['tensors']['checked']} tensors compared, worst {worst['name']} "
        f"{worst['rel_rms']:.2g}; tokenizer {report['tokenizer']['matched']}/{report['tokenizer']['judged']}"
    )
    judged = params >= 1.5e9 and not args.quick
    goal = "goal <= 1.25x" + ("" if judged else "; not judged: model below 1.5B")
    print(f"gguf_export: peak RSS {ratio:.2f}x largest shard, wall {wall:.0f} s ({goal})")
    return 0 if ratio <= 1.25 or not judged else 1


if __name__ == "__main__":
    sys.exit(main())
