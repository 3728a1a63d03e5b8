from __future__ import annotations

import logging
import struct
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.volatile import HashMapBackend
from hps.updates import (
    CorruptRecordError,
    FileLogPublisher,
    FileLogSource,
    PublishUpdatesCallback,
    RedisStreamPublisher,
    RedisStreamSource,
    UpdateApplier,
    decode_batch,
    encode_batch,
    redis_client,
)
from tests.hps.hps_helpers import make_table

DIM = 3


def _batch(seed: int, n: int = 5, table: str = "t") -> dict:
    g = np.random.default_rng(seed)
    return {
        table: (
            g.choice(100, n, replace=False).astype(np.int64),
            g.integers(-9, 9, (n, DIM)).astype(np.float32),
        )
    }


def test_record_round_trip_and_checksum() -> None:
    b = {**_batch(0), "u": (np.array([1], np.int64), np.ones((1, 7), np.float32))}
    rec = encode_batch(b)
    out = decode_batch(rec)
    assert sorted(out) == ["t", "u"]
    for k in b:
        assert np.array_equal(out[k][0], b[k][0]) and np.array_equal(out[k][1], b[k][1])
    flipped = bytearray(rec)
    flipped[-1] ^= 1
    with pytest.raises(CorruptRecordError, match="checksum"):
        decode_batch(bytes(flipped))
    with pytest.raises(CorruptRecordError, match="payload has"):
        decode_batch(rec[:-2])


def _record(payload: bytes) -> bytes:
    """A record whose header and CRC are right around any payload."""
    return struct.pack("<4sBQI", b"HPSU", 1, len(payload), zlib.crc32(payload)) + payload


_GOOD = encode_batch({"t": (np.array([1], np.int64), np.ones((1, 2), np.float32))})[
    17:
]  # the payload


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"", "the table count"),
        (struct.pack("<I", 2) + _GOOD[4:], r"table 1 of 2's name length"),
        (
            _GOOD[:7] + struct.pack("<QI", 2**40, 2) + _GOOD[19:],
            r"table 't'.s 1099511627776 keys of 2 floats",
        ),
        (_GOOD[:6] + b"\xff" + _GOOD[7:], "table 0's name at byte 6 is not UTF-8"),
        (_GOOD + b"garbage", "7 bytes after its 1 table"),
        (struct.pack("<I", 2) + _GOOD[4:] + _GOOD[4:], "table 't' appears twice"),
    ],
    ids=["empty", "missing_table", "huge_count", "non_utf8_name", "trailing_bytes", "table_twice"],
)
def test_malformed_payload_with_a_valid_checksum_is_corrupt(payload: bytes, match: str) -> None:
    with pytest.raises(CorruptRecordError, match=match):
        decode_batch(_record(payload))


def test_file_log_torn_write_is_never_applied(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="hps.updates")
    log = tmp_path / "u.log"
    pub = FileLogPublisher(log)
    off1 = pub.publish(_batch(1))
    pub.publish(_batch(2))
    whole = log.read_bytes()
    log.write_bytes(whole[: int(off1) + 20])  # the second record torn mid-write
    src = FileLogSource(log)
    recs = src.read(None)
    assert [o for o, _ in recs] == [off1]  # only the complete record
    FileLogPublisher(log)  # reopening truncates the torn tail ...
    assert log.stat().st_size == int(off1)
    # ... and a record corrupted in place (complete length, bad CRC) stops the reader
    pub = FileLogPublisher(log)
    pub.publish(_batch(3))
    data = bytearray(log.read_bytes())
    data[-1] ^= 0xFF
    log.write_bytes(bytes(data))
    assert [o for o, _ in src.read(None)] == [off1] and src.corrupt == 1
    # reopening verifies the CRC: the bad last record is dropped (with a warning naming the
    # file, the offset and the bytes), so what is published next is readable
    caplog.clear()
    pub = FileLogPublisher(log)
    assert log.stat().st_size == int(off1)
    bad_len = len(data) - int(off1)
    assert any(
        str(log) in r.getMessage()
        and f"truncating {bad_len} bytes at offset {off1}" in r.getMessage()
        for r in caplog.records
    )
    off4, off5 = pub.publish(_batch(4)), pub.publish(_batch(5))
    src = FileLogSource(log)
    recs = src.read(off1)
    assert [o for o, _ in recs] == [off4, off5] and src.corrupt == 0
    for (_, got), want in zip(recs, (_batch(4), _batch(5))):
        assert np.array_equal(got["t"][0], want["t"][0]) and np.array_equal(
            got["t"][1], want["t"][1]
        )


