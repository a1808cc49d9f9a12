"""The export as a whole: plan, stream into a temporary file beside --out, verify, and only then rename.

The temporary file lives in a private folder `.<name>.<pid>.partial/` beside --out (same filesystem, so the
final step is a rename; a folder of its own, so transformers' loaders see no other tokenizer files). --out is
created with a hard link, which fails rather than replace a file that appeared meanwhile. A killed export
leaves only that hidden folder, which the next export to the same target removes.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core import tempdirs
from core.files import atomic_write_text, disk_needed, disk_shortfall
from core.fmt import disk
from core.gguf.modelfile import write_modelfile
from core.gguf.source import BadInput, open_source
from core.gguf.tensors import K_TYPES, TYPES, plan_tensors
from core.gguf.verify import full_check_fits, verify
from core.gguf.vocab import byte_rows, load_source_tokenizer, read_vocab
from core.gguf.writer import ProgressFile, progress_path, write_gguf
from core.hub.fetch import model_path
from core.hub.ids import HubError

ALL_TYPES = tuple(TYPES) + tuple(K_TYPES)
VERIFY_MODES = ("auto", "full", "quick", "none")
PAUSE_ENV = "LORA_COCKPIT_TEST_GGUF_PAUSE_AFTER_FIRST_TENSOR"  # test-only: makes the kill test deterministic
SKIP_PERMUTE_ENV = "LORA_COCKPIT_TEST_GGUF_SKIP_QK_PERMUTE"  # test-only: a wrong mapping the check must catch
ALIGN = 32


class ExportError(RuntimeError):
    """The export ran but failed (write error, verification); nothing was left at --out (CLI exit 1)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class ExportResult:
    out: Path
    out_type: str
    size: int
    seconds: float
    report: dict
    vocab: dict
    modelfile: Path | None = None
    ollama_command: str | None = None
    template_family: str | None = None
    # Why the Modelfile has no TEMPLATE although the tokenizer has a chat template (None: translated and
    # checked, or no chat template at all)
    template_problem: str | None = None
    # What the translation could not check but did (a system prompt the template refuses, and where it goes)
    template_notes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out)
        d["modelfile"] = str(self.modelfile) if self.modelfile else None
        return d


def report_path(out: Path) -> Path:
    return out.with_name(out.name + ".verify.json")


def quantizer_missing(out_type: str) -> str | None:
    """Why `out_type` cannot be written on this machine (a K-quant, and llama.cpp's quantizer is not here), as the
    sentence that says how to get it; None when it can be. A page says it before Convert, the CLI refuses with it."""
    from core.gguf import llamacpp

    if out_type not in K_TYPES or llamacpp.available() or shutil.which("llama-quantize") is not None:
        return None
    return (
        f"{out_type} needs llama.cpp's quantizer, which is not installed here: `pip install llama-cpp-python` (it "
        "builds llama.cpp, 10-30 minutes) or llama.cpp's llama-quantize on PATH (build llama.cpp with cmake and add "
        f"build/bin to PATH); or use {', '.join(TYPES)}, which need nothing."
    )


def _check_type(out_type: str) -> None:
    if out_type not in ALL_TYPES:
        raise BadInput(f"Unknown --type {out_type!r}; choose one of {', '.join(ALL_TYPES)}.")
    missing = quantizer_missing(out_type)
    if missing:
        raise BadInput(f"--type {missing}")


def _check_out(out: Path) -> None:
    if out.suffix.lower() != ".gguf":
        raise BadInput(f"--out {out} should end in .gguf.")
    if out.exists() or out.is_symlink():
        raise BadInput(f"{out} already exists; choose another name (an export never overwrites a file).")
    if not out.parent.is_dir():
        raise BadInput(f"The folder {out.parent} for --out does not exist.")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise BadInput(f"The folder {out.parent} is not writable.")


