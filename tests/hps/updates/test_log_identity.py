"""The update log's identity: a stored offset is checked against the log it was taken in, so a
replaced or rotated log is an error on resume (nothing applied) instead of a silent skip of the
new log's first records; a damaged stored offset is a ValueError naming where it is stored."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.volatile import HashMapBackend
from hps.types import FormatVersionError
from hps.updates import (
    CorruptRecordError,
    FileLogPublisher,
    FileLogSource,
    LogReplacedError,
    OffsetPastEndError,
    UpdateApplier,
    encode_batch,
)
from hps.updates.file_log import LOG_VERSION

DIM = 2
N = 12


def _one(key: int, value: float, n: int = 1) -> dict:
    """An update of keys ``key..key+n-1`` to ``value``."""
    return {"t": (np.arange(key, key + n, dtype=np.int64), np.full((n, DIM), value, np.float32))}


class _Server:
    """A volatile db, an optional RocksDB and a cached session over one table of zeros."""

    def __init__(self, tmp_path: Path, store: str) -> None:
        self.tmp, self.log, self.off = tmp_path, tmp_path / "u.log", tmp_path / "u.log.offset"
        keys, rows = np.arange(N, dtype=np.int64), np.zeros((N, DIM), np.float32)
        self.vdb = HashMapBackend(num_partitions=1)
        self.vdb.create_table("t", DIM)
        self.vdb.insert("t", keys, rows)
        self.pdb = None
        if store == "rocks_db":
            self.pdb = RocksDBBackend(tmp_path / "pdb")
            self.pdb.create_table("t", DIM)
            self.pdb.bulk_load("t", keys, rows)
        self.s = LookupSession(
            [SessionTable("t", DIM, 0.0, 64, EmbeddingCache(N, DIM))],
            self.vdb,
            self.pdb,
            exact=True,
            hit_rate_threshold=1.0,
        )
        self.s.lookup("t", torch.from_numpy(keys))  # every row cached

    def applier(self) -> UpdateApplier:
        """A new applier (a restarted server): it loads the stored offset and log id."""
        return UpdateApplier(
            FileLogSource(self.log),
            [self.s],
            self.vdb,
            self.pdb,
            offset_file=None if self.pdb else self.off,
        )

    def where(self) -> str:
        return str(self.pdb.path) if self.pdb else str(self.off)

    def served(self) -> list[float]:
        """Column 0 of every key, from the session (cache), the volatile db and RocksDB."""
        keys = np.arange(N, dtype=np.int64)
        got = self.s.lookup("t", torch.from_numpy(keys))[:, 0].tolist()
        assert self.vdb.lookup("t", keys)[0][:, 0].tolist() == got
        if self.pdb is not None:
            assert self.pdb.lookup("t", keys)[0][:, 0].tolist() == got
        return got

    def close(self) -> None:
        self.s.close()
        if self.pdb is not None:
            self.pdb.close()


@pytest.fixture(params=["offset_file", "rocks_db"])
def server(request, tmp_path: Path):
    srv = _Server(tmp_path, request.param)
    yield srv
    srv.close()


@pytest.mark.parametrize("new_log", ["equal_length", "longer", "mid_record"])
def test_a_replaced_log_is_detected_on_resume_and_nothing_is_applied(
    server: _Server, new_log: str
) -> None:
    pub = FileLogPublisher(server.log)
    pub.publish(_one(0, 1.0))
    pub.publish(_one(1, 1.0))
    ap = server.applier()
    assert ap.poll() == 2
    off, old_id, old_size = ap.offset, ap.log_id, server.log.stat().st_size
    assert off == str(old_size) and old_id.startswith("log:")
    # the trainer rotates the log: a new log, as long as the old one or longer, replaces it
    os.replace(server.log, server.tmp / "u.log.1")
    pub = FileLogPublisher(server.log)
    if new_log == "mid_record":  # bigger records: the old offset falls inside the second one
        pub.publish(_one(4, 2.0, n=2))
        pub.publish(_one(6, 2.0, n=2))
    else:
        for k in range(4, 6 if new_log == "equal_length" else 8):
            pub.publish(_one(k, 2.0))
    size = server.log.stat().st_size
    assert size == old_size if new_log == "equal_length" else size > old_size
    new_id = FileLogSource(server.log).read_log(None, None)[0]
    assert new_id.startswith("log:") and new_id != old_id
    before = server.served()
    stored = server.off.read_text() if server.pdb is None else None
    for applier in (ap, server.applier()):  # the running applier, and one after a restart
        src, applied = applier.source, applier.applied
        with pytest.raises(LogReplacedError) as ei:
            applier.poll()
        msg = str(ei.value)
        for part in (str(server.log), old_id, new_id, server.where(), f"stored offset {off}"):
            assert part in msg
        assert (ei.value.stored_id, ei.value.log_id) == (old_id, new_id)
        assert applier.offset == off and applier.log_id == old_id and applier.applied == applied
        assert src.corrupt == 0  # not misreported as a corrupt record
    assert server.served() == before  # nothing of the new log was applied
    if stored is not None:
        assert server.off.read_text() == stored
    # after a reset the new log is applied from its start, every record of it
    ap2 = server.applier()
    ap2.reset_offset()
    assert ap2.drain() == (4 if new_log == "longer" else 2) and ap2.log_id == new_id
    assert server.served()[4:8] == (
        [2.0] * 4 if new_log != "equal_length" else [2.0, 2.0, 0.0, 0.0]
    )


def test_a_copy_and_truncate_rotation_is_detected(server: _Server) -> None:
    """logrotate's copytruncate empties the log in place under a running publisher: its next
    record goes after a fresh log header, and the stored offset is refused."""
    pub = FileLogPublisher(server.log)
    for k in range(3):
        pub.publish(_one(k, 1.0))
    ap = server.applier()
    assert ap.poll() == 3
    old_id = ap.log_id
    os.truncate(server.log, 0)
    for k in range(5, 10):
        pub.publish(_one(k, 3.0))
    new_id = FileLogSource(server.log).read_log(None, None)[0]
    assert new_id.startswith("log:") and new_id != old_id
    with pytest.raises(LogReplacedError, match=re.escape(new_id)):
        ap.poll()
    assert server.served()[5:10] == [0.0] * 5


def test_the_log_id_is_stored_with_the_offset_and_survives_a_restart(server: _Server) -> None:
    pub = FileLogPublisher(server.log)
    pub.publish(_one(0, 1.0))
    ap = server.applier()
    assert ap.poll() == 1
    if server.pdb is None:
        assert server.off.read_text() == f"{ap.offset} {ap.log_id}"
    pub = FileLogPublisher(server.log)  # the trainer restarts: the same log, the same id
    pub.publish(_one(1, 1.0))
    ap2 = server.applier()
    assert (ap2.offset, ap2.log_id) == (ap.offset, ap.log_id)
    assert ap2.poll() == 1 and ap2.applied == 1  # resumed after the first record only
    assert server.served()[:3] == [1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "text",
    [
        "garbage",
        "-8",
        "+8",
        " 8_0",
        "1e3",
        "8 9",
        "8 log:xyz",
        "8 log:0123456789abcdef0123456789abcdef extra",
        "\xff8",
    ],
)
def test_a_damaged_offset_file_is_a_value_error_naming_it(tmp_path: Path, text: str) -> None:
    server = _Server(tmp_path, "offset_file")
    try:
        pub = FileLogPublisher(server.log)
        for k in range(3):
            pub.publish(_one(k, 1.0))
        server.off.write_bytes(text.encode("latin-1"))
        ap = server.applier()  # constructing it works: reset_offset() must stay usable
        bad = text.split()[0] if text.isascii() else ""
        with pytest.raises(ValueError, match=re.escape(str(server.off))) as ei:
            ap.poll()
        assert not isinstance(ei.value, OSError) and bad in str(ei.value)
        assert server.served() == [0.0] * N and ap.applied == 0
        ap.reset_offset()
        assert ap.poll() == 3 and server.served()[:4] == [1.0, 1.0, 1.0, 0.0]
    finally:
        server.close()


def test_a_damaged_offset_in_rocksdb_is_a_value_error_naming_it(tmp_path: Path) -> None:
    server = _Server(tmp_path, "rocks_db")
    try:
        FileLogPublisher(server.log).publish(_one(0, 1.0))
        server.pdb.write_batch([], meta={"update_offset:updates": b"-8"})
        ap = server.applier()
        with pytest.raises(
            ValueError, match=rf"{re.escape(str(server.pdb.path))}.*'update_offset:updates'.*'-8'"
        ):
            ap.poll()
        assert server.served()[0] == 0.0
        ap.reset_offset()
        assert ap.poll() == 1 and server.served()[0] == 1.0
    finally:
        server.close()


def test_a_file_log_offset_without_a_log_id_is_refused(server: _Server) -> None:
    """An offset into a file log means something only with the id of the log it was taken in:
    stored alone it is refused (naming where it is stored), nothing applied; reset_offset
    refuses it too, and with its log id it is used."""
    pub = FileLogPublisher(server.log)
    offs = [pub.publish(_one(k, 1.0)) for k in range(4)]
    if server.pdb is None:
        server.off.write_text(offs[1])
    else:
        server.pdb.write_batch([], meta={"update_offset:updates": offs[1].encode()})
    ap = server.applier()
    with pytest.raises(ValueError, match=r"needs the id of the log it was taken in") as ei:
        ap.poll()
    assert server.where() in str(ei.value) and repr(offs[1]) in str(ei.value)
    assert ap.applied == 0 and server.served() == [0.0] * N
    with pytest.raises(ValueError, match=r"needs the id of the log it was taken in"):
        ap.reset_offset(offs[1])
    log_id = FileLogSource(server.log).read_log(None, None)[0]
    ap.reset_offset(offs[1], log_id)
    assert ap.poll() == 2 and server.served()[:5] == [0.0, 0.0, 1.0, 1.0, 0.0]


def _headerless_log(path: Path, batches: list[dict]) -> None:
    """A file of records with no log header in front."""
    path.write_bytes(b"".join(encode_batch(b) for b in batches))


def test_a_log_without_a_header_is_refused(server: _Server) -> None:
    """A file that starts with a record has no log header, hence no format version: readers
    and the writer refuse it naming the file; nothing is applied, nothing written."""
    _headerless_log(server.log, [_one(k, 1.0) for k in range(3)])
    data = server.log.read_bytes()
    ap = server.applier()
    msg = f"update log {server.log} has no format version; this hps reads format version 1"
    with pytest.raises(FormatVersionError, match=re.escape(msg)) as ei:
        ap.poll()
    assert (ei.value.found, ei.value.expected) == (None, LOG_VERSION)
    with pytest.raises(FormatVersionError, match="starts with an update record, not a log header"):
        FileLogPublisher(server.log)
    assert server.log.read_bytes() == data and server.served() == [0.0] * N


def test_a_torn_log_header_is_rewritten_by_the_writer(tmp_path: Path) -> None:
    log = tmp_path / "u.log"
    FileLogPublisher(log)
    header = log.read_bytes()
    assert header[:4] == b"HPSL" and len(header) == 33
    log.write_bytes(header[:20])  # a crash while the header was written
    assert FileLogSource(log).read(None) == []  # nothing to read yet, nothing refused
    with pytest.raises(OffsetPastEndError):
        FileLogSource(log).read("33")
    pub = FileLogPublisher(log)
    assert log.read_bytes()[:4] == b"HPSL" and log.stat().st_size == 33
    off = pub.publish(_one(0, 1.0))
    assert [o for o, _ in FileLogSource(log).read(None)] == [off]
    data = bytearray(log.read_bytes())
    data[30] ^= 0xFF  # the log id does not match its checksum
    log.write_bytes(bytes(data))
    src = FileLogSource(log)
    assert src.read(None) == [] and src.corrupt == 1  # refused, as a corrupt record is
    with pytest.raises(CorruptRecordError, match=r"record at offset 0 is corrupt \(bad log header"):
        FileLogPublisher(log)  # records follow the bad header: the writer refuses it too


@pytest.mark.parametrize("offset", ["x", "-1", "1.5", "", "٣"])
def test_reading_a_file_log_at_a_malformed_offset_is_a_value_error(
    tmp_path: Path, offset: str
) -> None:
    FileLogPublisher(tmp_path / "u.log").publish(_one(0, 1.0))
    with pytest.raises(ValueError, match="not a byte position"):
        FileLogSource(tmp_path / "u.log").read(offset)