def test_file_log_drops_a_tail_without_records(tmp_path: Path) -> None:
    log = tmp_path / "u.log"
    off1 = FileLogPublisher(log).publish(_batch(1))
    with open(log, "ab") as f:
        f.write(struct.pack("<4sBQI", b"JUNK", 7, 2**40, 0))  # a garbage header, absurd length
        f.write(bytes(4096))  # zeros where a crash extended the file but lost the data
    src = FileLogSource(log)
    assert [o for o, _ in src.read(None)] == [off1] and src.corrupt == 1  # refused, not awaited
    pub = FileLogPublisher(log)
    assert log.stat().st_size == int(off1)
    off2 = pub.publish(_batch(2))
    assert [o for o, _ in FileLogSource(log).read(None)] == [off1, off2]


@pytest.mark.parametrize("where", ["payload", "magic", "length"])
def test_file_log_refuses_a_corrupt_record_in_the_middle(tmp_path: Path, where: str) -> None:
    log = tmp_path / "u.log"
    pub = FileLogPublisher(log)
    off1, off2, off3 = (pub.publish(_batch(i)) for i in range(3))
    data = bytearray(log.read_bytes())
    if where == "payload":
        data[int(off2) - 3] ^= 0xFF  # record 2's CRC fails, its length is intact
    elif where == "magic":
        data[int(off1)] ^= 0xFF  # record 2's header is garbage
    else:
        data[int(off1) + 5] ^= 0x01  # record 2's payload length is one byte off
    log.write_bytes(bytes(data))
    with pytest.raises(
        CorruptRecordError,
        match=rf"record at offset {off1} is corrupt .* valid record follows at offset {off2}",
    ):
        FileLogPublisher(log)
    assert log.read_bytes() == bytes(data)  # nothing truncated, nothing appended
    src = FileLogSource(log)  # readers stop before the bad record: never skip it
    assert [o for o, _ in src.read(None)] == [off1] and src.corrupt == 1
    assert off3 not in [o for o, _ in src.read(off1)]


def _served(tmp_path: Path, pdb: bool = True):
    keys, rows = make_table(50, DIM, seed=4, key_space=100)
    vdb = HashMapBackend(num_partitions=2)
    vdb.create_table("t", DIM)
    vdb.insert("t", keys, rows)
    p = None
    if pdb:
        p = RocksDBBackend(tmp_path / "pdb")
        p.create_table("t", DIM)
        p.bulk_load("t", keys, rows)
    cache = EmbeddingCache(64, DIM, ways=8)
    s = LookupSession(
        [SessionTable("t", DIM, 0.0, 10_000, cache)], vdb, p, exact=True, hit_rate_threshold=1.0
    )
    s.lookup("t", torch.from_numpy(keys))  # cache filled
    return s, vdb, p, keys, rows


def test_applier_updates_every_tier_and_resumes(tmp_path: Path) -> None:
    s, vdb, pdb, keys, rows = _served(tmp_path)
    pub = FileLogPublisher(tmp_path / "u.log")
    b1 = {"t": (keys[:4].copy(), rows[:4] + 100)}
    b2 = {"t": (np.array([999], np.int64), np.full((1, DIM), 5.0, np.float32))}  # a new key
    pub.publish(b1)
    ap = UpdateApplier(FileLogSource(tmp_path / "u.log"), [s], vdb, pdb)
    assert ap.poll() == 1 and ap.poll() == 0
    q = torch.from_numpy(np.concatenate([keys[:4], [999]]))
    got = s.lookup("t", q)
    assert torch.equal(got[:4], torch.from_numpy(rows[:4] + 100))  # the cached copies followed
    assert np.array_equal(pdb.lookup("t", keys[:4])[0], rows[:4] + 100)
    pub.publish(b2)
    pdb.close()
    # restart: a new applier over the same persistent db resumes after b1
    pdb2 = RocksDBBackend(tmp_path / "pdb")
    ap2 = UpdateApplier(FileLogSource(tmp_path / "u.log"), [s], vdb, pdb2)
    assert ap2.offset == ap.offset
    assert ap2.poll() == 1 and ap2.applied == 1
    assert pdb2.lookup("t", np.array([999], np.int64))[1].all()
    s.close()
    pdb2.close()


