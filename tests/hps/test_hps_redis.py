"""A 3-node Redis cluster (real redis-server processes): layout, and a node killed mid-run."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hps_helpers import make_table, reference_lookup

from hps.persistent import RocksDBBackend
from hps.redis_cluster import RedisClusterBackend, partition_name
from hps.session import LookupSession, SessionTable

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
    assert b.size(name) == 600
    owners = {b._client.get_node_from_key(partition_name(name, p)).port for p in range(12)}
    assert len(owners) == 3  # one table's partitions land on every node
    v, f = b.lookup(name, np.concatenate([keys, [-1]]).astype(np.int64))
    assert f[:-1].all() and not f[-1] and np.array_equal(v[:-1], rows)
    b.clear(name)
    b.close()


def test_node_killed_mid_run_falls_back_to_rocksdb(redis_cluster, tmp_path: Path, caplog) -> None:
    name = f"t_{uuid.uuid4().hex[:8]}"
    keys, rows = make_table(2000, 4, seed=7)
    vdb = RedisClusterBackend(redis_cluster.addresses, num_partitions=8, retry_interval_s=0.2,
                              socket_timeout_s=0.5)
    vdb.create_table(name, 4)
    vdb.insert(name, keys, rows)
    pdb = RocksDBBackend(tmp_path / "pdb")
    pdb.create_table(name, 4)
    pdb.bulk_load(name, keys, rows)
    s = LookupSession([SessionTable(name, 4, -1.0, 100_000, None)], vdb, pdb)
    g = torch.Generator().manual_seed(1)

    def check() -> dict:
        q = torch.randint(-5, 4000, (512,), generator=g)
        assert torch.equal(s.lookup(name, q), reference_lookup(keys, rows, q, -1.0))
        return s.stats(name)["hits_unique"]

    before = check()
    assert before["volatile"] > 0 and before["persistent"] == 0
    caplog.set_level(logging.WARNING, logger="hps.redis_cluster")
    redis_cluster.kill(1)
    t0 = time.monotonic()
    during = [check() for _ in range(10)]  # every lookup still exact, served from RocksDB
    assert time.monotonic() - t0 < 10
    assert vdb.errors >= 1 and during[-1]["persistent"] > before["persistent"]
    assert any("redis cluster lookup failed" in r.message for r in caplog.records)
    # an update while the node is down is queued, not lost
    vdb.insert(name, keys[:10], rows[:10] + 1)
    assert vdb.pending_rows == 10
    redis_cluster.restart(1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.25)
        v, f = vdb.lookup(name, keys[:10])
        if f.all():
            break
    assert f.all() and np.array_equal(v, rows[:10] + 1) and vdb.pending_rows == 0  # replayed
    vol_before = s.stats(name)["hits_unique"]["volatile"]
    q = torch.from_numpy(keys[:10].copy())
    s.lookup(name, q)
    assert s.stats(name)["hits_unique"]["volatile"] == vol_before + 10  # used again
    s.close()
    vdb.clear(name)
    vdb.close()
    pdb.close()


def test_an_update_that_no_longer_fits_the_outage_queue_is_retried_not_lost(redis_cluster, tmp_path: Path) -> None:
    """While a node is down, a write beyond max_pending_rows is refused, not dropped: Redis still
    holds the old rows and is read first, so a dropped update would be undone once the node is
    back. The applier's batch fails, its offset stays, and the next poll after recovery applies
    it: every row serves the update."""
    from hps.types import VolatileUnavailableError
    from hps.updates import FileLogPublisher, FileLogSource, UpdateApplier

    name = f"t_{uuid.uuid4().hex[:8]}"
    keys, old = np.arange(200, dtype=np.int64), np.zeros((200, 4), np.float32)
    vdb = RedisClusterBackend(redis_cluster.addresses, num_partitions=8, retry_interval_s=0.2,
                              socket_timeout_s=0.5, max_pending_rows=50)
    vdb.create_table(name, 4)
    vdb.insert(name, keys, old)
    pdb = RocksDBBackend(tmp_path / "pdb")
    pdb.create_table(name, 4)
    pdb.bulk_load(name, keys, old)
    s = LookupSession([SessionTable(name, 4, -1.0, 10_000, None)], vdb, pdb)
    pub = FileLogPublisher(tmp_path / "u.log")
    app = UpdateApplier(FileLogSource(tmp_path / "u.log"), [s], vdb, pdb)
    try:
        redis_cluster.kill(1)
        s.lookup(name, torch.from_numpy(keys))  # the failure is noticed: the backend is down
        pub.publish({name: (keys, np.full((200, 4), 7.0, np.float32))})
        with pytest.raises(VolatileUnavailableError, match=r"200 rows of .* neither written nor queued"):
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
