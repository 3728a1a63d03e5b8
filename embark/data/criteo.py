"""Reader for the Criteo Kaggle / Terabyte click logs (tab-separated text, optionally gzipped).

Line format (Kaggle ``train.txt``, Terabyte ``day_0`` .. ``day_23``), ``1 + D + T`` fields
(``D = 13`` integers, ``T = 26`` categoricals for the real data)::

    <label> \\t <I1> ... <I13> \\t <C1> ... <C26>
    1       \\t 5 \\t \\t 0 ... \\t 68fd1e64 \\t 80e26c9b \\t \\t ...

* label: ``0`` or ``1``;
* dense ``I*``: ASCII decimal 64-bit integers, possibly negative (``-?[0-9]+``: no ``+``,
  spaces, ``_`` or other scripts' digits), or empty (→ 0); the model gets
  ``log(1 + max(x, 0))`` as ``float32`` (the MLPerf DLRM reference preprocessing);
* categorical ``C*``: ASCII hexadecimal ids of at most 16 digits (``[0-9a-fA-F]{1,16}``: no
  ``0x``, sign or spaces; 32-bit in the published data), or empty. Category ``c`` of table
  ``t`` becomes row
  ``int(c, 16) % num_rows_t`` (the modulo hashing of the MLPerf reference and TorchRec); an
  empty field becomes row 0 (documented collision: it shares row 0 with the ids that hash
  there).

A malformed line — bytes that are not UTF-8, a wrong field count (a line of blanks or tabs
included; only an empty line is not a sample), a label other than 0/1, a dense value that is
not a 64-bit integer or an id that is not 1-16 hex digits — raises
:class:`CriteoFormatError` naming the file and 1-based line number, unless
``skip_bad_lines=True``: then the line is dropped, counted in :attr:`CriteoTSV.stats`, and a
summary is logged at the end of each pass. A file that cannot be read to its end (a
truncated or corrupt ``.gz``) is always an error (kind ``truncated``), naming the file and how
many lines were read: skipping it would drop the rest of the file unseen. Bad values are
quoted shortened (a 5,000-digit field is not repeated whole).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from embark.data.batch import Batch
from embark.data.criteo_lines import (
    EMPTY_LINES,
    CriteoFormatError,
    ReadStats,
    decode,
    numbered_lines,
    parse_fields,
)
from embark.data.jagged import JaggedBatch
from embark.models.workloads import Workload

__all__ = ["CriteoFormatError", "CriteoTSV", "ReadStats"]

log = logging.getLogger(__name__)


class CriteoTSV:
    """Stream :class:`~embark.data.batch.Batch` es from Criteo TSV files.

    Args:
        paths: one file or several, read in order.
        workload: gives ``D = workload.dense_features`` and one table per categorical column,
            in order (their ``num_rows`` are the hash sizes).
        batch_size: samples per batch, > 0; the last batch of a pass may be smaller unless
            ``drop_last``.
        skip_bad_lines: drop and count malformed lines instead of raising.
        drop_last: drop a final partial batch.

    Raises:
        ValueError: for a bad batch size; FileNotFoundError naming a missing file.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        workload: Workload,
        batch_size: int,
        *,
        skip_bad_lines: bool = False,
        drop_last: bool = False,
    ) -> None:
        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("CriteoTSV: no input files")
        for p in self.paths:
            if not p.is_file():
                raise FileNotFoundError(f"Criteo file {str(p)!r} does not exist")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.workload = workload
        self.batch_size = batch_size
        self.skip_bad_lines = skip_bad_lines
        self.drop_last = drop_last
        self.num_dense = workload.dense_features
        self.num_sparse = len(workload.tables)
        self._rows = np.array([t.num_rows for t in workload.tables], dtype=np.int64)
        self.stats = ReadStats()

    @property
    def num_fields(self) -> int:
        return 1 + self.num_dense + self.num_sparse

    def parse_line(
        self, line: str, path: str = "<line>", lineno: int = 0
    ) -> tuple[int, list[int], list[int]]:
        """Parse one line into ``(label, dense ints (D,), row ids (T,))``.

        Raises:
            CriteoFormatError: naming ``path:lineno`` and what is wrong.
        """
        label, dense, ids = parse_fields(line, self.num_dense, self.num_sparse, path, lineno)
        return label, dense, [c % int(r) for c, r in zip(ids, self._rows)]

    def _lines(self) -> Iterator[tuple[int, list[int], list[int]]]:
        for path in self.paths:
            for lineno, raw in numbered_lines(path):
                if raw in EMPTY_LINES:
                    continue  # a trailing newline is not a sample
                self.stats.lines += 1
                try:
                    line = decode(raw, str(path), lineno)
                    parsed = self.parse_line(line, str(path), lineno)
                except CriteoFormatError as err:
                    if not self.skip_bad_lines:
                        raise
                    self.stats.count_bad(err)
                    continue
                self.stats.good_lines += 1
                yield parsed

    def _batch(self, rows: list[tuple[int, list[int], list[int]]]) -> Batch:
        labels = torch.tensor([r[0] for r in rows], dtype=torch.float32)
        dense = np.asarray([r[1] for r in rows], dtype=np.float64).reshape(
            len(rows), self.num_dense
        )
        dense_t = torch.from_numpy(np.log1p(np.maximum(dense, 0.0)).astype(np.float32))
        ids = np.asarray([r[2] for r in rows], dtype=np.int64).reshape(len(rows), self.num_sparse)
        sparse = JaggedBatch(
            [t.name for t in self.workload.tables],
            torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),  # key-major
            torch.ones(len(rows) * self.num_sparse, dtype=torch.int32),
        )
        return Batch(dense_t, sparse, labels)

    def batches(self) -> Iterator[Batch]:
        """One pass over all files; resets :attr:`stats` at the start."""
        self.stats = ReadStats()
        rows: list[tuple[int, list[int], list[int]]] = []
        for parsed in self._lines():
            rows.append(parsed)
            if len(rows) == self.batch_size:
                yield self._batch(rows)
                rows = []
        if rows and not self.drop_last:
            yield self._batch(rows)
        if self.stats.bad_lines:
            log.warning(
                "Criteo reader skipped %d of %d lines (%s); first: %s",
                self.stats.bad_lines,
                self.stats.lines,
                dict(self.stats.reasons),
                self.stats.examples[0],
            )

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()