def test_invalid_batch_is_applied_not_at_all(tmp_path: Path) -> None:
    s, vdb, pdb, keys, rows = _served(tmp_path)
    ap = UpdateApplier(FileLogSource(tmp_path / "none.log"), [s], vdb, pdb)
    bad = {
        "t": (keys[:2].copy(), rows[:2] + 1),
        "zz": (np.array([1], np.int64), np.ones((1, DIM), np.float32)),
    }
    with pytest.raises(ValueError, match="unknown table 'zz'"):
        ap.apply(bad, "10")
    assert np.array_equal(vdb.lookup("t", keys[:2])[0], rows[:2]) and ap.offset is None
    bad2 = {"t": (keys[:2].copy(), np.ones((2, DIM + 1), np.float32))}
    with pytest.raises(ValueError, match=r"rows \(2, 4\), expected \(2, 3\)"):
        ap.apply(bad2, "10")
    s.close()
    pdb.close()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"rows": np.ones((2, DIM), np.float64)}, "rows must have dtype float32, got float64"),
        ({"rows": np.ones((2, DIM), np.float16)}, "rows must have dtype float32, got float16"),
        ({"keys": np.array([1, 2], np.int32)}, "keys must have dtype int64, got int32"),
        ({"keys": np.array([[1], [2]], np.int64)}, r"keys must be 1-D \(n,\), got shape \(2, 1\)"),
        ({"keys": [1, 2]}, "keys must be a numpy array, got list"),
        ({"rows": [[1.0] * DIM] * 2}, r"rows list, expected \(2, 3\)"),
        (
            {"rows": np.array([[1, 1, 1], [1, np.nan, 1]], np.float32)},
            r"the row of key 2 holds a non-finite value \(nan\)",
        ),
        (
            {"rows": np.array([[np.inf, 1, 1], [1, 1, 1]], np.float32)},
            r"the row of key 1 holds a non-finite value \(inf\)",
        ),
    ],
    ids=["float64", "float16", "int32_keys", "2d_keys", "list_keys", "list_rows", "nan", "inf"],
)
@pytest.mark.parametrize("store", ["rocks_db", "offset_file"])
def test_a_batch_with_one_bad_table_applies_nothing_and_names_it(
    tmp_path: Path, bad: dict, match: str, store: str
) -> None:
    """Every table is checked before anything is written: the good table 't' (first in the
    batch) is not written to the volatile db, the cache or RocksDB when table 'u' is bad."""
    keys = np.arange(4, dtype=np.int64)
    vdb = HashMapBackend(num_partitions=1)
    pdb = RocksDBBackend(tmp_path / "pdb") if store == "rocks_db" else None
    for db in filter(None, (vdb, pdb)):
        for t in ("t", "u"):
            db.create_table(t, DIM)
            db.insert(t, keys, np.zeros((4, DIM), np.float32))
    s = LookupSession(
        [SessionTable(t, DIM, 0.0, 64, EmbeddingCache(8, DIM)) for t in ("t", "u")],
        vdb,
        pdb,
        exact=True,
        hit_rate_threshold=1.0,
    )
    q = torch.from_numpy(keys)
    for t in ("t", "u"):
        s.lookup(t, q)  # cached
    ap = UpdateApplier(
        FileLogSource(tmp_path / "none.log"), [s], vdb, pdb, offset_file=tmp_path / "off"
    )
    u = {"keys": np.array([1, 2], np.int64), "rows": np.ones((2, DIM), np.float32), **bad}
    batch = {
        "t": (keys[:2].copy(), np.full((2, DIM), 7.0, np.float32)),
        "u": (u["keys"], u["rows"]),
    }
    with pytest.raises(ValueError, match=rf"update for 'u': {match}"):
        ap.apply(batch, "99")
    for t in ("t", "u"):
        assert bool((s.lookup(t, q) == 0).all()), t  # the cached copies
        assert not vdb.lookup(t, keys)[0].any(), t
        if pdb is not None:
            assert not pdb.lookup(t, keys)[0].any(), t
    assert ap.offset is None and ap.applied == 0 and not (tmp_path / "off").exists()
    if pdb is not None:
        assert pdb.get_meta("update_offset:updates") is None
    # the same batch with 'u' right is applied whole
    ap.apply({**batch, "u": (np.array([1, 2], np.int64), np.ones((2, DIM), np.float32))}, "99")
    assert s.lookup("t", q)[:, 0].tolist() == [7.0, 7.0, 0.0, 0.0]
    assert s.lookup("u", q)[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0] and ap.offset == "99"
    s.close()
    if pdb is not None:
        pdb.close()