def estimate_size(model_dir: str | os.PathLike, out_type: str = "f16") -> dict:
    """Output size of an export without reading any tensor data: bytes, tensors, and bytes per GGUF type."""
    src = open_source(model_dir)
    base = "f16" if out_type in K_TYPES else out_type
    if base not in TYPES:
        raise BadInput(f"Unknown --type {out_type!r}; choose one of {', '.join(ALL_TYPES)}.")
    jobs = plan_tensors(src, base, extra_rows=byte_rows(src.path))
    by_type: dict[str, int] = {}
    total = 0
    for j in jobs:
        n = (j.nbytes + ALIGN - 1) // ALIGN * ALIGN
        by_type[j.qtype.name] = by_type.get(j.qtype.name, 0) + n
        total += n
    meta = _metadata_bytes(src)
    return {
        "bytes": total + meta,
        "tensor_bytes": total,
        "metadata_bytes_approx": meta,
        "tensors": len(jobs),
        "by_type": by_type,
        "source_bytes": sum(t.nbytes for t in src.tensors.values()),
        "exact": out_type not in K_TYPES,  # llama-quantize picks per-tensor types itself
    }


def _metadata_bytes(src) -> int:
    """Tokenizer metadata: each token is a length-prefixed string plus a type and a score; merges add as much."""
    return (int(src.config["vocab_size"]) + byte_rows(src.path)) * 40 + 64 * 1024


