"""Criteo TSV lines, one at a time, with exact errors: the strict field syntax shared by
:class:`~embark.data.criteo.CriteoTSV` and the converter's fallback path
(:mod:`embark.data.fastparse`), so both accept and refuse exactly the same lines.

Field syntax (the module docstring of :mod:`embark.data.criteo` has the line format):

* label: exactly ``0`` or ``1``;
* dense: ``-?[0-9]{1,19}`` within int64, or empty (→ 0);
* categorical: ``[0-9a-fA-F]{1,16}`` (a 64-bit id), or empty (→ 0).

Only an empty line (``\\n`` or ``\\r\\n``) is not a sample; a line of blanks or tabs is a
malformed line like any other. No torch here: the converter's start-up stays short.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_EXAMPLES = 10  # bad lines kept verbatim in the stats, for the report
# Strict field syntax: int() alone would also take " 5", "+7", "1_000" and non-ASCII digits
# ("٣"), and int(.., 16) " 68fd" or "0x1f"; none of these occur in Criteo's logs.
_DENSE = re.compile(r"-?[0-9]{1,19}")  # 19 digits hold every int64; the range is checked
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")  # 64-bit ids
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]+")  # (to say why an id is refused)
_INT64 = 2**63
_QUOTED = 24  # characters of a bad field quoted in a message
EMPTY_LINES = (b"\n", b"\r\n", b"")


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

    def count_bad(self, err: CriteoFormatError) -> None:
        """Count one skipped line (and keep it as an example while there are few)."""
        self.bad_lines += 1
        self.reasons[err.kind] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(str(err))

    def merge(self, other: ReadStats) -> None:
        """Add ``other``'s counts (and examples, up to the cap) to these."""
        self.lines += other.lines
        self.good_lines += other.good_lines
        self.bad_lines += other.bad_lines
        self.reasons.update(other.reasons)
        self.examples.extend(other.examples[: MAX_EXAMPLES - len(self.examples)])

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ReadStats:
        """The stats :meth:`to_dict` wrote."""
        return cls(
            int(doc["lines"]), int(doc["good_lines"]), int(doc["bad_lines"]),
            Counter({str(k): int(v) for k, v in doc["reasons"].items()}),
            [str(e) for e in doc["examples"]],
        )  # fmt: skip

    def to_dict(self) -> dict[str, object]:
        return {
            "lines": self.lines,
            "good_lines": self.good_lines,
            "bad_lines": self.bad_lines,
            "reasons": dict(self.reasons),
            "examples": list(self.examples),
        }


def quoted(text: str) -> str:
    """``repr(text)``, shortened with its length named when it is long."""
    if len(text) <= _QUOTED:
        return repr(text)
    return f"{text[:_QUOTED]!r}... ({len(text)} characters)"


def open_binary(path: Path) -> gzip.GzipFile | io.BufferedReader:
    """``path`` opened for reading bytes, decompressed when its suffix is ``.gz``."""
    if path.suffix == ".gz":
        return gzip.GzipFile(path, "rb")
    return open(path, "rb")


def truncated_error(path: Path, lines_read: int, err: BaseException) -> CriteoFormatError:
    """The ``truncated`` error of a file that cannot be read past line ``lines_read``."""
    return CriteoFormatError(
        str(path),
        lines_read + 1,
        "truncated",
        f"the file cannot be read past line {lines_read} ({lines_read} lines were read): "
        f"{err} (a truncated or corrupt file?)",
    )


# gzip raises EOFError (truncated), BadGzipFile (an OSError) or zlib.error (corrupt)
READ_ERRORS = (EOFError, OSError, zlib.error)


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw line)`` of ``path``, split at ``\\n`` only.

    Raises:
        CriteoFormatError: kind ``truncated``, when the file cannot be read to its end (a
            truncated or corrupt ``.gz``, a read error), naming how many lines were read.
    """
    lineno = 0
    with open_binary(path) as fh:
        try:
            for lineno, raw in enumerate(fh, start=1):  # noqa: B007 - read after the loop
                yield lineno, raw
        except READ_ERRORS as err:
            raise truncated_error(path, lineno, err) from None


def decode(raw: bytes, path: str, lineno: int) -> str:
    """``raw`` as UTF-8 text.

    Raises:
        CriteoFormatError: kind ``encoding``, naming the first bad byte and its column.
    """
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
            path, lineno, "dense", f"dense feature I{j + 1} must be {want}, got {quoted(f)}"
        )
    return value


def _category(f: str, j: int, path: str, lineno: int) -> int:
    """The categorical feature ``C<j+1>`` of a line as an unsigned 64-bit id (empty → 0)."""
    if f == "":
        return 0
    if not _HEX.fullmatch(f):
        hex_digits = _HEX_DIGITS.fullmatch(f) is not None
        want = "at most 16 hex digits (64 bits)" if hex_digits else "hexadecimal"
        raise CriteoFormatError(
            path,
            lineno,
            "categorical",
            f"categorical feature C{j + 1} must be {want}, got {quoted(f)}",
        )
    return int(f, 16)


def parse_fields(
    line: str, num_dense: int, num_sparse: int, path: str = "<line>", lineno: int = 0
) -> tuple[int, list[int], list[int]]:
    """Parse one line into ``(label, dense ints (D,), raw ids (T,))``; ids are the unhashed
    categories ``int(c, 16)`` in ``[0, 2**64)``.

    Raises:
        CriteoFormatError: naming ``path:lineno`` and what is wrong.
    """
    fields = line.rstrip("\r\n").split("\t")
    want = 1 + num_dense + num_sparse
    if len(fields) != want:
        raise CriteoFormatError(
            path, lineno, "field_count", f"expected {want} tab-separated fields, got {len(fields)}"
        )
    if fields[0] not in ("0", "1"):
        raise CriteoFormatError(
            path, lineno, "label", f"label must be 0 or 1, got {quoted(fields[0])}"
        )
    dense = [_dense(f, j, path, lineno) for j, f in enumerate(fields[1 : 1 + num_dense])]
    ids = [_category(f, j, path, lineno) for j, f in enumerate(fields[1 + num_dense :])]
    return int(fields[0]), dense, ids
