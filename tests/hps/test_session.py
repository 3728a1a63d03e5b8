from __future__ import annotations

import itertools
import threading
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
from hps.storage.sparse_files import write_table
from hps.storage.volatile import HashMapBackend
from tests.hps.hps_helpers import make_table, reference_lookup

DIM = 4
DEFAULT = -7.0
N = 400


def _build(tmp_path: Path, cache: str, vdb: str, pdb: str, redis_cluster=None):
    keys, rows = make_table(N, DIM, seed=11)
    name = f"t_{uuid.uuid4().hex[:8]}"
    volatile = persistent = None
    if vdb == "hash_map":
        volatile = HashMapBackend(num_partitions=3)
    elif vdb == "redis":
        from hps.storage.redis_cluster import RedisClusterBackend

        volatile = RedisClusterBackend(redis_cluster.addresses, num_partitions=4)
    if pdb == "rocks_db":
        persistent = RocksDBBackend(tmp_path / "pdb", max_batch_size=50)
        persistent.create_table(name, DIM)
        persistent.bulk_load(name, keys, rows)
    if volatile is not None:
        volatile.create_table(name, DIM)
        half = N // 2 if persistent is not None else N  # both tiers: rows split between them
        volatile.insert(name, keys[:half], rows[:half])
        volatile.mark_loaded(name)
    c = None if cache == "none" else EmbeddingCache(N // 8, DIM, ways=8)
    s = LookupSession(
        [SessionTable(name, DIM, DEFAULT, 10_000, c)],
        volatile,
        persistent,
        hit_rate_threshold=1.0 if cache == "sync" else 0.0,
        exact=cache != "none",
    )
    return s, name, keys, rows, volatile, persistent


COMBOS = [
    (c, v, p)
    for c, v, p in itertools.product(
        ["none", "sync", "exact"], ["none", "hash_map", "redis"], ["none", "rocks_db"]
    )
    if (v, p) != ("none", "none")
]


@pytest.mark.parametrize("cache,vdb,pdb", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_tiered_lookup_equals_full_table_lookup(
    tmp_path: Path, request, cache: str, vdb: str, pdb: str
) -> None:
    rc = request.getfixturevalue("redis_cluster") if vdb == "redis" else None
    s, name, keys, rows, volatile, persistent = _build(tmp_path, cache, vdb, pdb, rc)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(4):  # later rounds hit the warmed cache
            q = torch.randint(-20, 2 * N + 20, (64, 3), generator=g)
            q[0, :] = q[1, 0]  # duplicates for sure
            out = s.lookup(name, q)
            assert out.shape == (64, 3, DIM) and out.dtype == torch.float32
            torch.testing.assert_close(
                out, reference_lookup(keys, rows, q, DEFAULT), rtol=0, atol=0
            )
            qu = torch.randperm(2 * N + 40, generator=g)[:100] - 20  # all unique, unsorted
            torch.testing.assert_close(
                s.lookup(name, qu), reference_lookup(keys, rows, qu, DEFAULT), rtol=0, atol=0
            )
            s.drain()  # exact mode inserts in the background; let it land before the next round
        st = s.stats(name)
        assert st["keys_all"] == 4 * (64 * 3 + 100) and st["hits_all"]["default"] > 0
        assert sum(st["hits_all"].values()) == st["keys_all"]
        assert sum(st["hits_unique"].values()) == st["keys_unique"]
        if cache != "none":
            assert st["hits_unique"]["cache"] > 0
        if vdb != "none" and pdb != "none":
            assert st["hits_unique"]["volatile"] > 0 and st["hits_unique"]["persistent"] > 0
        assert st["latency_p99_ms"] >= st["latency_p50_ms"] > 0
    finally:
        s.close()
        if vdb == "redis":
            volatile.clear(name)
        for db in (volatile, persistent):
            if db is not None:
                db.close()


def test_async_mode_returns_defaults_then_fills(tmp_path: Path) -> None:
    """HugeCTR semantics above the threshold: misses get the default now, the right row later."""
    s, name, keys, rows, *_ = _build(tmp_path, "sync", "hash_map", "none")
    s.hit_rate_threshold, s.exact = 0.0, False  # always "above" the threshold
    q = torch.from_numpy(keys[:20].copy())
    first = s.lookup(name, q)
    assert torch.equal(first, torch.full((20, DIM), DEFAULT))
    s.drain()
    second = s.lookup(name, q)
    hit = s.tables[name].cache.contains(q)
    assert hit.sum() > 10
    assert torch.equal(second[hit], torch.from_numpy(rows[:20])[hit])
    assert s.stats(name)["async_batches"] == 2
    s.close()


def test_exact_mode_above_threshold_never_returns_default_for_existing_keys(tmp_path: Path) -> None:
    s, name, keys, rows, *_ = _build(tmp_path, "exact", "hash_map", "none")
    q = torch.from_numpy(keys[:50].copy())
    for _ in range(3):
        assert torch.equal(s.lookup(name, q), torch.from_numpy(rows[:50]))
    s.drain()
    assert s.tables[name].cache.contains(q).sum() > 0
    s.close()


def test_bad_lookups_raise_clear_errors(tmp_path: Path) -> None:
    s, name, *_ = _build(tmp_path, "exact", "hash_map", "none")
    with pytest.raises(ValueError, match="keys must be int64, got torch.int32"):
        s.lookup(name, torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="keys must be int64, got numpy float64"):
        s.lookup(name, np.zeros(3))
    with pytest.raises(ValueError, match="keys must be a torch.Tensor or numpy array, got list"):
        s.lookup(name, [1, 2])
    with pytest.raises(ValueError, match="10001 keys in one lookup, at most 10000"):
        s.lookup(name, torch.zeros(10_001, dtype=torch.int64))
    with pytest.raises(ValueError, match="reserved"):
        s.lookup(name, torch.tensor([-(2**63)]))
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        s.lookup("nope", torch.zeros(1, dtype=torch.int64))
    assert s.lookup(name, torch.zeros((0, 3), dtype=torch.int64)).shape == (0, 3, DIM)
    s.close()


def test_concurrent_callers_with_back_pressure(tmp_path: Path) -> None:
    s, name, keys, rows, *_ = _build(tmp_path, "exact", "hash_map", "rocks_db")
    s._slots = threading.BoundedSemaphore(2)  # 8 callers, 2 workers
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(15):
                q = torch.randint(0, 2 * N, (128,), generator=g)
                if not torch.equal(s.lookup(name, q), reference_lookup(keys, rows, q, DEFAULT)):
                    errors.append(AssertionError("wrong rows"))
        except BaseException as e:  # noqa: BLE001 - collected and re-raised by the test
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert s.stats(name)["lookups"] == 8 * 15
    s.close()


def test_warm_up_uses_hottest_keys_and_refresh(tmp_path: Path) -> None:
    s, name, keys, rows, volatile, _ = _build(tmp_path, "exact", "hash_map", "none")
    hot = keys[::-1][:30].copy()  # not file order
    placed = s.warm_up(name, hot)
    cache = s.tables[name].cache
    assert placed == int(cache.contains(torch.from_numpy(hot)).sum()) >= 25
    # stats-driven warm-up: the keys looked up most often come first
    s.tables[name].cache = EmbeddingCache(N // 8, DIM, ways=8)
    for _ in range(3):
        s.lookup(name, torch.from_numpy(keys[:5].copy()))
    s.drain()  # background inserts of those lookups land before the cache is swapped
    s.tables[name].cache = fresh = EmbeddingCache(N // 8, DIM, ways=8)
    s.warm_up(name)
    assert fresh.contains(torch.from_numpy(keys[:5].copy())).all()
    # refresh re-reads cached rows from the databases
    volatile.insert(name, keys[:5], rows[:5] + 100)
    assert s.refresh(name, 1.0) >= 5
    assert torch.equal(
        fresh.query(torch.from_numpy(keys[:5].copy()))[0], torch.from_numpy(rows[:5] + 100)
    )
    s.close()


def test_parameter_server_from_config(tmp_path: Path) -> None:
    keys, rows = make_table(N, DIM, seed=5)
    write_table(tmp_path / "sparse/t0", keys, rows)
    doc = {
        "volatile_db": {
            "type": "parallel_hash_map",
            "initial_cache_rate": 0.3,
            "num_partitions": 2,
        },
        "persistent_db": {"type": "rocks_db", "path": "pdb"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 32,
                "sparse_files": ["sparse/t0"],
                "embedding_table_names": ["t0"],
                "embedding_vecsize_per_table": [DIM],
                "maxnum_catfeature_query_per_table_per_sample": [2],
                "default_value_for_each_table": [DEFAULT],
                "gpucacheper": 0.1,
                "cache_exact": True,
            }
        ],
    }
    ps = HierarchicalParameterServer(parse_config(doc, tmp_path))
    assert ps.volatile.size("t0") == int(0.3 * N) and ps.num_rows["t0"] == N
    s = ps.session("m")
    assert s.tables["t0"].cache.capacity >= 40
    q = torch.randint(-5, 2 * N, (32, 2))
    assert torch.equal(s.lookup("t0", q), reference_lookup(keys, rows, q, DEFAULT))
    with pytest.raises(ValueError, match="at most 64"):
        s.lookup("t0", torch.zeros(65, dtype=torch.int64))
    ps.close()
    # a restart does not reload the persistent db and still serves every row
    ps2 = HierarchicalParameterServer(parse_config(doc, tmp_path))
    assert torch.equal(ps2.session("m").lookup("t0", q), reference_lookup(keys, rows, q, DEFAULT))
    ps2.close()


def test_background_refresh_and_update_polling(tmp_path: Path) -> None:
    import time

    from hps.updates import FileLogPublisher

    keys, rows = make_table(N, DIM, seed=6)
    write_table(tmp_path / "sparse/t0", keys, rows)
    doc = {
        "volatile_db": {"type": "hash_map"},
        "update_source": {"type": "file_log", "path": "u.log", "poll_interval_s": 0.05},
        "models": [
            {
                "model": "m",
                "max_batch_size": 64,
                "sparse_files": ["sparse/t0"],
                "embedding_table_names": ["t0"],
                "embedding_vecsize_per_table": [DIM],
                "maxnum_catfeature_query_per_table_per_sample": [1],
                "gpucacheper": 0.5,
                "cache_exact": True,
                "hit_rate_threshold": 1.0,
                "cache_refresh_percentage_per_iteration": 0.5,
            }
        ],
    }
    ps = HierarchicalParameterServer(parse_config(doc, tmp_path))
    s = ps.session("m")
    q = torch.from_numpy(keys[:16].copy())
    s.lookup("t0", q)
    assert len(ps.start_background(refresh_interval_s=0.05)) == 2
    FileLogPublisher(tmp_path / "u.log").publish({"t0": (keys[:16].copy(), rows[:16] * 2)})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not torch.equal(
        s.lookup("t0", q), torch.from_numpy(rows[:16] * 2)
    ):
        time.sleep(0.05)
    assert torch.equal(s.lookup("t0", q), torch.from_numpy(rows[:16] * 2))
    assert (tmp_path / "u.log.offset").exists()
    ps.close()
