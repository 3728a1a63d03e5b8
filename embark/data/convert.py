"""Convert Criteo TSV (plain or ``.gz``; Kaggle ``train.txt`` or Terabyte ``day_N``) into
TorchRec's binary layout, streaming in bounded memory::

    python -m embark.data.convert --workload dlrm_dcnv2 --in day_0.gz day_1.gz --out DIR

For each input ``<stem>`` (the file name less ``.gz``, then less ``.tsv`` / ``.txt``) three
files, as ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` writes them::

    <stem>_dense.npy   (n, D) float32   log(1 + max(x, 0)) of the dense integers (MLPerf's)
    <stem>_sparse.npy  (n, T) int64     the unhashed ids int(c, 16) (empty → 0); ids of 2^63
                                        and more are stored as their two's-complement bits
    <stem>_labels.npy  (n, 1) int32     0 or 1

and ``criteo_binary.json`` (:mod:`embark.data.manifest`): format version, the dense
transform, the files in order with their row counts, sizes and checksums, and the bad-line
summary. Hashing ``id % num_rows`` and multi-hot expansion happen when reading
(:class:`~embark.data.binary.CriteoBinary`), so one conversion serves every table size and
hotness. TorchRec's own ``tsv_to_npys`` stores the dense part as ``log(x - min + 2)`` with
``min`` the file's smallest dense value; the manifest says which transform a folder holds.

A malformed line stops the conversion with its file and line (exit status 1) unless
``--skip-bad-lines``: then it is counted and dropped, and the summary lists how many of
each kind with the first few lines verbatim.

The folder is published whole (:mod:`embark.data.staging`): the converter locks ``DIR``,
writes into ``.DIR.partial``, flushes it to disk and renames it to ``DIR`` with the manifest
already inside, so ``DIR`` is absent, the previous conversion or the new one, never a mix.
Each input finished is recorded in ``.DIR.partial/progress.json``; a conversion that was
interrupted (a signal, a full disk) keeps ``.DIR.partial``, and the next run refuses to start
until it is told to continue it (``--resume``, which keeps the inputs already converted when
their files and the options are unchanged) or the folder is removed. A conversion stopped by
a malformed line removes its partial folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from embark.data.criteo_lines import CriteoFormatError, ReadStats
from embark.data.fastparse import DEFAULT_CHUNK_BYTES, parse_chunk, raw_chunks
from embark.data.manifest import (
    MANIFEST,
    ArrayKind,
    ArrayRecord,
    DenseTransform,
    FileRecord,
    Manifest,
    check_stem,
)
from embark.data.npy import NpyWriter
from embark.data.staging import FolderBusyError, FolderLock, publish, recover, staging_path
from embark.outputs import write_text_atomic
from knobs import add_knobs, from_namespace, knob

log = logging.getLogger(__name__)

PROGRESS = "progress.json"  # in the staging folder: the inputs finished so far
MAX_CHUNK_BYTES = 1 << 30  # pyarrow string columns hold int32 offsets; peak memory ~6x a chunk
_ROW_SHAPES = {ArrayKind.DENSE: np.float32, ArrayKind.SPARSE: np.int64, ArrayKind.LABELS: np.int32}


def stem_of(path: str | os.PathLike[str]) -> str:
    """The output stem of an input file: ``day_0.gz`` → ``day_0``, ``train.txt`` → ``train``."""
    name = Path(path).name.removesuffix(".gz")
    for ext in (".tsv", ".txt"):
        name = name.removesuffix(ext)
    return name


def dense_transform(dense: np.ndarray) -> np.ndarray:
    """``(n, D) int64`` → ``(n, D) float32`` ``log(1 + max(x, 0))``, computed in float64 as
    :class:`~embark.data.criteo.CriteoTSV` does, so both give the same bits."""
    return np.log1p(np.maximum(dense.astype(np.float64), 0.0)).astype(np.float32)


@dataclass
class ConvertResult:
    """What :func:`convert_criteo` wrote: ``files`` as ``(stem, rows)`` in input order;
    ``resumed`` of them were kept from an interrupted conversion."""

    out: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    stats: ReadStats = field(default_factory=ReadStats)
    seconds: float = 0.0
    resumed: int = 0

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.files)


class _Progress:
    """Moves a bar to ``base`` + the bytes of the current file read so far."""

    def __init__(self, bar: tqdm, base: int) -> None:
        self.bar, self.base = bar, base

    def __call__(self, read: int) -> None:
        self.bar.update(self.base + read - self.bar.n)


@dataclass(frozen=True)
class _Job:
    """What a conversion is of: a resumed one must match it exactly."""

    options: dict[str, Any]
    sources: list[dict[str, Any]]  # per input: path, size, mtime_ns

    @classmethod
    def of(cls, srcs: list[Path], options: dict[str, Any]) -> _Job:
        sources = []
        for p in srcs:
            st = p.stat()
            sources.append(
                {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
            )
        return cls(options, sources)


def _check_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    srcs = [Path(p) for p in inputs]
    if not srcs:
        raise ValueError("convert_criteo: no input files")
    for p in srcs:
        if p.is_dir():
            raise ValueError(f"Criteo file {str(p)!r} is a folder; expected a TSV file (or .gz)")
        if not p.is_file():
            raise FileNotFoundError(f"Criteo file {str(p)!r} does not exist")
        if p.suffix == ".gz" and p.stat().st_size == 0:
            raise ValueError(f"Criteo file {str(p)!r} is empty (0 bytes): not a gzip file")
        check_stem(stem_of(p), f"Criteo file {str(p)!r}")
    stems = [stem_of(p) for p in srcs]
    dup = sorted({s for s in stems if stems.count(s) > 1})
    if dup:
        raise ValueError(f"inputs share the output stem(s) {dup}: rename one of each")
    return srcs


def _is_conversion_file(name: str) -> bool:
    """Whether a converter writes a file of this name (``<stem>_<kind>.npy[.tmp]``, the
    manifest)."""
    if name in (MANIFEST, MANIFEST + ".tmp"):
        return True
    base = name.removesuffix(".tmp")
    return base.endswith(".npy") and any(base.endswith(f"_{k.value}.npy") for k in ArrayKind)


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, is not empty (unless ``overwrite``), or holds
    anything a conversion does not write (a replacement would delete it)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a folder")
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir())
    if entries and not overwrite:
        raise ValueError(f"--out {str(out)!r} is not empty: pass --overwrite to replace it")
    foreign = [n for n in entries if not _is_conversion_file(n)]
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise ValueError(
            f"--out {str(out)!r} holds {len(foreign)} entr(y/ies) a conversion does not write "
            f"({', '.join(foreign[:5])}{more}); --overwrite replaces the whole folder, so move "
            "them or pick another --out"
        )


def _read_progress(staging: Path) -> tuple[_Job | None, list[tuple[FileRecord, ReadStats]]]:
    path = staging / PROGRESS
    if not path.is_file():
        return None, []
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        job = _Job(doc["options"], doc["sources"])
        done = [
            (FileRecord.from_dict(d["file"], f"{path} done[{i}]"), ReadStats.from_dict(d["stats"]))
            for i, d in enumerate(doc["done"])
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{path} cannot be read ({err!r}): remove {staging} to start the conversion over"
        ) from None
    return job, done


def _write_progress(staging: Path, job: _Job, done: list[tuple[FileRecord, ReadStats]]) -> None:
    doc = {
        "options": job.options,
        "sources": job.sources,
        "done": [{"file": f.to_dict(), "stats": s.to_dict()} for f, s in done],
    }
    write_text_atomic(staging / PROGRESS, json.dumps(doc, indent=1) + "\n", durable=True)


def _start_staging(staging: Path, job: _Job, resume: bool) -> list[tuple[FileRecord, ReadStats]]:
    """Make the staging folder (or, with ``resume``, keep the inputs an interrupted
    conversion of the same job finished there); returns those inputs."""
    if not staging.exists():
        staging.mkdir()
        return []
    old_job, done = _read_progress(staging)
    if not resume:
        finished = (
            f"{len(done)} of {len(old_job.sources)} input(s) finished"
            if old_job
            else "no input recorded as finished"
        )
        raise ValueError(
            f"an interrupted conversion left {str(staging)!r} ({finished}): pass --resume to "
            "continue it, or remove that folder to start over"
        )
    if old_job is None or not done:
        shutil.rmtree(staging)
        staging.mkdir()
        return []
    if old_job != job:
        raise ValueError(
            f"cannot resume {str(staging)!r}: it was a conversion of other inputs or options "
            f"(it had {old_job.options} of {[s['path'] for s in old_job.sources]}, the input "
            "files' sizes and times included); remove that folder to start over"
        )
    keep = {f.path(staging, k).name for f, _ in done for k in ArrayKind} | {PROGRESS}
    for p in staging.iterdir():
        if p.name not in keep:  # an unfinished input's files
            p.unlink()
    for rec, _ in done:
        for kind, want in rec.arrays.items():
            path = rec.path(staging, kind)
            if not path.is_file() or path.stat().st_size != want.bytes:
                raise ValueError(
                    f"cannot resume {str(staging)!r}: {path.name} is missing or not "
                    f"{want.bytes} bytes; remove that folder to start over"
                )
    log.info("resuming %s: %d input(s) already converted", staging, len(done))
    return done


def _convert_one(
    src: Path,
    out: Path,
    num_dense: int,
    num_sparse: int,
    skip_bad_lines: bool,
    stats: ReadStats,
    on_read: Callable[[int], None],
    chunk_bytes: int,
) -> FileRecord:
    stem = stem_of(src)
    shapes = {
        ArrayKind.DENSE: (num_dense,),
        ArrayKind.SPARSE: (num_sparse,),
        ArrayKind.LABELS: (1,),
    }
    writers: dict[ArrayKind, NpyWriter] = {}
    try:
        for kind in ArrayKind:
            writers[kind] = NpyWriter(
                out / f"{stem}_{kind.value}.npy", _ROW_SHAPES[kind], shapes[kind]
            )
        for first_line, data in raw_chunks(src, chunk_bytes, on_read):
            chunk = parse_chunk(
                data, first_line, str(src), num_dense, num_sparse,
                skip_bad_lines=skip_bad_lines, stats=stats,
            )  # fmt: skip
            writers[ArrayKind.DENSE].append(dense_transform(chunk.dense))
            writers[ArrayKind.SPARSE].append(chunk.ids.view(np.int64))
            writers[ArrayKind.LABELS].append(chunk.labels.reshape(-1, 1))
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    arrays = {k: ArrayRecord(w.path.stat().st_size, w.sha256) for k, w in writers.items()}
    return FileRecord(stem, writers[ArrayKind.DENSE].rows, arrays)


def convert_criteo(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    num_dense: int = 13,
    num_sparse: int = 26,
    *,
    skip_bad_lines: bool = False,
    progress: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workload: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
) -> ConvertResult:
    """Convert Criteo TSV files into TorchRec's npy layout, published whole as the folder
    ``out`` (module docstring).

    Args:
        inputs: TSV files (``.gz`` decompressed on the fly), converted in order.
        out: output folder; it must not exist or be empty unless ``overwrite``.
        num_dense, num_sparse: ``D`` and ``T``; a line has ``1 + D + T`` fields.
        skip_bad_lines: count and drop malformed lines instead of stopping.
        progress: show a progress bar (bytes of input read) on stderr.
        chunk_bytes: bytes parsed at a time, in ``[1, MAX_CHUNK_BYTES]``; memory is a small
            multiple of this.
        workload: recorded in the manifest.
        overwrite: replace the conversion in ``out`` (only a folder holding nothing but a
            conversion's files is replaced).
        resume: continue the conversion an interrupted run of the same inputs and options
            left in ``.<out>.partial``, keeping the inputs it finished.

    Returns:
        the files written and the line counts.

    Raises:
        FileNotFoundError: naming a missing input.
        ValueError: for no inputs, an input that is a folder or an empty ``.gz``, two inputs
            with the same stem, a chunk size out of range, an ``out`` that may not be
            replaced, or an interrupted conversion to resume or remove (naming it).
        FolderBusyError: another process is converting into ``out``.
        CriteoFormatError: a malformed line (unless ``skip_bad_lines``) or a truncated file;
            nothing is published.
        OSError: naming the file that could not be written (``No space left on device``);
            what was finished is kept for ``resume``.
    """
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int)
        or not (1 <= chunk_bytes <= MAX_CHUNK_BYTES)
    ):
        raise ValueError(
            f"chunk_bytes must be an integer in [1, {MAX_CHUNK_BYTES}] (1 GiB), got {chunk_bytes!r}"
        )
    srcs = _check_inputs(inputs)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} exists and is not a folder")
    options = {
        "num_dense": num_dense,
        "num_sparse": num_sparse,
        "skip_bad_lines": skip_bad_lines,
        "workload": workload,
    }
    job = _Job.of(srcs, options)
    with FolderLock(out_dir):
        recover(out_dir)
        _check_out(out_dir, overwrite)
        staging = staging_path(out_dir)
        done = _start_staging(staging, job, resume)
        result = _run(srcs, staging, job, done, skip_bad_lines, progress, chunk_bytes)
        result.out = out_dir
        records = [f for f, _ in done]
        manifest = Manifest(
            DenseTransform.LOG1P_CLIP0, num_dense, num_sparse, records, workload,
            result.stats.to_dict(),
        )  # fmt: skip
        _check_out(out_dir, overwrite)  # the user may have added files meanwhile
        write_text_atomic(staging / MANIFEST, manifest.to_json(), durable=True)
        (staging / PROGRESS).unlink()
        publish(staging, out_dir)
    return result


def _run(
    srcs: list[Path],
    staging: Path,
    job: _Job,
    done: list[tuple[FileRecord, ReadStats]],
    skip_bad_lines: bool,
    progress: bool,
    chunk_bytes: int,
) -> ConvertResult:
    """Convert the inputs not yet ``done`` into ``staging``, recording each one finished
    (``done`` grows); a malformed line removes ``staging``."""
    result = ConvertResult(staging, resumed=len(done))
    for rec, stats in done:
        result.files.append((rec.stem, rec.rows))
        result.stats.merge(stats)
    _write_progress(staging, job, done)
    t0 = time.perf_counter()
    total = sum(p.stat().st_size for p in srcs)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="convert") as bar:
        for i, src in enumerate(srcs):
            if i < len(done):
                bar.update(src.stat().st_size)
                continue
            on_read = _Progress(bar, bar.n)
            stats = ReadStats()
            try:
                rec = _convert_one(
                    src, staging, job.options["num_dense"], job.options["num_sparse"],
                    skip_bad_lines, stats, on_read, chunk_bytes,
                )  # fmt: skip
            except CriteoFormatError:
                shutil.rmtree(staging)  # the same data would stop a resumed run again
                raise
            done.append((rec, stats))
            _write_progress(staging, job, done)
            result.files.append((rec.stem, rec.rows))
            result.stats.merge(stats)
            bar.update(on_read.base + src.stat().st_size - bar.n)
    result.seconds = time.perf_counter() - t0
    return result


@dataclass(frozen=True)
class ConvertKnobs:
    """The knobs of ``python -m embark.data.convert`` (shown in ``--help``)."""

    workload: str = knob("", "preset name: its dense width and tables", required=True)
    scale: float = knob(1.0, "divide table rows by this (>= 1)")
    inputs: tuple[str, ...] = knob((), "Criteo TSV files", required=True, option="--in")
    out: str = knob("", "output folder (published whole)", required=True)
    skip_bad_lines: bool = knob(False, "count and drop bad lines")
    overwrite: bool = knob(False, "replace the conversion in --out")
    resume: bool = knob(False, "continue an interrupted conversion into --out")
    progress: bool = knob(True, "show a progress bar")
    chunk_mb: int = knob(
        DEFAULT_CHUNK_BYTES >> 20,
        f"MiB parsed at a time, 1 to {MAX_CHUNK_BYTES >> 20} (peak memory ~6x this)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m embark.data.convert",
        description="Convert Criteo TSV (plain or .gz) into TorchRec's npy layout.",
    )
    add_knobs(p, ConvertKnobs)
    return p


def _summary(result: ConvertResult) -> str:
    s = result.stats
    text = (
        f"converted {s.good_lines} of {s.lines} lines from {len(result.files)} file(s) into "
        f"{result.out} in {result.seconds:.2f} s ({s.lines / max(result.seconds, 1e-9):,.0f} lines/s)"
    )
    if result.resumed:
        text += f" ({result.resumed} file(s) kept from the interrupted conversion)"
    if s.bad_lines:
        text += f"; skipped {s.bad_lines} bad line(s) {dict(s.reasons)}, first: " + "; ".join(
            s.examples[:3]
        )
    return text


def _message(err: Exception) -> str:
    """``err`` for the user; an ``OSError`` raised with a message of ours (which names the
    file) without its ``[Errno N]``."""
    if isinstance(err, OSError) and err.filename is None and err.strerror:
        return err.strerror
    return str(err)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status: 0, 1 for an error,
    130 when interrupted (SIGINT)."""
    args = from_namespace(ConvertKnobs, _parser().parse_args(argv))
    from embark.models.workloads import get_workload  # the preset names are checked here

    try:
        if not math.isfinite(args.scale) or args.scale < 1:
            raise ValueError(f"--scale must be a finite number >= 1, got {args.scale}")
        if not 1 <= args.chunk_mb <= MAX_CHUNK_BYTES >> 20:
            raise ValueError(
                f"--chunk-mb must be between 1 and {MAX_CHUNK_BYTES >> 20} (MiB parsed at a "
                f"time; peak memory ~6x this), got {args.chunk_mb}"
            )
        workload = get_workload(args.workload)
        if args.scale > 1:
            workload = workload.scaled(args.scale)
        result = convert_criteo(
            args.inputs, args.out, workload.dense_features, len(workload.tables),
            skip_bad_lines=args.skip_bad_lines, progress=args.progress,
            chunk_bytes=args.chunk_mb << 20, workload=workload.name,
            overwrite=args.overwrite, resume=args.resume,
        )  # fmt: skip
    except KeyboardInterrupt:
        partial = staging_path(Path(args.out))
        kept = (
            f"the inputs finished so far are kept in {partial}: run the same command with "
            "--resume to continue"
            if partial.exists()
            else "nothing was written"
        )
        print(f"\ninterrupted: {args.out} was not changed; {kept}", file=sys.stderr)
        return 130
    except (CriteoFormatError, ValueError, OSError, FolderBusyError) as e:
        print(f"error: {_message(e)}", file=sys.stderr)
        return 1
    print(_summary(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
