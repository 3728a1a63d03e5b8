"""Convert Criteo TSV (plain or ``.gz``; Kaggle ``train.txt`` or Terabyte ``day_N``) into
TorchRec's binary layout, streaming in bounded memory::

    python -m embark.data.convert --workload dlrm_dcnv2 --in day_0.gz day_1.gz --out DIR

For each input ``<stem>`` (the file name less ``.gz``, then less ``.tsv`` / ``.txt``) three
files, as ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` writes them::

    <stem>_dense.npy   (n, D) float32   log(1 + max(x, 0)) of the dense integers (MLPerf's)
    <stem>_sparse.npy  (n, T) int64     the unhashed ids int(c, 16) (empty → 0); ids of 2^63
                                        and more are stored as their two's-complement bits
    <stem>_labels.npy  (n, 1) int32     0 or 1

and ``criteo_binary.json`` (:data:`MANIFEST`): format version, the dense transform, the files
in order with their row counts, and the bad-line summary. Hashing ``id % num_rows`` and
multi-hot expansion happen when reading (:class:`~embark.data.binary.CriteoBinary`), so one
conversion serves every table size and hotness. TorchRec's own ``tsv_to_npys`` stores the
dense part as ``log(x - min + 2)`` with ``min`` the file's smallest dense value; the
manifest says which transform a folder holds.

A malformed line stops the conversion with its file and line (exit status 1) unless
``--skip-bad-lines``: then it is counted and dropped, and the summary lists how many of
each kind with the first few lines verbatim. The files of an input are written under
temporary names and renamed once that input is complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from embark.data.criteo_lines import CriteoFormatError, ReadStats
from embark.data.fastparse import DEFAULT_CHUNK_BYTES, parse_chunk, raw_chunks
from embark.data.npy import NpyWriter

log = logging.getLogger(__name__)

MANIFEST = "criteo_binary.json"
FORMAT = "tilerec-criteo-npy"
FORMAT_VERSION = 1
DENSE_TRANSFORM = "log1p_clip0"  # log(1 + max(x, 0)), float32: MLPerf's and CriteoTSV's


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
    """What :func:`convert_criteo` wrote: ``files`` as ``(stem, rows)`` in input order."""

    out: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    stats: ReadStats = field(default_factory=ReadStats)
    seconds: float = 0.0

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.files)


class _Progress:
    """Moves a bar to ``base`` + the bytes of the current file read so far."""

    def __init__(self, bar: tqdm, base: int) -> None:
        self.bar, self.base = bar, base

    def __call__(self, read: int) -> None:
        self.bar.update(self.base + read - self.bar.n)


def _convert_one(
    src: Path,
    out: Path,
    num_dense: int,
    num_sparse: int,
    skip_bad_lines: bool,
    stats: ReadStats,
    on_read: Callable[[int], None],
    chunk_bytes: int,
) -> int:
    stem = stem_of(src)
    writers = [
        NpyWriter(out / f"{stem}_dense.npy", np.float32, (num_dense,)),
        NpyWriter(out / f"{stem}_sparse.npy", np.int64, (num_sparse,)),
        NpyWriter(out / f"{stem}_labels.npy", np.int32, (1,)),
    ]
    try:
        for first_line, data in raw_chunks(src, chunk_bytes, on_read):
            chunk = parse_chunk(
                data, first_line, str(src), num_dense, num_sparse,
                skip_bad_lines=skip_bad_lines, stats=stats,
            )  # fmt: skip
            writers[0].append(dense_transform(chunk.dense))
            writers[1].append(chunk.ids.view(np.int64))
            writers[2].append(chunk.labels.reshape(-1, 1))
    except BaseException:
        for w in writers:
            w.discard()
        raise
    for w in writers:
        w.close()
    return writers[0].rows


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
) -> ConvertResult:
    """Convert Criteo TSV files into TorchRec's npy layout in ``out`` (module docstring).

    Args:
        inputs: TSV files (``.gz`` decompressed on the fly), converted in order.
        out: output folder (created).
        num_dense, num_sparse: ``D`` and ``T``; a line has ``1 + D + T`` fields.
        skip_bad_lines: count and drop malformed lines instead of stopping.
        progress: show a progress bar (bytes of input read) on stderr.
        chunk_bytes: bytes parsed at a time; memory is a small multiple of this.
        workload: recorded in the manifest.

    Returns:
        the files written and the line counts.

    Raises:
        FileNotFoundError: naming a missing input.
        ValueError: for no inputs, or two inputs with the same stem.
        CriteoFormatError: a malformed line (unless ``skip_bad_lines``) or a truncated file.
    """
    srcs = [Path(p) for p in inputs]
    if not srcs:
        raise ValueError("convert_criteo: no input files")
    for p in srcs:
        if not p.is_file():
            raise FileNotFoundError(f"Criteo file {str(p)!r} does not exist")
    stems = [stem_of(p) for p in srcs]
    dup = sorted({s for s in stems if stems.count(s) > 1})
    if dup:
        raise ValueError(f"inputs share the output stem(s) {dup}: rename one of each")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = ConvertResult(out_dir)
    t0 = time.perf_counter()
    total = sum(p.stat().st_size for p in srcs)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="convert") as bar:
        for src in srcs:
            on_read = _Progress(bar, bar.n)
            rows = _convert_one(
                src,
                out_dir,
                num_dense,
                num_sparse,
                skip_bad_lines,
                result.stats,
                on_read,
                chunk_bytes,
            )
            result.files.append((stem_of(src), rows))
            bar.update(on_read.base + src.stat().st_size - bar.n)
    result.seconds = time.perf_counter() - t0
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dense_transform": DENSE_TRANSFORM,
        "num_dense": num_dense,
        "num_sparse": num_sparse,
        "workload": workload,
        "files": [{"stem": s, "rows": n} for s, n in result.files],
        "stats": result.stats.to_dict(),
    }
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / MANIFEST)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m embark.data.convert",
        description="Convert Criteo TSV (plain or .gz) into TorchRec's npy layout.",
    )
    p.add_argument("--workload", required=True, help="preset name: its dense width and tables")
    p.add_argument("--scale", type=float, default=1.0, help="divide table rows by this (>= 1)")
    p.add_argument("--in", dest="inputs", nargs="+", required=True, metavar="FILE")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--skip-bad-lines", action="store_true", help="count and drop bad lines")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--chunk-mb", type=int, default=DEFAULT_CHUNK_BYTES >> 20, help="MiB per chunk")
    return p


def _summary(result: ConvertResult) -> str:
    s = result.stats
    text = (
        f"converted {s.good_lines} of {s.lines} lines from {len(result.files)} file(s) into "
        f"{result.out} in {result.seconds:.2f} s ({s.lines / max(result.seconds, 1e-9):,.0f} lines/s)"
    )
    if s.bad_lines:
        text += f"; skipped {s.bad_lines} bad line(s) {dict(s.reasons)}, first: " + "; ".join(
            s.examples[:3]
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    from embark.models.workloads import get_workload  # the preset names are checked here

    try:
        workload = get_workload(args.workload)
        if args.scale > 1:
            workload = workload.scaled(args.scale)
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {args.out!r} exists and is not a folder")
        if out.is_dir() and any(out.iterdir()) and not args.overwrite:
            raise ValueError(f"--out {args.out!r} is not empty: pass --overwrite to write into it")
        if args.chunk_mb <= 0:
            raise ValueError(f"--chunk-mb must be > 0, got {args.chunk_mb}")
        result = convert_criteo(
            args.inputs, out, workload.dense_features, len(workload.tables),
            skip_bad_lines=args.skip_bad_lines, progress=not args.no_progress,
            chunk_bytes=args.chunk_mb << 20, workload=workload.name,
        )  # fmt: skip
    except (CriteoFormatError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_summary(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
