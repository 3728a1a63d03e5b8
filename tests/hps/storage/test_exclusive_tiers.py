"""A CPU cache exclusive with the in-process hash map below it: every row held once in host
memory (bytes counted exactly), and the tiers' semantics kept (lookups exact while rows move
both ways, statistics, online updates through the parameter server, deletes, rows the hash
map never held)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.parameter_server import HierarchicalParameterServer
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.sparse_files import write_table
from hps.storage.volatile import HashMapBackend, KeyLayout
from hps.updates import FileLogPublisher
from tests.hps.hps_helpers import make_table, reference_lookup


def _pair(
    n: int, dim: int, capacity: int, ways: int = 8, parts: int = 2
) -> tuple[HashMapBackend, EmbeddingCache, np.ndarray, np.ndarray]:
    keys, rows = make_table(n, dim, seed=1)
    v = HashMapBackend(num_partitions=parts)
    v.create_table("t", dim)
    v.insert("t", keys, rows)
    c = EmbeddingCache(capacity, dim, ways=ways)
    v.attach_cache("t", c)
    return v, c, keys, rows


def _stored_keys(v: HashMapBackend) -> np.ndarray:
    return np.concatenate([p.live()[0] for p in v._table("t").parts])


def _check_held_once(v: HashMapBackend, c: EmbeddingCache, keys: np.ndarray) -> None:
    """Every key is in exactly one of the two, or cached unhomed (a copy of a row the hash
    map never held); the hash map answers for all."""
    stored = _stored_keys(v)
    homed = c.slot_keys.keys.view(-1)[c.homed].numpy()
    assert np.intersect1d(stored, c.cached_keys().numpy()).size == 0  # never both
    assert np.array_equal(np.sort(np.concatenate([stored, homed])), np.sort(keys))
    assert v.size("t") == keys.size == v.stored_rows("t") + c.homed_rows()


def test_every_row_resident_holds_each_row_once_in_at_most_589_bytes() -> None:
    """200 k rows would be the benchmark's shape; 20 k rows of 128 FP32 (512 B) with a cache of
    as many slots keep the test fast. The bytes are the arrays' nbytes, counted exactly."""
    n, dim = 20_000, 128
    v, c, keys, rows = _pair(n, dim, capacity=n, ways=64)
    s = LookupSession([SessionTable("t", dim, 0.0, n, c)], v, None, hit_rate_threshold=1.0)
    s.warm_up("t", keys)
    _check_held_once(v, c, keys)
    assert len(c) > 0.9 * n and v.stored_rows("t") == n - len(c)
    row = 4 * dim
    # per slot: the row, its int32 low word, counter and tag (one byte each), homed bit (1/8
    # byte); the keys' one high word: 8 B
    assert c.slot_keys.keys.dtype == torch.int32 and c.slot_keys.high_words.tolist() == [0]
    assert c.nbytes() == c.capacity * (row + 4 + 1 + 1) + c.capacity // 8 + 8
    assert v.key_layout("t") is KeyLayout.SORTED_U32
    for p in v._table("t").parts:  # the slack a compaction leaves: under half the live rows
        assert p.rows.shape[0] - p.size <= max(64, p.size // 2)
    per_row = (c.nbytes() + v.nbytes("t")) / n
    assert per_row <= 1.15 * row, per_row
    # trimmed, the hash map holds exactly the rows the cache did not take, each with its
    # uint32 key (the slot of its rank: no slot array), counted from the cache's size alone
    v.mark_loaded("t")
    assert v.nbytes("t") == (n - len(c)) * (row + 4)
    got = s.lookup("t", torch.from_numpy(keys))
    assert torch.equal(got, torch.from_numpy(rows))


def test_lookups_stay_exact_while_rows_move_up_and_back() -> None:
    """A cache of a quarter of the table: misses move rows up, evictions move them back down;
    every lookup returns the table's rows (no default for a key that exists: there is no
    persistent DB), hit statistics count cache hits, and each row stays held once."""
    n, dim = 400, 4
    v, c, keys, rows = _pair(n, dim, capacity=100)
    s = LookupSession(
        [SessionTable("t", dim, -1.0, 4096, c)], v, None, hit_rate_threshold=1.0, exact=True
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        q = torch.from_numpy(keys)[torch.randint(0, n, (64,), generator=g)]
        assert torch.equal(s.lookup("t", q), reference_lookup(keys, rows, q, -1.0))
        _check_held_once(v, c, keys)
    st = s.stats("t")
    assert c.stats.evicted > 0 and c.stats.hits > 0
    hits = st["hits_unique"]
    assert isinstance(hits, dict) and hits["cache"] > 0 and hits["default"] == 0


def test_concurrent_lookups_never_see_a_row_in_neither_tier() -> None:
    """Four threads look up while their misses move rows up and evict others down: a reader
    between the cache probe and the hash map read must still find every row."""
    n, dim = 2_000, 2
    v, c, keys, rows = _pair(n, dim, capacity=64, ways=4)
    s = LookupSession(
        [SessionTable("t", dim, -1.0, 4096, c)], v, None, hit_rate_threshold=0.0, exact=True
    )
    errors: list[str] = []

    def run(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(40):
            q = torch.randint(0, 2 * n, (128,), generator=g)  # half the key space is absent
            if not torch.equal(s.lookup("t", q), reference_lookup(keys, rows, q, -1.0)):
                errors.append(f"thread {seed}: a lookup returned a wrong row")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    s.drain()  # the background insertions (moves) have run
    _check_held_once(v, c, keys)


def test_writes_and_deletes_go_where_the_row_lives() -> None:
    n, dim = 64, 2
    v, c, keys, rows = _pair(n, dim, capacity=16)
    c.insert(torch.from_numpy(keys[:8]), torch.from_numpy(rows[:8]))
    assert c.homed_rows() == 8 and v.stored_rows("t") == n - 8
    new = np.full((4, dim), 7.0, np.float32)
    v.insert("t", keys[6:10], new)  # two cached, two stored
    assert c.homed_rows() == 8 and v.stored_rows("t") == n - 8  # nothing stored twice
    got, found = v.lookup("t", keys[6:10])
    assert found.all() and np.array_equal(got, new)
    cached, hit = c.query(torch.from_numpy(keys[6:8]))
    assert hit.all() and torch.equal(cached, torch.from_numpy(new[:2]))
    v.delete("t", keys[:2])  # cached: the map drops its claim, the cache keeps its copy
    assert v.size("t") == n - 2 and c.homed_rows() == 6 and not v.lookup("t", keys[:2])[1].any()
    assert c.contains(torch.from_numpy(keys[:2])).all()
    c.invalidate(torch.from_numpy(keys[2:4]))  # homed rows go back down, unchanged
    assert v.stored_rows("t") == n - 6 and v.size("t") == n - 2
    got, found = v.lookup("t", keys[2:4])
    assert found.all() and np.array_equal(got, rows[2:4])


def test_a_row_the_hash_map_never_held_is_dropped_on_eviction() -> None:
    """A row read from below (the persistent DB) is cached unhomed: evicting it does not store
    it in the hash map, which holds what it would hold without the cache."""
    dim = 2
    v = HashMapBackend(num_partitions=1)
    v.create_table("t", dim)
    c = EmbeddingCache(4, dim, ways=4)
    v.attach_cache("t", c)
    c.insert(torch.arange(4), torch.ones(4, dim))  # not in the map: unhomed
    assert c.homed_rows() == 0
    c._clock += 1  # a later query: the four are colder than new keys
    c.insert(torch.arange(10, 14), torch.zeros(4, dim))
    assert v.size("t") == 0 and v.stored_rows("t") == 0 and c.stats.evicted == 4


def test_attaching_refuses_a_cache_that_could_hold_copies() -> None:
    v = HashMapBackend()
    v.create_table("t", 2)
    full = EmbeddingCache(8, 2)
    full.insert(torch.tensor([1]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="must be empty"):
        v.attach_cache("t", full)
    with pytest.raises(ValueError, match=r"has dim 2 \(fp32 rows\), the cache 3 \(fp32 rows\)"):
        v.attach_cache("t", EmbeddingCache(8, 3))
    v.attach_cache("t", EmbeddingCache(8, 2))
    with pytest.raises(ValueError, match="already has a cache attached"):
        v.attach_cache("t", EmbeddingCache(8, 2))


def test_the_parameter_server_serves_online_updates_from_exclusive_tiers(tmp_path: Path) -> None:
    """Through ps.json: hash map + CPU cache of every row, no persistent DB. Rows updated while
    cached and while stored are served updated; each row is still held once."""
    n, dim = 100, 4
    keys, rows = make_table(n, dim, seed=3)
    write_table(tmp_path / "sparse" / "t", keys, rows)
    doc = {
        "volatile_db": {"type": "parallel_hash_map", "num_partitions": 2},
        "persistent_db": {"type": "none"},
        "update_source": {"type": "file_log", "path": "u.log"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 128,
                "sparse_files": ["sparse/t"],
                "embedding_table_names": ["t"],
                "embedding_vecsize_per_table": [dim],
                "maxnum_catfeature_query_per_table_per_sample": [1],
                "gpucacheper": 0.5,
                "hit_rate_threshold": 1.0,
                "cache_exact": True,
            }
        ],
    }
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    ps = HierarchicalParameterServer.from_config(tmp_path / "ps.json")
    try:
        s = ps.session("m")
        c = s.tables["t"].cache
        assert c is not None and isinstance(ps.volatile, HashMapBackend)
        assert ps.volatile.front("t") is c
        q = torch.from_numpy(keys[:40])
        assert torch.equal(s.lookup("t", q), torch.from_numpy(rows[:40]))  # moved up
        assert c.homed_rows() > 0
        upd = np.full((n, dim), 5.0, np.float32)
        FileLogPublisher(tmp_path / "u.log").publish({"t": (keys, upd)})
        assert ps.update_applier().poll() == 1
        assert torch.equal(s.lookup("t", torch.from_numpy(keys)), torch.from_numpy(upd))
        _check_held_once(ps.volatile, c, keys)
    finally:
        ps.close()
