"""A key whose tier failed is never answered with the default vector: it falls through to a
persistent DB that holds every row, or the lookup raises ``TierUnavailableError`` naming the
table and the tier, counted in the statistics. First against a backend that fails on
purpose (no service needed), then against a real 3-node Redis cluster with a node killed and
restarted empty, and the repair that writes its partitions back."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.config import parse_config
from hps.parameter_server import HierarchicalParameterServer
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.redis_cluster import RedisClusterBackend, partition_name
from hps.storage.sparse_files import write_table
from hps.storage.volatile import HashMapBackend
from hps.types import TierRead, TierUnavailableError
from hps.updates import FileLogPublisher
from tests.hps.hps_helpers import make_table, reference_lookup

DIM = 4
DEFAULT = -7.0


class _FailingHashMap(HashMapBackend):
    """A hash map whose reads fail for keys ≥ ``fail_from`` (as a down Redis node's would)."""

    name = "flaky"

    def __init__(self, fail_from: int) -> None:
        super().__init__(num_partitions=2)
        self.fail_from = fail_from

    def read(self, table: str, keys: np.ndarray) -> TierRead:
        values, found = self.lookup(table, keys)
        failed = keys >= self.fail_from
        values[failed], found[failed] = 0.0, False
        return TierRead(values, found, failed, "node 127.0.0.1:1 down")


def _session(tmp_path: Path, cache: bool, pdb: str) -> tuple[LookupSession, np.ndarray, np.ndarray]:
    """Rows of keys ``0..199`` in a volatile DB that fails for keys ≥ 100; ``pdb`` is
    ``none``, ``loaded`` (holds every row) or ``partial`` (keys below 100 only, as a read-only
    RocksDB another server loaded in part)."""
    keys = np.arange(200, dtype=np.int64)
    rows = np.arange(200 * DIM, dtype=np.float32).reshape(200, DIM)
    vdb = _FailingHashMap(fail_from=100)
    vdb.create_table("t", DIM)
    vdb.insert("t", keys, rows)
    persistent = None
    if pdb != "none":
        persistent = RocksDBBackend(tmp_path / "pdb")
        persistent.create_table("t", DIM)
        if pdb == "loaded":
            persistent.bulk_load("t", keys, rows)
        else:
            persistent.insert("t", keys[:100], rows[:100])
    c = EmbeddingCache(16, DIM, ways=4) if cache else None
    s = LookupSession(
        [SessionTable("t", DIM, DEFAULT, 10_000, c)],
        vdb,
        persistent,
        hit_rate_threshold=1.0,
        exact=True,
    )
    return s, keys, rows


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("pdb", ["none", "partial"])
def test_a_failed_key_without_a_tier_to_fall_through_to_is_refused(
    tmp_path: Path, cache: bool, pdb: str
) -> None:
    s, keys, rows = _session(tmp_path, cache, pdb)
    try:
        q = torch.tensor([[3, 150], [5, 3]])
        with pytest.raises(TierUnavailableError) as e:
            s.lookup("t", q)
        err = e.value
        assert (err.table, err.tier, err.keys) == ("t", "volatile db (flaky)", 1)
        assert str(err).startswith(
            "table 't': 1 key(s) could not be read: the volatile db (flaky) failed for them "
            "(node 127.0.0.1:1 down); "
        )
        below = "there is no persistent db" if pdb == "none" else "does not hold every row"
        assert below in str(err) and "refused rather than answered with default vectors" in str(err)
        st = s.stats("t")
        assert st["unavailable"] == 1 and st["errors"] == 1 and st["tier_failed_keys"] == 1
        assert st["lookups"] == 0  # a refused lookup served nothing
        # keys the tier answered for are served; "not found" there is an answer (the default)
        ok = torch.tensor([[3, 99], [-5, 50]])
        assert torch.equal(s.lookup("t", ok), reference_lookup(keys, rows, ok, DEFAULT))
        st = s.stats("t")
        assert st["lookups"] == 1 and st["hits_unique"]["default"] == 1 and st["unavailable"] == 1
        s.drain()
        if cache:  # the background fill never caches a key no tier could read
            s.warm_up("t", np.array([150, 3], np.int64))
            assert s.tables["t"].cache is not None
            _, hit = s.tables["t"].cache.query(torch.tensor([150, 3]))
            assert hit.tolist() == [False, True]
    finally:
        s.close()
        if s.persistent is not None:
            s.persistent.close()


def test_a_failed_key_falls_through_to_a_persistent_db_holding_every_row(tmp_path: Path) -> None:
    s, keys, rows = _session(tmp_path, cache=True, pdb="loaded")
    try:
        q = torch.tensor([[3, 150], [199, 250]])  # 250 exists nowhere: the persistent db says so
        assert torch.equal(s.lookup("t", q), reference_lookup(keys, rows, q, DEFAULT))
        st = s.stats("t")
        assert st["unavailable"] == 0 and st["errors"] == 0 and st["tier_failed_keys"] == 3
        assert st["hits_unique"]["persistent"] == 2 and st["hits_unique"]["default"] == 1
    finally:
        s.close()
        assert s.persistent is not None
        s.persistent.close()


# ---------------------------------------------------------------- a real Redis cluster

pytest_redis = pytest.mark.redis


def _redis_server(
    redis_cluster, tmp_path: Path, pdb: bool = False, updates: bool = False
) -> tuple[HierarchicalParameterServer, str, np.ndarray, np.ndarray]:
    """A parameter server on a fresh table (dim 4, 8 partitions, one on node 1 at least) held
    by the Redis cluster, without a cache; with a RocksDB and a file-log update source when
    asked."""
    while True:
        table = f"tf_{uuid.uuid4().hex[:8]}"
        if any(redis_cluster.owner(partition_name(table, p)) == 1 for p in range(8)):
            break
    keys, rows = make_table(400, DIM, seed=3)
    write_table(tmp_path / "sparse" / table, keys, rows)
    doc = {
        "volatile_db": {
            "type": "redis_cluster",
            "address": redis_cluster.address,
            "num_partitions": 8,
            "retry_interval_s": 0.1,
            "socket_timeout_s": 0.5,
        },
        "persistent_db": {"type": "rocks_db", "path": "pdb"} if pdb else {"type": "none"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 512,
                "sparse_files": [f"sparse/{table}"],
                "embedding_table_names": [table],
                "embedding_vecsize_per_table": [DIM],
                "maxnum_catfeature_query_per_table_per_sample": [1],
                "default_value_for_each_table": [DEFAULT],
                "gpucache": False,
            }
        ],
    }
    if updates:
        doc["update_source"] = {"type": "file_log", "path": "u.log", "poll_interval_s": 0.05}
        FileLogPublisher(tmp_path / "u.log")  # the log exists (empty) before the server
    return HierarchicalParameterServer(parse_config(doc, tmp_path)), table, keys, rows


