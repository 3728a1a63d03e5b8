"""The update formats carry a version and are refused in another one, naming the file (or the
record), the version found and the one this hps reads; nothing of them is applied."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from hps.types import FormatVersionError
from hps.updates import (
    CorruptRecordError,
    FileLogPublisher,
    FileLogSource,
    RecordVersionError,
    decode_batch,
    encode_batch,
)
from hps.updates.file_log import LOG_VERSION
from hps.updates.record import VERSION

_LOG_HEADER = 33  # bytes: "HPSL", version u8, length u64, crc32 u32, 16-byte id
_VERSION_BYTE = 4  # the version's position in a log header and in a record header


def _batch(value: float) -> dict:
    return {"t": (np.array([1, 2], np.int64), np.full((2, 3), value, np.float32))}


def test_a_log_of_another_version_is_refused_by_readers_and_the_writer(tmp_path: Path) -> None:
    log = tmp_path / "u.log"
    FileLogPublisher(log).publish(_batch(1.0))
    data = bytearray(log.read_bytes())
    data[_VERSION_BYTE] = LOG_VERSION + 1
    log.write_bytes(bytes(data))
    msg = f"update log {log} has format version {LOG_VERSION + 1}; this hps reads format version {LOG_VERSION} only"
    with pytest.raises(FormatVersionError, match=re.escape(msg)) as ei:
        FileLogSource(log).read(None)
    assert (ei.value.found, ei.value.expected) == (LOG_VERSION + 1, LOG_VERSION)
    assert not isinstance(ei.value, CorruptRecordError)  # not a torn write: nothing to retry
    with pytest.raises(FormatVersionError, match=re.escape(msg)):
        FileLogPublisher(log)
    assert log.read_bytes() == bytes(data)  # nothing truncated, nothing appended


def test_a_record_of_another_version_is_refused(tmp_path: Path) -> None:
    rec = bytearray(encode_batch(_batch(1.0)))
    rec[_VERSION_BYTE] = VERSION + 1
    with pytest.raises(
        RecordVersionError,
        match=re.escape(
            f"update stream s entry 1-0 has format version {VERSION + 1}; "
            f"this hps reads format version {VERSION} only"
        ),
    ) as ei:
        decode_batch(bytes(rec), "update stream s entry 1-0")
    assert isinstance(ei.value, CorruptRecordError)  # readers stop before it, as before a bad one
    assert isinstance(ei.value, FormatVersionError) and ei.value.found == VERSION + 1
    # inside a log: the reader stops before it, never skips it
    log = tmp_path / "u.log"
    off1 = FileLogPublisher(log).publish(_batch(1.0))
    with open(log, "ab") as f:
        f.write(bytes(rec))
    src = FileLogSource(log)
    assert [o for o, _ in src.read(None)] == [off1] and src.corrupt == 1
    assert log.stat().st_size == int(off1) + len(rec) and int(off1) > _LOG_HEADER
