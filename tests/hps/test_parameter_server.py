"""HierarchicalParameterServer restarts: online updates applied before a restart are served
after it (a new ``from_config`` on the same folder, as ``python -m hps.server`` restarted)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.parameter_server import HierarchicalParameterServer
from hps.storage.sparse_files import write_table
from hps.updates import FileLogPublisher

DIM = 4


def _folder(tmp_path: Path, pdb: dict, vdb: str = "hash_map") -> Path:
    keys = np.arange(100, dtype=np.int64)
    write_table(tmp_path / "sparse" / "t", keys, np.zeros((100, DIM), np.float32))
    doc = {
        "volatile_db": {"type": vdb},
        "persistent_db": pdb,
        "update_source": {"type": "file_log", "path": "u.log"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 16,
                "sparse_files": ["sparse/t"],
                "embedding_table_names": ["t"],
                "embedding_vecsize_per_table": [DIM],
                "maxnum_catfeature_query_per_table_per_sample": [1],
                "gpucache": False,
            }
        ],
    }
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    return tmp_path / "ps.json"


def _served(ps: HierarchicalParameterServer, keys: list[int]) -> list[float]:
    return ps.session("m").lookup("t", torch.tensor(keys))[:, 0].tolist()


@pytest.mark.parametrize(
    "pdb", [{"type": "none"}, {"type": "rocks_db", "path": "pdb"}], ids=["offset_file", "rocks_db"]
)
def test_a_restart_serves_the_updated_rows(tmp_path: Path, pdb: dict) -> None:
    cfg = _folder(tmp_path, pdb)
    pub = FileLogPublisher(tmp_path / "u.log")
    pub.publish({"t": (np.arange(5, dtype=np.int64), np.full((5, DIM), 9.0, np.float32))})
    ps = HierarchicalParameterServer.from_config(cfg)
    assert ps.update_applier().poll() == 1
    assert _served(ps, [0, 4, 5]) == [9.0, 9.0, 0.0]
    ps.close()
    pub.publish({"t": (np.array([4, 7], np.int64), np.full((2, DIM), 3.0, np.float32))})

    ps = HierarchicalParameterServer.from_config(cfg)  # restart on the same folder
    try:
        ap = ps.update_applier()
        ap.poll()
        assert _served(ps, [0, 3, 4, 5, 7]) == [9.0, 9.0, 3.0, 0.0, 3.0]
        assert ap.offset == str((tmp_path / "u.log").stat().st_size)
        if ps.persistent is not None:  # resumed after the stored offset: only the new batch
            assert ap.applied == 1
        assert ap.poll() == 0
    finally:
        ps.close()


def test_a_restart_before_polling_serves_the_persistent_rows(tmp_path: Path) -> None:
    cfg = _folder(tmp_path, {"type": "rocks_db", "path": "pdb"}, vdb="parallel_hash_map")
    FileLogPublisher(tmp_path / "u.log").publish(
        {"t": (np.arange(3, dtype=np.int64), np.full((3, DIM), 2.0, np.float32))}
    )
    ps = HierarchicalParameterServer.from_config(cfg)
    ps.update_applier().poll()
    ps.close()
    ps = HierarchicalParameterServer.from_config(cfg)  # the volatile tier is read first
    try:
        assert _served(ps, [0, 2, 3]) == [2.0, 2.0, 0.0]
        assert ps.volatile.lookup("t", np.array([1], np.int64))[0][0, 0] == 2.0
    finally:
        ps.close()


def test_start_background_applies_a_backlog_before_it_returns(tmp_path: Path) -> None:
    """After a restart in offset-file mode the whole log is replayed; 300 one-row records are
    more than one poll (64): start_background drains them all before the server serves, not
    64 per poll interval while stale rows are served."""
    cfg = _folder(tmp_path, {"type": "none"})
    pub = FileLogPublisher(tmp_path / "u.log")
    for i in range(300):
        pub.publish({"t": (np.array([i % 100], np.int64), np.full((1, DIM), float(i), np.float32))})
    ps = HierarchicalParameterServer.from_config(cfg)
    try:
        stops = ps.start_background(refresh_interval_s=0)
        assert _served(ps, [0, 99]) == [200.0, 299.0]  # the last write of each key
        for ev in stops:
            ev.set()
    finally:
        ps.close()
    ps = HierarchicalParameterServer.from_config(cfg)  # restart: replayed from the start
    try:
        ap = ps.update_applier()
        assert ap.drain() == 300 and ap.drain() == 0
        assert _served(ps, [0, 99]) == [200.0, 299.0]
    finally:
        ps.close()


@pytest.mark.parametrize(
    "vdb",
    [
        {"type": "hash_map", "overflow_margin": 60},
        {"type": "parallel_hash_map", "num_partitions": 4, "overflow_margin": 20},
    ],
    ids=["hash_map", "parallel_hash_map"],
)
def test_a_volatile_only_server_that_cannot_hold_every_row_refuses_to_start(
    tmp_path: Path, vdb: dict
) -> None:
    """Without a persistent DB the rows a full volatile DB evicts while loading are held by no
    tier and would be served as default vectors: an error naming the table and the knobs. With
    room for every row the same server starts and serves them all."""
    cfg = _folder(tmp_path, {"type": "none"})
    doc = json.loads(cfg.read_text())
    doc["volatile_db"] = vdb
    cfg.write_text(json.dumps(doc))
    with pytest.raises(
        ValueError,
        match=r"table 't': the volatile db holds \d+ of its 100 rows after "
        r"loading \(overflow_margin \d+ rows per partition",
    ):
        HierarchicalParameterServer.from_config(cfg)
    doc["volatile_db"]["overflow_margin"] = 100
    cfg.write_text(json.dumps(doc))
    ps = HierarchicalParameterServer.from_config(cfg)
    try:
        assert ps.volatile.size("t") == 100 and _served(ps, [0, 99]) == [0.0, 0.0]
    finally:
        ps.close()


def test_a_non_finite_update_is_refused_at_publish_and_never_blocks_a_start(
    tmp_path: Path, caplog
) -> None:
    """A NaN row is refused when published (nothing reaches the log). One in a log written by
    a foreign publisher does not stop the server from starting: it is logged, left unapplied
    (with the records after it) and retried, until the operator skips it by the offset the
    message names (:meth:`HierarchicalParameterServer.skip_update`)."""
    import re
    import struct
    import zlib

    from hps.updates import InvalidUpdateError, encode_batch

    cfg = _folder(tmp_path, {"type": "none"})
    pub = FileLogPublisher(tmp_path / "u.log")
    pub.publish({"t": (np.array([1], np.int64), np.full((1, DIM), 2.0, np.float32))})
    size = (tmp_path / "u.log").stat().st_size
    nan = np.full((1, DIM), 1.0, np.float32)
    nan[0, 1] = np.nan
    with pytest.raises(
        InvalidUpdateError, match=r"update for 't': the row of key 3 holds a non-finite"
    ):
        pub.publish({"t": (np.array([3], np.int64), nan)})
    assert (tmp_path / "u.log").stat().st_size == size
    # a foreign publisher's record: the same layout, NaN row included
    payload = encode_batch({"t": (np.array([3], np.int64), np.ones((1, DIM), np.float32))})[17:]
    payload = payload[: -4 * DIM] + nan.tobytes()
    with open(tmp_path / "u.log", "ab") as f:
        f.write(struct.pack("<4sBQI", b"HPSU", 1, len(payload), zlib.crc32(payload)) + payload)
    pub.publish({"t": (np.array([5], np.int64), np.full((1, DIM), 7.0, np.float32))})

    ps = HierarchicalParameterServer.from_config(cfg)
    try:
        with caplog.at_level("ERROR", logger="hps.updates"):
            stops = ps.start_background(refresh_interval_s=0)
        for ev in stops:
            ev.set()
        assert _served(ps, [1, 3, 5]) == [2.0, 0.0, 0.0]  # stalled at the bad record
        msg = next(r.getMessage() for r in caplog.records if "non-finite" in r.getMessage())
        off, log_id = re.search(r"UpdateApplier.skip\('(\d+)', '([^']+)'\)", msg).groups()
        ps.skip_update(off, log_id)  # the operator skips it
        assert ps.applier is not None and ps.applier.drain() == 1
        assert _served(ps, [1, 3, 5]) == [2.0, 0.0, 7.0]
    finally:
        ps.close()


# ------------------------------------------------- a RocksDB and the sparse files it came from
def _rocksdb_with_an_update(tmp_path: Path) -> Path:
    """``ps.json`` over zero rows with a writable RocksDB, started once and updated (keys 0..4
    hold 9.0 in RocksDB and at the stored offset)."""
    cfg = _folder(tmp_path, {"type": "rocks_db", "path": "pdb"})
    FileLogPublisher(tmp_path / "u.log").publish(
        {"t": (np.arange(5, dtype=np.int64), np.full((5, DIM), 9.0, np.float32))}
    )
    ps = HierarchicalParameterServer.from_config(cfg)
    assert ps.update_applier().poll() == 1
    ps.close()
    return cfg


def test_a_restart_on_a_copy_of_the_same_files_keeps_the_updated_rows(tmp_path: Path) -> None:
    cfg = _rocksdb_with_an_update(tmp_path)
    shutil.copytree(tmp_path / "sparse", tmp_path / "copy")  # new inodes and times, same bytes
    shutil.rmtree(tmp_path / "sparse")
    (tmp_path / "copy").rename(tmp_path / "sparse")
    ps = HierarchicalParameterServer.from_config(cfg)
    try:
        assert _served(ps, [0, 4, 5]) == [9.0, 9.0, 0.0]
        assert ps.update_applier().poll() == 0  # the offset was kept with the rows
    finally:
        ps.close()


def test_a_restart_on_other_files_loads_them_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _rocksdb_with_an_update(tmp_path)
    write_table(
        tmp_path / "sparse" / "t",
        np.arange(50, dtype=np.int64),
        np.full((50, DIM), 5.0, np.float32),
        overwrite=True,
    )  # another export: 50 rows of 5.0
    with caplog.at_level(logging.WARNING, logger="hps.parameter_server"):
        ps = HierarchicalParameterServer.from_config(cfg)
    try:
        assert _served(ps, [0, 4, 49, 50]) == [5.0, 5.0, 5.0, 0.0]  # none of the old rows
        assert ps.persistent.loaded_rows("t") == 50
        assert "was loaded from other sparse files" in caplog.text
        assert ps.update_applier().poll() == 0  # the offset stays: the log is not replayed
    finally:
        ps.close()


def test_other_files_that_cannot_be_loaded_leave_the_database_as_it_was(tmp_path: Path) -> None:
    cfg = _rocksdb_with_an_update(tmp_path)
    emb = tmp_path / "sparse" / "t" / "emb_vector"
    good = emb.read_bytes()
    emb.write_bytes(good[:-3])  # truncated
    with pytest.raises(ValueError, match="not a whole number of rows"):
        HierarchicalParameterServer.from_config(cfg)
    emb.write_bytes(good)  # the old export back (same bytes, new times): its rows are served
    ps = HierarchicalParameterServer.from_config(cfg)
    try:
        assert _served(ps, [0, 4, 5]) == [9.0, 9.0, 0.0]
    finally:
        ps.close()


def test_a_table_of_another_dim_is_loaded_again(tmp_path: Path) -> None:
    cfg = _rocksdb_with_an_update(tmp_path)
    doc = json.loads(cfg.read_text())
    doc["models"][0]["embedding_vecsize_per_table"] = [DIM + 2]
    doc["update_source"] = {"type": "none"}  # the log's rows are of the old dim
    cfg.write_text(json.dumps(doc))
    rows = np.full((10, DIM + 2), 1.0, np.float32)
    write_table(tmp_path / "sparse" / "t", np.arange(10, dtype=np.int64), rows, overwrite=True)
    ps = HierarchicalParameterServer.from_config(cfg)
    try:
        got = ps.session("m").lookup("t", torch.tensor([0, 9]))
        assert got.shape == (2, DIM + 2) and got.eq(1.0).all()
    finally:
        ps.close()


def test_a_replica_that_does_not_load_refuses_a_database_of_other_files(tmp_path: Path) -> None:
    cfg = _rocksdb_with_an_update(tmp_path)
    HierarchicalParameterServer.from_config(cfg, load=False).close()  # the same files: fine
    write_table(
        tmp_path / "sparse" / "t",
        np.arange(100, dtype=np.int64),
        np.ones((100, DIM), np.float32),
        overwrite=True,
    )
    with pytest.raises(ValueError, match=r"load=False.*start the loading server first.*delete"):
        HierarchicalParameterServer.from_config(cfg, load=False)
    shutil.rmtree(tmp_path / "sparse")  # a replica without the sparse files trusts the DB
    ps = HierarchicalParameterServer.from_config(cfg, load=False)
    try:
        assert _served(ps, [0, 5]) == [9.0, 0.0]
    finally:
        ps.close()


@pytest.mark.redis
def test_a_reload_clears_the_redis_copy_of_the_changed_table(redis_cluster, tmp_path: Path) -> None:
    """Redis outlives a restart like RocksDB: key 70 of the old export (the new one has keys
    0..49) must not be served from it."""
    table = f"reload_{tmp_path.name[-12:]}".replace("-", "_")
    write_table(
        tmp_path / "sparse" / table, np.arange(100, dtype=np.int64), np.ones((100, DIM), np.float32)
    )
    doc = {
        "volatile_db": {"type": "redis_cluster", "address": redis_cluster.address},
        "persistent_db": {"type": "rocks_db", "path": "pdb"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 16,
                "sparse_files": [f"sparse/{table}"],
                "embedding_table_names": [table],
                "embedding_vecsize_per_table": [DIM],
                "maxnum_catfeature_query_per_table_per_sample": [1],
                "gpucache": False,
            }
        ],
    }
    (tmp_path / "ps.json").write_text(json.dumps(doc))

    def served(keys: list[int]) -> list[float]:
        ps = HierarchicalParameterServer.from_config(tmp_path / "ps.json")
        try:
            return ps.session("m").lookup(table, torch.tensor(keys))[:, 0].tolist()
        finally:
            ps.close()

    assert served([0, 70]) == [1.0, 1.0]
    rows = np.full((50, DIM), 2.0, np.float32)
    write_table(tmp_path / "sparse" / table, np.arange(50, dtype=np.int64), rows, overwrite=True)
    assert served([0, 49, 70]) == [2.0, 2.0, 0.0]