def _close(ps: HierarchicalParameterServer, table: str) -> None:
    """Delete ``table`` from the shared cluster and close ``ps``."""
    try:
        assert isinstance(ps.volatile, RedisClusterBackend)
        ps.volatile.clear(table)
    finally:
        ps.close()


def _redis(ps: HierarchicalParameterServer) -> RedisClusterBackend:
    assert isinstance(ps.volatile, RedisClusterBackend)
    return ps.volatile


def _lost_and_restarted(redis_cluster, ps: HierarchicalParameterServer, table: str) -> None:
    """Kill node 1 and restart it empty; wait until a read has seen it back."""
    redis_cluster.kill(1)
    redis_cluster.restart(1)
    vdb = _redis(ps)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not vdb.unmarked_reads:
        vdb.read(table, np.arange(2 * 400, dtype=np.int64))
        time.sleep(0.1)
    assert vdb.unmarked_reads


@pytest_redis
def test_a_killed_node_is_never_answered_with_default_vectors(
    redis_cluster, tmp_path: Path
) -> None:
    """Redis the only tier holding rows, no cache: while node 1 is down and after it restarts
    empty, every lookup touching its keys is refused (naming table and tier), never answered
    with the default vector; the repair writes its partitions back from the sparse files and
    answers are exact again."""
    ps, table, keys, rows = _redis_server(redis_cluster, tmp_path)
    s = ps.session("m")
    q = torch.from_numpy(keys[:300].copy())
    try:
        assert torch.equal(s.lookup(table, q), reference_lookup(keys, rows, q, DEFAULT))
        redis_cluster.kill(1)
        for _ in range(5):
            with pytest.raises(
                TierUnavailableError,
                match=rf"^table '{table}': \d+ key\(s\) .* the volatile db \(redis_cluster\) failed",
            ):
                s.lookup(table, q)
        redis_cluster.restart(1)  # empty: its partitions hold no mark
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with pytest.raises(TierUnavailableError) as e:
                s.lookup(table, q)
            if "hold no 'hps:loaded' mark" in str(e.value):
                break
            time.sleep(0.1)
        assert "their node restarted empty" in str(e.value)
        st = s.stats(table)
        assert st["unavailable"] >= 6 and st["hits_all"]["default"] == 0
        assert ps.start_background() is not None and ps.repair is not None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and ps.repair.restored == 0:
            time.sleep(0.1)
        assert ps.repair.restored >= 1 and _redis(ps).unmarked_partitions(table) == []
        assert torch.equal(s.lookup(table, q), reference_lookup(keys, rows, q, DEFAULT))
    finally:
        _close(ps, table)


