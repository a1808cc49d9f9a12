"""CLI: python -m core.merge --base DIR --adapter DIR --out DIR [--dtype bf16|fp16|fp32] [--shard-size 5GB]
[--device cpu|cuda] [--verify auto|full|quick]"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from core.fmt import command, disk
from core.hub.fetch import model_path, progress_line
from core.hub.ids import HubError
from core.merge.errors import MergeError
from core.merge.progress import MergeProgress
from core.workspace import WorkspaceError

if TYPE_CHECKING:
    from core.merge.precheck import Preflight

# The --dtype choices without importing torch, so --help and argument errors answer at once.
DTYPE_CHOICES = ("bf16", "fp16", "fp32")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=command("merge"),
        description="Merge a LoRA adapter into its base model, shard by shard, verified, written atomically.",
    )
    ap.add_argument(
        "--base",
        required=True,
        help="folder of the base model (safetensors or .bin), or a Hub id ORG/NAME[@REV]",
    )
    ap.add_argument("--adapter", required=True, help="peft adapter folder (adapter_config.json + weights)")
    ap.add_argument(
        "--out",
        required=True,
        help="new export folder, anywhere you can write (never overwritten); relative to the current folder",
    )
    ap.add_argument(
        "--dtype", choices=sorted(DTYPE_CHOICES), default=None, help="output dtype (default: the base's)"
    )
    ap.add_argument("--shard-size", default="5GB", help="maximum size of an output shard (default 5GB)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the deltas are computed")
    ap.add_argument(
        "--verify",
        choices=["auto", "full", "quick"],
        default="auto",
        help="full: logits vs base+adapter (needs RAM for one fp32 model); quick: structure and spot checks",
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="merge even when --base is not the model the adapter was trained on (by the fingerprint of its "
        "weights in base_fingerprint.json, or base_model_name_or_path's config.json) or its tokenizer's "
        "vocabulary does not match --base",
    )
    args = ap.parse_args(argv)
    # transformers and the merge engine (torch) take seconds to import: only after the arguments are valid, so
    # --help and argument errors answer at once
    from transformers.utils import logging as hf_logging

    from core.merge.export import merge_at

    # The CLI prints its own progress and verdict; library progress bars and advisory warnings are noise here.

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)

    state = {"last": -1.0}

    def progress(p: MergeProgress) -> None:
        if p.phase == "merge" and p.tensors_total:
            frac = p.tensors_done / p.tensors_total
            if frac - state["last"] >= 0.1 or p.tensors_done == p.tensors_total:
                state["last"] = frac
                print(
                    f"  merged {p.tensors_done}/{p.tensors_total} tensors, {disk(p.bytes_written)} written",
                    file=sys.stderr,
                )
        elif p.phase == "verify":
            print("  verifying ...", file=sys.stderr)

    def show_preflight(pf: Preflight) -> None:
        print("preflight:")
        for line in pf.lines():
            print("  " + line)
        for note in pf.notes:
            print("  note: " + note)
        sys.stdout.flush()

    try:
        # a Hub id: its cached snapshot, fetched first when missing (a line per finished file)
        base = model_path(args.base, lambda p: print(f"download: {progress_line(p)}", flush=True))
    except HubError as e:
        print(f"error: --base: {e}", file=sys.stderr)
        return 2
    try:
        result = merge_at(
            *(Path(p).expanduser().resolve() for p in (base, args.adapter, args.out)),
            args.dtype,
            args.shard_size,
            args.device,
            args.verify,
            progress=progress,
            on_preflight=show_preflight,
            force=args.force,
        )
    except (MergeError, WorkspaceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that vanished or cannot be read mid-way: still one sentence, no trace
        print(f"error: {e.filename or 'a file'}: {e.strerror or e}.", file=sys.stderr)
        return 2
    for line in result.verification.lines():
        print(line)
    print(
        f"exported {result.out_dir}: {len(result.files)} files, {disk(result.total_bytes)}, in {result.seconds:.1f} s"
    )
    print(f"peak RSS {disk(result.peak_rss)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