def _disk_bill(src, jobs, out_type: str) -> int:
    """What the export writes beside --out before it is done: the file (a K-quant also its f16 source next to it),
    with the exports' margin (core.files.disk_needed, the merge's rule)."""
    size = sum((j.nbytes + ALIGN - 1) // ALIGN * ALIGN for j in jobs) + _metadata_bytes(src)
    return disk_needed(2 * size if out_type in K_TYPES else size)


def _quantize_k(f16: Path, out: Path, out_type: str) -> None:
    """llama.cpp's K-quant mixes: through llama-cpp-python when it is installed, else llama-quantize on PATH."""
    from core.gguf import llamacpp

    if llamacpp.available():
        try:
            llamacpp.quantize(f16, out, out_type)
        except llamacpp.LlamaCppError as e:
            raise ExportError(str(e)) from None
        return
    cmd = ["llama-quantize", str(f16), str(out), K_TYPES[out_type]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ExportError(f"llama-quantize failed (exit {proc.returncode}): {tail[0]}")


def export_gguf(
    model_dir: str | os.PathLike,
    out: str | os.PathLike,
    out_type: str = "f16",
    verify_mode: str = "auto",
    name: str | None = None,
    on_progress: Callable[[dict], None] | None = None,
    progress_file: bool = True,
    modelfile: bool = True,
    skip_qk_permute: bool = False,
) -> ExportResult:
    """Export `model_dir` to the GGUF file `out`. BadInput before anything is written; ExportError (with the
    verification report) when the export or its check fails; in both cases nothing is at `out`."""
    t0 = time.time()
    out = Path(out).absolute()
    if verify_mode not in VERIFY_MODES:
        raise BadInput(f"Unknown --verify {verify_mode!r}; choose one of {', '.join(VERIFY_MODES)}.")
    _check_type(out_type)
    _check_out(out)
    try:  # a Hub id: its cached snapshot, fetched first when missing
        model_dir = model_path(model_dir, on_progress)
    except HubError as exc:
        raise BadInput(f"--model: {exc}") from None
    src = open_source(model_dir)
    tok = load_source_tokenizer(src.path)
    vocab = read_vocab(src.path, int(src.config["vocab_size"]), tok)
    skip_qk_permute = skip_qk_permute or os.environ.get(SKIP_PERMUTE_ENV) == "1"
    base_type = "f16" if out_type in K_TYPES else out_type
    jobs = plan_tensors(
        src,
        base_type,
        skip_qk_permute=skip_qk_permute,
        extra_rows=vocab.extra_rows,
        extra_row_source=vocab.extra_row_source or 0,
    )
    mode = verify_mode
    if mode == "auto":
        mode = "full" if full_check_fits(src) else "quick"

    # what killed exports to `out` left behind (only folders with our owner record, never a live one's)
    tempdirs.clean_stale_temps(out.parent, f".{glob.escape(out.name)}.*.partial")
    needed = _disk_bill(src, jobs, out_type)
    _free, short = disk_shortfall(out.parent, needed)
    if short:  # refused before anything is written, rather than a disk filled half way
        raise BadInput(short)
    progress = ProgressFile(progress_path(out) if progress_file else None, on_progress, target=out)
    tmp_dir = out.parent / f".{out.name}.{os.getpid()}.partial"
    tmp_file = tmp_dir / out.name
    total_bytes = sum(j.nbytes for j in jobs)
    pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
    done = {"tensors": 0, "bytes": 0}

    def on_tensor(job, written: int) -> None:
        done["tensors"] += 1
        done["bytes"] += written
        progress.update(
            force=done["tensors"] == 1,
            phase="writing",
            tensor=job.name,
            tensors_done=done["tensors"],
            bytes_done=done["bytes"],
        )
        if pause and done["tensors"] == 1:
            time.sleep(pause)

    progress.update(
        force=True,
        phase="writing",
        out=str(out),
        type=out_type,
        tensors_done=0,
        tensors_total=len(jobs),
        bytes_done=0,
        bytes_total=total_bytes,
    )
    report: dict = {}
    placed: list[Path] = []  # what this export put under final names: taken back if a later step fails
    result = ExportResult(
        out=out, out_type=out_type, size=0, seconds=0.0, report=report, vocab=vocab.summary()
    )
    try:
        tmp_dir.mkdir()
        tempdirs.mark_temp(tmp_dir)  # whose it is: the next export removes it once this process is gone
        model_name = name or src.path.name
        file_type = TYPES[base_type][1]
        if out_type in K_TYPES:
            f16 = tmp_dir / ("f16-" + out.name)
            write_gguf(f16, src, jobs, vocab, file_type, model_name, on_tensor)
            progress.update(force=True, phase="quantizing")
            _quantize_k(f16, tmp_file, out_type)
            f16.unlink()
        else:
            write_gguf(tmp_file, src, jobs, vocab, file_type, model_name, on_tensor)
        size = tmp_file.stat().st_size
        progress.update(force=True, phase="verifying", size=size)
        report = verify(tmp_dir, out.name, src, tok, out_type, mode, vocab=vocab)
        report["size"] = size
        result.size, result.report = size, report
        text = json.dumps(report, indent=1, default=str)
        if not report["ok"]:
            if not out.exists():  # no export's file there: the report says why there is none
                atomic_write_text(report_path(out), text)
            raise ExportError(f"Verification failed: {report['reason']}.", report)
        # the sidecars are written beside the temporary file first: once the GGUF is in place, only renames follow
        atomic_write_text(tmp_dir / report_path(out).name, text)
        if modelfile:
            _staged_modelfile(result, src, vocab, tok, tmp_dir)
        try:
            os.link(tmp_file, out)  # fails if `out` appeared meanwhile: never overwrite
        except FileExistsError:
            raise ExportError(
                f"{out} appeared during the export; the new file was not put in its place."
            ) from None
        except OSError:
            if out.exists():
                raise ExportError(
                    f"{out} appeared during the export; the new file was not put in its place."
                ) from None
            os.rename(tmp_file, out)
        placed.append(out)
        progress.won = True  # the file is ours: from here its sidecars describe this export
        for final in (report_path(out), result.modelfile):
            if final is not None:
                os.replace(tmp_dir / final.name, final)
                placed.append(final)
    except ExportError as e:
        _take_back(placed, tmp_dir)
        progress.update(force=True, phase="failed", error=str(e))
        raise
    except (OSError, ValueError, RuntimeError) as e:
        _take_back(placed, tmp_dir)  # before the failed record: on a full disk it needs the space back
        message = f"The export failed: {e}"
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            message = (
                f"The disk holding {out.parent} filled up while the export was writing ({e.strerror}): it needs "
                f"{disk(needed)} free there, {disk(shutil.disk_usage(out.parent).free)} is free now; free some "
                "space or choose another --out."
            )
        progress.update(force=True, phase="failed", error=message)
        raise ExportError(message, report) from e
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tempdirs.unmark_temp(tmp_dir)

    result.seconds = time.time() - t0
    progress.update(force=True, phase="done", size=size, seconds=result.seconds)
    return result


def _take_back(placed: list[Path], tmp_dir: Path) -> None:
    """Undo a failed export: what it put under final names (its own link, its sidecars) and its temporary
    folder, so nothing half-done is left and the space is free again."""
    for path in placed:
        path.unlink(missing_ok=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)


def _staged_modelfile(result: ExportResult, src, vocab, tok, tmp_dir: Path) -> None:
    """The Ollama Modelfile, written into `tmp_dir`; `result` gets its final path and command."""
    eos_id = vocab.special.get("eos")
    eos = vocab.tokens[eos_id] if eos_id is not None else None
    ctx = int(src.config.get("max_position_embeddings", 4096))
    result.modelfile, result.ollama_command, tr = write_modelfile(
        result.out, vocab.chat_template, ctx, eos, tok.bos_token, vocab.add_bos, staging=tmp_dir
    )
    result.template_family = tr.family if tr.faithful else None
    result.template_problem = tr.problem if vocab.chat_template else None
    result.template_notes = list(tr.notes) if tr.faithful else []


def llama_cpp_line(lc: dict) -> str:
    """The llama.cpp verdict in one line."""
    if not lc.get("loads") or lc.get("exit_code"):
        return f"llama.cpp: FAILS: {lc.get('reason')}"
    line = f"llama.cpp: loads; {lc['tokens_equal']}/{lc['samples']} samples tokenized as the source"
    lg = lc.get("logits")
    if lg:
        line += (
            f"; logits max |delta| {lg['max_abs_delta']:.3g}, argmax agreement {lg['argmax_agreement']:.1%}"
        )
    if lc.get("warnings"):
        line += f"; {len(lc['warnings'])} warning(s): {lc['warnings'][0][:120]}"
    return line if lc.get("ok") else f"{line} -- FAILS: {lc.get('reason')}"


def summary_lines(result) -> list[str]:
    """The export's report in a few lines (the CLI prints them, the Merge & Export page shows them); `result` is
    an ExportResult or its to_dict()."""
    if isinstance(result, dict):
        from types import SimpleNamespace

        result = SimpleNamespace(**result)
    r = result.report
    lines = [
        f"wrote {result.out} ({result.size / 1024**2:.1f} MiB, {result.out_type}) in {result.seconds:.1f} s"
    ]
    v = result.vocab
    lines.append(f"tokenizer: {v['style']}, {v['tokens']} tokens, special ids {v['special_ids']}")
    if r.get("mode") == "none":
        lines.append("verification: skipped (--verify none)")
    else:
        t = r["tensors"]
        w = t["worst"]
        lines.append(
            f"verify ({r['mode']}): {t['checked']} tensors compared, worst {w['name']} relative error "
            f"{w['rel_rms']:.2g} (limit {w['limit']})"
        )
        tk = r["tokenizer"]
        extra = f", {len(tk['not_judged'])} with <unk> not judged" if tk.get("not_judged") else ""
        lines.append(
            f"tokenizer round-trip: {tk.get('matched', 0)}/{tk.get('judged', 0)} samples identical{extra}"
        )
        lg = r.get("logits")
        if lg:
            line = (
                f"logits on {lg['positions']} positions: max |delta| {lg['max_abs_delta']:.3g}, "
                f"argmax agreement {lg['argmax_agreement']:.1%}, top-5 overlap {lg['top5_overlap']:.1%}"
            )
            if "tolerance" in lg:
                line += f" (tolerance {lg['tolerance']:.3g}; {lg['argmax_agreement_beyond_ties']:.1%} beyond near-ties)"
            lines.append(line)
        lc = r.get("llama_cpp")
        if lc:
            lines.append(llama_cpp_line(lc))
        else:  # the check that llama.cpp itself loads and runs the file: say it did not run, and how to have it
            from core.gguf import llamacpp

            lines.append(f"llama.cpp read-back: skipped ({llamacpp.why_unavailable()})")
        for note in tk.get("notes", []) + (lg or {}).get("notes", []):
            lines.append(f"note: {note}")
    if result.modelfile:
        problem = getattr(result, "template_problem", None)
        if result.template_family:
            fam = f"{result.template_family}, checked against the tokenizer's template"
        elif problem:
            fam = "not written: see below"
        else:
            fam = "none (a plain completion model)"
        lines.append(f"Modelfile: {result.modelfile} (chat template: {fam})")
        lines += [f"Modelfile note: {note}" for note in getattr(result, "template_notes", None) or []]
        if problem:
            lines.append(f"Modelfile has no TEMPLATE: {problem} Write it by hand for Ollama.")
        lines.append(f"to use it in Ollama: {result.ollama_command}")
    return lines