@pytest_redis
def test_the_repair_writes_back_online_updates_from_the_persistent_db(
    redis_cluster, tmp_path: Path
) -> None:
    """With a RocksDB holding every row, a restarted node's partitions are written back with
    the rows as RocksDB holds them (an online update applied before the outage included)."""
    ps, table, keys, rows = _redis_server(redis_cluster, tmp_path, pdb=True, updates=True)
    s = ps.session("m")
    try:
        ps.start_background()
        new = rows + 1000
        FileLogPublisher(tmp_path / "u.log").publish({table: (keys, new)})
        deadline = time.monotonic() + 10
        q = torch.from_numpy(keys.copy())
        while time.monotonic() < deadline and not torch.equal(
            s.lookup(table, q), torch.from_numpy(new)
        ):
            time.sleep(0.05)
        assert torch.equal(s.lookup(table, q), torch.from_numpy(new))
        _lost_and_restarted(redis_cluster, ps, table)
        assert torch.equal(s.lookup(table, q), torch.from_numpy(new))  # from RocksDB meanwhile
        assert ps.repair is not None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _redis(ps).unmarked_partitions(table):
            time.sleep(0.1)
        r = _redis(ps).read(table, keys)
        assert r.found.all() and np.array_equal(r.values, new)  # Redis holds the update again
    finally:
        _close(ps, table)


@pytest_redis
def test_partitions_that_lost_online_updates_stay_refused(
    redis_cluster, tmp_path: Path, caplog
) -> None:
    """No persistent DB and an update source: the updates since the load lived only in the
    lost partitions, so no source holds their rows; they stay refused (never the sparse
    files' stale rows), and the log says a restart rebuilds them."""
    ps, table, keys, rows = _redis_server(redis_cluster, tmp_path, updates=True)
    s = ps.session("m")
    caplog.set_level(logging.ERROR, logger="hps.volatile_repair")
    try:
        ps.start_background()
        _lost_and_restarted(redis_cluster, ps, table)
        assert ps.repair is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not caplog.records:
            time.sleep(0.1)
        assert any("cannot be written back while serving" in r.message for r in caplog.records)
        with pytest.raises(TierUnavailableError, match="hold no 'hps:loaded' mark"):
            s.lookup(table, torch.from_numpy(keys.copy()))
        assert ps.repair.restored == 0
    finally:
        _close(ps, table)
