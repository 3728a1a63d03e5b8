"""Criteo-like TSV files for tests and benchmarks, written vectorised (pyarrow's CSV writer).

Per column, like the published logs: dense features are heavy-tailed counts
(``floor(LogNormal(1, 1.5))``; a few ``-1``/``-2`` in ``I2`` as in the real ``I2``) with a
per-column share of empty fields between 0 and 45 %; categorical features are 8-hex-digit
32-bit ids drawn Zipf-like from a per-column vocabulary (10 to 10^6 distinct values), empty
in 0 to 40 % of lines. Labels are clicks with rate ~25 %. The content depends only on
``seed`` and the line count.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex8(ids: np.ndarray) -> np.ndarray:
    """``(n,) uint32`` → ``(n,) |S8`` lowercase hex, zero-padded."""
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    digits = _HEX[(ids[:, None] >> shifts[None, :]) & 0xF]
    return np.ascontiguousarray(digits).view("S8").reshape(-1)


def criteo_like_table(
    lines: int, seed: int = 0, num_dense: int = 13, num_sparse: int = 26
) -> pa.Table:
    """The columns of :func:`write_criteo_like` as an Arrow table (label, I*, C*)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {"label": pa.array((rng.random(lines) < 0.25).astype(np.int8))}
    for j in range(num_dense):
        v = np.floor(rng.lognormal(1.0, 1.5, lines)).astype(np.int64)
        if j == 1:
            v[rng.random(lines) < 0.02] = -rng.integers(1, 3, 1)[0]
        empty = rng.random(lines) < rng.uniform(0.0, 0.45)
        cols[f"I{j}"] = pa.array(v, mask=empty)
    for j in range(num_sparse):
        vocab = int(10 ** rng.uniform(1, 6))
        rank = np.minimum(rng.zipf(1.2, lines), vocab).astype(np.uint64)
        ids = ((rank * np.uint64(2654435761) + np.uint64(j * 97)) & np.uint64(0xFFFFFFFF)).astype(
            np.uint32
        )
        empty = rng.random(lines) < rng.uniform(0.0, 0.4)
        cols[f"C{j}"] = pa.array(_hex8(ids), type=pa.binary(), mask=empty)
    return pa.table(cols)


def write_criteo_like(
    path: str | os.PathLike[str],
    lines: int,
    seed: int = 0,
    num_dense: int = 13,
    num_sparse: int = 26,
) -> Path:
    """Write ``lines`` Criteo-like TSV lines (module docstring) to ``path`` (gzipped when it
    ends in ``.gz``); returns the path."""
    p = Path(path)
    table = criteo_like_table(lines, seed, num_dense, num_sparse)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    if p.suffix == ".gz":
        with gzip.open(p, "wb", compresslevel=1) as fh:
            pacsv.write_csv(table, fh, write_options=options)
    else:
        pacsv.write_csv(table, p, write_options=options)
    return p
