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

A malformed line — bytes that are not UTF-8, a wrong field count, a label other than 0/1, a
dense value that is not a 64-bit integer or an id that is not 1-16 hex digits — raises
:class:`CriteoFormatError` naming the file and 1-based line number, unless
``skip_bad_lines=True``: then the line is dropped, counted in :attr:`CriteoTSV.stats`, and a
summary is logged at the end of each pass. A file that cannot be read to its end (a
truncated or corrupt ``.gz``) is always an error (kind ``truncated``), naming the file and how
many lines were read: skipping it would drop the rest of the file unseen. Bad values are
quoted shortened (a 5,000-digit field is not repeated whole).
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from embark.data.batch import Batch
from embark.data.jagged import JaggedBatch
from embark.models.workloads import Workload

log = logging.getLogger(__name__)

_MAX_EXAMPLES = 10  # bad lines kept verbatim in the stats, for the report
# Strict field syntax: int() alone would also take " 5", "+7", "1_000" and non-ASCII digits
# ("٣"), and int(.., 16) " 68fd" or "0x1f"; none of these occur in Criteo's logs.
_DENSE = re.compile(r"-?[0-9]{1,19}")  # 19 digits hold every int64; the range is checked
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")  # 64-bit ids
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]+")  # (to say why an id is refused)
_INT64 = 2**63
_QUOTED = 24  # characters of a bad field quoted in a message


class CriteoFormatError(ValueError):
    """A malformed line, or a file that ends early. Attributes: ``path``, ``line`` (1-based),
    ``kind`` (one of ``encoding``, ``field_count``, ``label``, ``dense``, ``categorical``;
    ``truncated`` for a file, never skipped) and ``reason`` (the message)."""

    def __init__(self, path: str, line: int, kind: str, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.kind, self.reason = path, line, kind, reason


@dataclass
class ReadStats:
    """What one pass over the files saw."""

    lines: int = 0
    good_lines: int = 0
    bad_lines: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # "path:line: reason"

    def to_dict(self) -> dict[str, object]:
        return {
            "lines": self.lines,
            "good_lines": self.good_lines,
            "bad_lines": self.bad_lines,
            "reasons": dict(self.reasons),
            "examples": list(self.examples),
        }


def _quoted(text: str) -> str:
    """``repr(text)``, shortened with its length named when it is long."""
    if len(text) <= _QUOTED:
        return repr(text)
    return f"{text[:_QUOTED]!r}... ({len(text)} characters)"


def _open(path: Path) -> gzip.GzipFile | io.BufferedReader:
    if path.suffix == ".gz":
        return gzip.GzipFile(path, "rb")
    return open(path, "rb")


def _numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw line)`` of ``path``, split at ``\\n`` only.

    Raises:
        CriteoFormatError: kind ``truncated``, when the file cannot be read to its end (a
            truncated or corrupt ``.gz``, a read error), naming how many lines were read.
    """
    lineno = 0
    with _open(path) as fh:
        try:
            for lineno, raw in enumerate(fh, start=1):  # noqa: B007 - read after the loop
                yield lineno, raw
        except (EOFError, OSError, zlib.error) as err:  # gzip: EOFError, BadGzipFile, zlib
            raise CriteoFormatError(
                str(path),
                lineno + 1,
                "truncated",
                f"the file cannot be read past line {lineno} ({lineno} lines were read): "
                f"{err} (a truncated or corrupt file?)",
            ) from None


def _decode(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CriteoFormatError(
            path,
            lineno,
            "encoding",
            f"not UTF-8 text: byte 0x{raw[err.start]:02x} at column {err.start + 1}",
        ) from None


def _dense(f: str, j: int, path: str, lineno: int) -> int:
    """The dense feature ``I<j+1>`` of a line (empty → 0)."""
    if f == "":
        return 0
    value = int(f, 10) if _DENSE.fullmatch(f) else None
    if value is None or not -_INT64 <= value < _INT64:
        digits = f.removeprefix("-")
        want = "a 64-bit integer" if digits.isascii() and digits.isdigit() else "an integer"
        raise CriteoFormatError(
            path, lineno, "dense", f"dense feature I{j + 1} must be {want}, got {_quoted(f)}"
        )
    return value


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
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != self.num_fields:
            raise CriteoFormatError(
                path,
                lineno,
                "field_count",
                f"expected {self.num_fields} tab-separated fields, got {len(fields)}",
            )
        if fields[0] not in ("0", "1"):
            raise CriteoFormatError(
                path, lineno, "label", f"label must be 0 or 1, got {_quoted(fields[0])}"
            )
        dense = [_dense(f, j, path, lineno) for j, f in enumerate(fields[1 : 1 + self.num_dense])]
        ids = []
        for j, f in enumerate(fields[1 + self.num_dense :]):
            if f == "":
                ids.append(0)
                continue
            if not _HEX.fullmatch(f):
                hex_digits = _HEX_DIGITS.fullmatch(f) is not None
                want = "at most 16 hex digits (64 bits)" if hex_digits else "hexadecimal"
                raise CriteoFormatError(
                    path,
                    lineno,
                    "categorical",
                    f"categorical feature C{j + 1} must be {want}, got {_quoted(f)}",
                )
            ids.append(int(f, 16) % int(self._rows[j]))
        return int(fields[0]), dense, ids

    def _lines(self) -> Iterator[tuple[int, list[int], list[int]]]:
        for path in self.paths:
            for lineno, raw in _numbered_lines(path):
                if raw.strip() == b"":
                    continue  # a trailing newline is not a sample
                self.stats.lines += 1
                try:
                    line = _decode(raw, str(path), lineno)
                    parsed = self.parse_line(line, str(path), lineno)
                except CriteoFormatError as err:
                    if not self.skip_bad_lines:
                        raise
                    self.stats.bad_lines += 1
                    self.stats.reasons[err.kind] += 1
                    if len(self.stats.examples) < _MAX_EXAMPLES:
                        self.stats.examples.append(str(err))
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