def test_readers_never_see_half_a_batch(tmp_path: Path) -> None:
    s, vdb, pdb, keys, rows = _served(tmp_path, pdb=False)
    ap = UpdateApplier(
        FileLogSource(tmp_path / "none.log"), [s], vdb, None, offset_file=tmp_path / "off"
    )
    q = torch.from_numpy(keys[:20].copy())
    stop = threading.Event()
    torn: list[float] = []

    def reader() -> None:
        while not stop.is_set():
            v = s.lookup("t", q)
            base = v - torch.from_numpy(rows[:20])
            if not torch.all(base == base[0, 0]):  # every row shifted by the same version
                torn.append(float(base.min()))

    t = threading.Thread(target=reader)
    t.start()
    for version in range(1, 30):
        ap.apply({"t": (keys[:20].copy(), rows[:20] + version)}, str(version))
    stop.set()
    t.join()
    assert not torn
    assert (tmp_path / "off").read_text() == "29"
    s.close()


class _FakeTrainer:
    """Duck-typed: the callback needs ``trainer.model.embeddings[<table>].weight``."""

    def __init__(self) -> None:
        self.model = SimpleNamespace(
            embeddings=torch.nn.ModuleDict({"t": torch.nn.EmbeddingBag(100, DIM)})
        )


def test_trainer_callback_publishes_changed_rows(tmp_path: Path) -> None:
    pub = FileLogPublisher(tmp_path / "u.log")
    cb = PublishUpdatesCallback(pub)
    tr = _FakeTrainer()
    cb.on_after_backward(tr, 0)  # snapshot before the first optimizer step
    with torch.no_grad():
        tr.model.embeddings["t"].weight[[3, 7]] += 1.0
    cb.on_step_end(tr, 0, 0.5)
    cb.on_step_end(tr, 1, 0.5)  # nothing changed: nothing published
    recs = FileLogSource(tmp_path / "u.log").read(None)
    assert len(recs) == 1 and cb.published == 1
    k, v = recs[0][1]["t"]
    assert k.tolist() == [3, 7]
    assert np.array_equal(v, tr.model.embeddings["t"].weight.detach()[[3, 7]].numpy())


def test_trainer_callback_republishes_after_a_failed_publish(tmp_path: Path) -> None:
    class FailsOnce(FileLogPublisher):
        failed = False

        def publish(self, batch: dict) -> str:
            if not self.failed:
                self.failed = True
                raise ConnectionError("redis went away")
            return super().publish(batch)

    cb = PublishUpdatesCallback(FailsOnce(tmp_path / "u.log"))
    tr = _FakeTrainer()
    cb.on_train_begin(tr)
    with torch.no_grad():
        tr.model.embeddings["t"].weight[3] += 1.0
    with pytest.raises(ConnectionError):
        cb.on_step_end(tr, 0, 0.5)
    assert cb.published == 0
    cb.on_step_end(tr, 1, 0.5)  # the transport is back: row 3 still differs from what servers hold
    recs = FileLogSource(tmp_path / "u.log").read(None)
    assert len(recs) == 1 and cb.published == 1
    k, v = recs[0][1]["t"]
    assert k.tolist() == [3]
    assert np.array_equal(v, tr.model.embeddings["t"].weight.detach()[[3]].numpy())
    cb.on_step_end(tr, 2, 0.5)  # published once: not again
    assert len(FileLogSource(tmp_path / "u.log").read(None)) == 1


