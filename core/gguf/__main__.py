"""Convert a model folder to a GGUF file for llama.cpp / Ollama / LM Studio, verified, with an Ollama Modelfile.

python -m core.gguf --model DIR --out FILE.gguf --type f16 [--verify auto|full|quick|none]

Exit 0: written and verified. Exit 1: the export or its verification failed (nothing at --out).
Exit 2: bad input (one sentence on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from core.fmt import command, summary


def main(argv: list[str] | None = None) -> int:
    from core.gguf import (
        ALL_TYPES,
        VERIFY_MODES,
        BadInput,
        ExportError,
        export_gguf,
        report_path,
        summary_lines,
    )

    ap = argparse.ArgumentParser(prog=command("gguf"), description=summary(__doc__))
    ap.add_argument(
        "--model", required=True, help="local HF model folder (safetensors), or a Hub id ORG/NAME[@REV]"
    )
    ap.add_argument("--out", required=True, help="the .gguf file to create (never overwritten)")
    ap.add_argument("--type", default="f16", help=f"one of {', '.join(ALL_TYPES)} (default f16)")
    ap.add_argument("--verify", default="auto", help=f"one of {', '.join(VERIFY_MODES)} (default auto)")
    ap.add_argument("--name", default=None, help="general.name in the GGUF (default: the folder name)")
    ap.add_argument("--no-modelfile", action="store_true", help="do not write an Ollama Modelfile")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the summary")
    args = ap.parse_args(argv)

    # SIGTERM unwinds like Ctrl-C, so the temporary file is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = export_gguf(
            args.model,
            args.out,
            args.type,
            args.verify,
            name=args.name,
            modelfile=not args.no_modelfile,
        )
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ExportError as e:
        print(f"error: {e} Nothing was written to {args.out}.", file=sys.stderr)
        if e.report:
            print(f"report: {report_path(Path(args.out).absolute())}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print("\n".join(summary_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
