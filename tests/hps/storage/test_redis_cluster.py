"""A 3-node Redis cluster (real redis-server processes): layout, and a node killed mid-run."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.session import LookupSession, SessionTable
from hps.storage.persistent import RocksDBBackend
from hps.storage.redis_cluster import RedisClusterBackend, partition_name
from hps.storage.volatile import partition_of
from tests.hps.hps_helpers import make_table, reference_lookup

pytestmark = pytest.mark.redis


def test_cluster_has_three_masters_and_partitions_spread(redis_cluster) -> None:
    import redis

    nodes = redis.Redis(port=redis_cluster.ports[0]).execute_command("CLUSTER NODES")
    assert sum("master" in v["flags"] for v in nodes.values()) == 3
    b = RedisClusterBackend(redis_cluster.addresses, num_partitions=12)
    name = f"t_{uuid.uuid4().hex[:8]}"
    b.create_table(name, 3)
    keys, rows = make_table(600, 3, seed=2)
    b.insert(name, keys, rows)
    b.mark_loaded(name)
    assert b.size(name) == 600  # the marks are not rows
    assert b.available and b.held(name, 3) == (600, 600 * 3 * 4)  # the FP32 values
    with pytest.raises(ValueError, match="has dim 3, not 4"):
        b.held(name, 4)
    owners = {b._client.get_node_from_key(partition_name(name, p)).port for p in range(12)}
    assert len(owners) == 3  # one table's partitions land on every node
    v, f = b.lookup(name, np.concatenate([keys, [-1]]).astype(np.int64))
    assert f[:-1].all() and not f[-1] and np.array_equal(v[:-1], rows)
    b.clear(name)
    b.close()


def _tiers(
    redis_cluster, tmp_path: Path, name: str, keys: np.ndarray, rows: np.ndarray, **kw: int
) -> tuple[RedisClusterBackend, RocksDBBackend]:
    """Table ``name`` (``rows``, dim 4) in the cluster (8 partitions, 0.2 s retry, 0.5 s
    timeout) and in a RocksDB under ``tmp_path``."""
    vdb = RedisClusterBackend(
        redis_cluster.addresses, num_partitions=8, retry_interval_s=0.2, socket_timeout_s=0.5, **kw
    )
    vdb.create_table(name, 4)
    vdb.insert(name, keys, rows)
    vdb.mark_loaded(name)
    pdb = RocksDBBackend(tmp_path / "pdb")
    pdb.create_table(name, 4)
    pdb.bulk_load(name, keys, rows)
    return vdb, pdb


def _name_on_node(redis_cluster, node: int, parts: int = 8) -> str:
    """A fresh table name with at least one of its ``parts`` partitions on ``node``."""
    while True:
        name = f"t_{uuid.uuid4().hex[:8]}"
        if any(redis_cluster.owner(partition_name(name, p)) == node for p in range(parts)):
            return name


def test_node_killed_mid_run_falls_back_to_rocksdb(redis_cluster, tmp_path: Path, caplog) -> None:
    """A node killed under lookups: every answer stays exact (RocksDB serves its keys); it
    restarts empty: its partitions lack their mark, so their keys still fall through (never
    "not found"), counted, until they are written back and marked."""
    name = _name_on_node(redis_cluster, 1)
    keys, rows = make_table(2000, 4, seed=7)
    vdb, pdb = _tiers(redis_cluster, tmp_path, name, keys, rows)
    s = LookupSession([SessionTable(name, 4, -1.0, 100_000, None)], vdb, pdb)
    g = torch.Generator().manual_seed(1)

    def check() -> dict:
        q = torch.randint(-5, 4000, (512,), generator=g)
        assert torch.equal(s.lookup(name, q), reference_lookup(keys, rows, q, -1.0))
        return s.stats(name)["hits_unique"]

    before = check()
    assert before["volatile"] > 0 and before["persistent"] == 0
    caplog.set_level(logging.WARNING, logger="hps.storage.redis_cluster")
    redis_cluster.kill(1)
    t0 = time.monotonic()
    during = [check() for _ in range(10)]  # every lookup still exact, served from RocksDB
    assert time.monotonic() - t0 < 10
    assert vdb.errors >= 1 and during[-1]["persistent"] > before["persistent"]
    assert s.stats(name)["tier_failed_keys"] > 0 and s.stats(name)["unavailable"] == 0
    assert any("redis cluster lookup failed" in r.message for r in caplog.records)
    # an update while the node is down is queued, not lost
    vdb.insert(name, keys[:10], rows[:10] + 1)
    assert vdb.pending_rows == 10
    redis_cluster.restart(1)
    deadline = time.monotonic() + 10
    while vdb.pending_rows and time.monotonic() < deadline:
        time.sleep(0.25)
        vdb.read(name, keys[10:11])  # after the back-off a read reconnects and replays
    assert vdb.pending_rows == 0  # replayed
    on_node = np.isin(
        partition_of(keys, 8),
        [p for p in range(8) if redis_cluster.owner(partition_name(name, p)) == 1],
    )
    lost = vdb.unmarked_partitions(name)
    assert on_node.any() and np.array_equal(np.isin(partition_of(keys, 8), lost), on_node)
    r = vdb.read(name, keys)  # the restarted node's keys fail, the others are found
    assert np.array_equal(r.failed, on_node) and r.found[~on_node].all()
    assert "hold no 'hps:loaded' mark" in r.reason
    failed_before = s.stats(name)["tier_failed_keys"]
    # still exact: the restarted node's keys fall through to RocksDB (keys[:10] left out: the
    # update above went to Redis only)
    q = torch.from_numpy(np.concatenate([keys[10:], np.arange(4000, 4100, dtype=np.int64)]))
    assert torch.equal(s.lookup(name, q), reference_lookup(keys, rows, q, -1.0))
    assert s.stats(name)["tier_failed_keys"] > failed_before
    back = on_node.copy()
    back[:10] = False  # written back as hps.volatile_repair does; the replayed updates stay
    vdb.insert(name, keys[back], rows[back])
    vdb.mark_loaded(name, lost)
    r = vdb.read(name, keys)
    assert r.found.all() and not r.failed.any()
    assert np.array_equal(r.values[:10], rows[:10] + 1) and np.array_equal(r.values[10:], rows[10:])
    vol_before = s.stats(name)["hits_unique"]["volatile"]
    q = torch.from_numpy(keys[:10].copy())
    s.lookup(name, q)
    assert s.stats(name)["hits_unique"]["volatile"] == vol_before + 10  # used again
    s.close()
    vdb.clear(name)
    vdb.close()
    pdb.close()


def test_an_update_that_no_longer_fits_the_outage_queue_is_retried_not_lost(
    redis_cluster, tmp_path: Path
) -> None:
    """While a node is down, a write beyond max_pending_rows is refused, not dropped: Redis still
    holds the old rows and is read first, so a dropped update would be undone once the node is
    back. The applier's batch fails, its offset stays, and the next poll after recovery applies
    it: every row serves the update."""
    from hps.types import VolatileUnavailableError
    from hps.updates import FileLogPublisher, FileLogSource, UpdateApplier

    name = f"t_{uuid.uuid4().hex[:8]}"
    keys, old = np.arange(200, dtype=np.int64), np.zeros((200, 4), np.float32)
    vdb, pdb = _tiers(redis_cluster, tmp_path, name, keys, old, max_pending_rows=50)
    s = LookupSession([SessionTable(name, 4, -1.0, 10_000, None)], vdb, pdb)
    pub = FileLogPublisher(tmp_path / "u.log")
    app = UpdateApplier(FileLogSource(tmp_path / "u.log"), [s], vdb, pdb)
    try:
        redis_cluster.kill(1)
        s.lookup(name, torch.from_numpy(keys))  # the failure is noticed: the backend is down
        pub.publish({name: (keys, np.full((200, 4), 7.0, np.float32))})
        with pytest.raises(
            VolatileUnavailableError, match=r"200 rows of .* neither written nor queued"
        ):
            app.poll()
        assert app.offset is None and app.applied == 0 and vdb.dropped_rows == 200
        redis_cluster.restart(1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.25)
            try:
                if app.poll() == 1:
                    break
            except VolatileUnavailableError:
                continue
        assert app.applied == 1
        served = s.lookup(name, torch.from_numpy(keys))
        assert bool((served == 7.0).all())
        assert s.stats(name)["hits_unique"]["volatile"] > 0  # from Redis again, not only RocksDB
    finally:
        s.close()
        vdb.clear(name)
        vdb.close()


def test_the_tier_stays_down_until_the_replay_has_finished(redis_cluster) -> None:
    """While queued writes are replayed after an outage, lookups fall through (a row read from
    Redis then would be the old one, and would be cached for good), and writes made meanwhile
    queue behind the replay and reach Redis in order."""
    import threading

    name = f"t_{uuid.uuid4().hex[:8]}"
    keys = np.arange(8, dtype=np.int64)
    vdb = RedisClusterBackend(redis_cluster.addresses, num_partitions=4, retry_interval_s=0.1)
    vdb.create_table(name, 2)
    vdb.insert(name, keys, np.zeros((8, 2), np.float32))
    vdb.mark_loaded(name)
    try:
        vdb._fail("a simulated outage", ConnectionError("node down"))
        vdb.insert(name, keys[:1], np.full((1, 2), 7.0, np.float32))  # queued
        assert vdb.pending_rows == 1
        time.sleep(0.15)  # the back-off is over: the next call replays
        entered, release = threading.Event(), threading.Event()
        real_write = vdb._write

        def held_write(*args: object) -> None:
            entered.set()
            assert release.wait(10)
            real_write(*args)

        vdb._write = held_write
        replayer = threading.Thread(target=vdb.lookup, args=(name, keys[5:6]))
        replayer.start()
        assert entered.wait(10)
        r = vdb.read(name, keys[:1])  # during the replay: failed, never the old row
        assert r.failed.all() and not r.found.any() and vdb.skipped_lookups >= 1
        assert "replaying" in r.reason
        vdb.insert(name, keys[1:2], np.full((1, 2), 9.0, np.float32))  # queued behind it
        assert vdb.pending_rows == 1
        vdb._write = real_write
        release.set()
        replayer.join(10)
        assert not replayer.is_alive() and vdb.pending_rows == 0
        v, f = vdb.lookup(name, keys[:3])
        assert f.all() and v.tolist() == [[7.0, 7.0], [9.0, 9.0], [0.0, 0.0]]
    finally:
        vdb._write = real_write if "real_write" in locals() else vdb._write
        vdb.clear(name)
        vdb.close()


def test_an_unreachable_cluster_at_start_is_an_error_or_starts_down(
    redis_cluster, monkeypatch
) -> None:
    """No node answering at construction: a ValueError naming the addresses, or, with
    ``start_down`` (a server with a persistent DB), a backend that is down (its reads fail:
    "not found" would be a guess), queues writes and the mark, and connects and replays them
    once the cluster answers."""
    import socket

    from hps.types import TierUnavailableError, VolatileUnavailableError

    with socket.socket() as sk:  # a port nobody listens on
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    with pytest.raises(
        ValueError, match=rf"redis cluster at 127\.0\.0\.1:{port} cannot be reached"
    ):
        RedisClusterBackend([("127.0.0.1", port)], socket_timeout_s=0.5)

    name = f"t_{uuid.uuid4().hex[:8]}"
    real_connect = RedisClusterBackend._connect

    def refused(self: RedisClusterBackend) -> None:
        raise ConnectionError("connection refused")

    monkeypatch.setattr(RedisClusterBackend, "_connect", refused)
    vdb = RedisClusterBackend(
        redis_cluster.addresses, num_partitions=4, retry_interval_s=0.1, start_down=True
    )
    try:
        assert vdb.errors == 1 and not vdb.available
        vdb.create_table(name, 2)
        r = vdb.read(name, np.arange(3, dtype=np.int64))
        assert r.failed.all() and not r.found.any()
        with pytest.raises(TierUnavailableError, match=r"3 key\(s\) could not be read"):
            vdb.lookup(name, np.arange(3, dtype=np.int64))
        vdb.insert(name, np.arange(3, dtype=np.int64), np.ones((3, 2), np.float32))
        vdb.mark_loaded(name)  # queued behind the rows
        assert vdb.pending_rows == 3
        with pytest.raises(VolatileUnavailableError, match="has not answered since the start"):
            vdb.size(name)
        time.sleep(0.15)
        r = vdb.read(name, np.arange(3, dtype=np.int64))  # still refused: down again
        assert r.failed.all() and vdb.errors == 2 and vdb.pending_rows == 3
        monkeypatch.setattr(RedisClusterBackend, "_connect", real_connect)
        time.sleep(0.15)
        v, f = vdb.lookup(name, np.arange(3, dtype=np.int64))  # connects, replays, reads
        assert f.all() and np.array_equal(v, np.ones((3, 2), np.float32))
        assert vdb.pending_rows == 0 and vdb.size(name) == 3
    finally:
        monkeypatch.setattr(RedisClusterBackend, "_connect", real_connect)
        if vdb._client is not None:
            vdb.clear(name)
        vdb.close()