def test_real_trainer_callback(tmp_path: Path) -> None:
    from embark import SyntheticCTR, TrainConfig, Trainer, build_model, get_workload

    wl = get_workload("tiny")
    cb = PublishUpdatesCallback(FileLogPublisher(tmp_path / "u.log"))
    trainer = Trainer(build_model(wl, seed=0), TrainConfig(), callbacks=[cb])
    trainer.fit(SyntheticCTR(wl, batch_size=16, seed=0).batches(2), steps=2, progress=False)
    recs = FileLogSource(tmp_path / "u.log").read(None)
    assert len(recs) == 2
    last = {}
    for _, b in recs:
        for name, (k, v) in b.items():
            last.update({(name, int(i)): row for i, row in zip(k, v)})
    for (name, i), row in last.items():
        assert np.array_equal(row, trainer.model.embeddings[name].weight.detach()[i].numpy())


@pytest.mark.redis
def test_redis_stream_transport(redis_cluster, tmp_path: Path) -> None:
    client = redis_client(redis_cluster.address, cluster=True)
    stream = f"upd_{tmp_path.name}"
    pub = RedisStreamPublisher(client, stream)
    ids = [pub.publish(_batch(i)) for i in range(3)]
    src = RedisStreamSource(client, stream)
    recs = src.read(None, max_records=2)
    assert [o for o, _ in recs] == ids[:2]
    assert [o for o, _ in src.read(ids[1])] == ids[2:]
    s, vdb, _, keys, rows = _served(tmp_path, pdb=False)
    ap = UpdateApplier(src, [s], vdb, None, offset_file=tmp_path / "off")
    client.xadd(stream, {b"r": b"HPSU garbage"})
    assert ap.poll() == 3 and src.corrupt == 1 and ap.offset == ids[2]
    client.delete(stream)
    s.close()


@pytest.mark.parametrize("store", ["rocks_db", "offset_file"])
def test_an_offset_past_the_end_of_a_replaced_log_is_an_error(tmp_path: Path, store: str) -> None:
    s, vdb, pdb, keys, rows = _served(tmp_path, pdb=store == "rocks_db")
    log = tmp_path / "u.log"
    pub = FileLogPublisher(log)
    for i in range(3):
        pub.publish(_batch(i))
    off = tmp_path / "u.log.offset"
    ap = UpdateApplier(FileLogSource(log), [s], vdb, pdb, offset_file=None if pdb else off)
    assert ap.poll() == 3
    log.rename(tmp_path / "u.log.old")  # the operator moves the log aside; the trainer starts anew
    FileLogPublisher(log).publish(
        {"t": (np.array([7], np.int64), np.full((1, DIM), 42.0, np.float32))}
    )
    size = log.stat().st_size
    with pytest.raises(
        CorruptRecordError,
        match=rf"update log {log}: the stored offset {ap.offset} is past "
        rf"the end of the log \({size} bytes\).*[Rr]eset",
    ):
        FileLogSource(log).read(ap.offset)
    where = (
        "update_offset:updates' in the persistent db" if pdb else f"delete the offset file {off}"
    )
    with pytest.raises(CorruptRecordError, match=where):
        ap.poll()
    # after a reset (also across a restart of the applier) the new log is applied from its start
    ap.reset_offset()
    ap2 = UpdateApplier(FileLogSource(log), [s], vdb, pdb, offset_file=None if pdb else off)
    assert ap2.offset is None and ap2.poll() == 1
    assert s.lookup("t", torch.tensor([7]))[0, 0].item() == 42.0
    s.close()
    if pdb:
        pdb.close()


def test_move_aside_advice_mentions_the_stored_offset(tmp_path: Path) -> None:
    log = tmp_path / "u.log"
    pub = FileLogPublisher(log)
    off1, _ = pub.publish(_batch(0)), pub.publish(_batch(1))
    data = bytearray(log.read_bytes())
    data[int(off1) - 3] ^= 0xFF
    log.write_bytes(bytes(data))
    with pytest.raises(
        CorruptRecordError, match=r"Move the log aside \(then reset every server's stored offset"
    ):
        FileLogPublisher(log)
