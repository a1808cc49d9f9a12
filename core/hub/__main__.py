"""`python -m core.hub`: models and datasets from the Hugging Face Hub, and the cache they land in.

    python -m core.hub info ORG/NAME[@REV] [--revision R] [--dataset]   commit, files, sizes, what is cached
    python -m core.hub download ORG/NAME [--revision R]                 only the files training needs, resumable
    python -m core.hub download ORG/DATA --dataset [--subset S] [--split train]
    python -m core.hub list [--json]                                     the cache: size, revision, last use
    python -m core.hub rm ORG/NAME[@REV] [--dataset]                     never one a live run uses

HF_ENDPOINT (a mirror), HF_TOKEN and HF_HUB_OFFLINE=1 (cached ids only) are respected. Exit 0 done, 2 bad input
(one sentence on stderr), 130 interrupted (what completed is kept; the same command fetches the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime

from core.fmt import command, nbytes, run_piped, summary
from core.hub import cache, fetch, rows
from core.hub.ids import HubError, describe
from core.hub.live import parse_or_fail, remove
from core.hub.remote import facts, weights
from core.workspace import default_workspace


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, no usage dump
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=command("hub"), description=summary(__doc__))
    sub = p.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="{info,download,list,rm}"
    )
    for name, text in (
        ("info", "what the Hub has: commit, files, sizes"),
        ("download", "fetch it into the cache"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("id", help="ORG/NAME, optionally @REVISION")
        q.add_argument("--revision", help="a branch, tag or commit (default: main)")
        q.add_argument("--dataset", action="store_true", help="a dataset repo, not a model")
        q.add_argument("--subset", help="--dataset: the subset (config) to fetch")
        q.add_argument("--split", default="train", help="--dataset: the split to fetch (default train)")
    # `list` as for the runs and the queue (one verb per action); `ls`, what it was, still works
    q = sub.add_parser("list", aliases=["ls"], help="the cached models and datasets")
    q.add_argument("--json", action="store_true")
    q = sub.add_parser("rm", help="delete a cached repo (every revision, or ID@REV's)")
    q.add_argument("id")
    q.add_argument("--dataset", action="store_true")
    q.add_argument(
        "--workspace",
        default=None,
        help="whose live runs to spare (default: $LORA_COCKPIT_WORKSPACE, else ./workspace)",
    )
    return p


def info(args) -> int:
    ref = parse_or_fail(args.id, args.dataset, args.revision)
    found = facts(ref)
    print(f"{found.label()}  ({found.commit}) on {describe()}")
    if ref.repo_type == "dataset":
        data_cfg = {"subset": args.subset, "split": args.split}
        wanted = found.files if found.cached_only else rows.data_files(found, data_cfg)
    else:
        wanted = fetch.wanted_files(found)
        w = weights(found)
        if w:
            print(f"weights: {w.label()}")
    plan = fetch.plan_download(ref, list(wanted), found)
    for name in plan.files:
        mark = "cached " if name not in plan.missing else "       "
        print(f"  {mark}{nbytes(found.files.get(name, 0)):>11}  {name}")
    skipped = sorted(set(found.files) - set(plan.files))
    if skipped:
        print(f"not fetched ({len(skipped)}): {', '.join(skipped[:8])}{' ...' if len(skipped) > 8 else ''}")
    print(plan.summary() + ("" if plan.fits else f"; does not fit ({fetch.KEEP_FREE_ENV})"))
    return 0


def download(args) -> int:
    ref = parse_or_fail(args.id, args.dataset, args.revision)
    tty = sys.stdout.isatty()
    last = [0.0]

    def report(p: dict) -> None:
        now = time.monotonic()
        finished_file = p["files_done"] != report.files_done
        report.files_done = p["files_done"]
        if not (tty or finished_file or p.get("final") or now - last[0] >= 2):
            return
        last[0] = now
        line = f"download: {fetch.progress_line(p)}"
        print(f"\r{line:<100}" if tty else line, end="" if tty and not p.get("final") else "\n", flush=True)

    report.files_done = -1
    print(f"{ref} from {describe()} into {fetch.cache_dir()}", flush=True)
    if ref.repo_type == "dataset":
        folder, found = rows.fetch(ref, {"subset": args.subset, "split": args.split}, report)
    else:
        found = facts(ref)
        plan = fetch.plan_download(ref, found=found)
        print(plan.summary(), flush=True)
        folder = fetch.download(ref, report, found=found)
    print(f"done: {found.label()} in {folder}", flush=True)
    return 0


def ls(args) -> int:
    repos = cache.list_cached()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "id": r.repo_id,
                        "type": r.repo_type,
                        "size_bytes": r.size_bytes,
                        "last_used": r.last_used,
                        "revisions": [
                            {
                                "commit": v.commit,
                                "refs": list(v.refs),
                                "size_bytes": v.size_bytes,
                                "complete": v.complete,
                            }
                            for v in r.revisions
                        ],
                        "path": str(r.path),
                    }
                    for r in repos
                ]
            )
        )
        return 0
    if not repos:
        print(f"The Hugging Face cache ({fetch.cache_dir()}) holds nothing yet.")
        return 0
    for r in repos:
        used = datetime.fromtimestamp(r.last_used).strftime("%Y-%m-%d %H:%M")
        print(f"{r.repo_type:<8} {r.label():<56} {nbytes(r.size_bytes):>11}  last used {used}")
    total = sum(r.size_bytes for r in repos)
    print(f"{len(repos)} repo(s), {nbytes(total)} in {fetch.cache_dir()}")
    return 0


def rm(args) -> int:
    ref = parse_or_fail(args.id, args.dataset)
    freed = remove(args.workspace or default_workspace(), ref)
    print(f"deleted {ref}: {nbytes(freed)} freed")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except _ArgError as exc:
        print(f"error: {exc} (see {command('hub')} --help)", file=sys.stderr)
        return 2
    try:
        return {"info": info, "download": download, "list": ls, "ls": ls, "rm": rm}[args.command](args)
    except HubError as exc:
        print(
            f"\nerror: {exc}" if args.command == "download" and sys.stdout.isatty() else f"error: {exc}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(
            "\nstopped: the files already complete are kept; the same command fetches the rest.",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(130)  # without waiting for the download threads


if __name__ == "__main__":
    sys.exit(run_piped(main))
