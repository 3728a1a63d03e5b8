"""The static cache (one fixed slot per key of its table): no key of the table misses once its
row is in, where a set-associative cache of the same size keeps missing; lookups (per table,
fused rows, fused bags, compiled or not) equal a plain full-table lookup; the parameter server
builds one (full, exclusive with the hash map) when the cache covers the table, and online
updates, invalidation and bytes behave as for any cache."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.kernels import load_extension
from hps.parameter_server import HierarchicalParameterServer
from hps.session import LookupSession, SessionTable
from hps.session_stats import TierBytes
from hps.storage.cache import EmbeddingCache, StaticEmbeddingCache, StaticLayout
from hps.storage.sparse_files import write_table
from hps.storage.volatile import HashMapBackend
from hps.types import Pooling, Tier
from hps.updates import FileLogPublisher
from tests.hps.hps_helpers import make_table, reference_lookup


def _session(
    caches: dict[str, EmbeddingCache], tables: dict[str, tuple[np.ndarray, np.ndarray]]
) -> LookupSession:
    v = HashMapBackend(num_partitions=2)
    for name, (keys, rows) in tables.items():
        v.create_table(name, rows.shape[1])
        v.insert(name, keys, rows)
        v.attach_cache(name, caches[name])
    return LookupSession(
        [SessionTable(n, tables[n][1].shape[1], -7.0, 1 << 20, c) for n, c in caches.items()],
        v,
        None,
        hit_rate_threshold=1.0,
        exact=True,
    )


def test_a_full_size_static_cache_never_misses_where_64_way_sets_do() -> None:
    n, dim = 2000, 4
    keys = np.random.default_rng(0).permutation(n).astype(np.int64)
    rows = np.arange(n * dim, dtype=np.float32).reshape(n, dim)[np.argsort(np.argsort(keys))]
    rows = rows[np.argsort(keys)][keys]  # row of key k: k * dim .. k * dim + dim - 1
    static = StaticEmbeddingCache(keys, dim)
    assert static.layout is StaticLayout.IDENTITY and static.table_keys is None
    sets = EmbeddingCache(n, dim, ways=64)
    for name, c in (("static", static), ("sets", sets)):
        s = _session({"t": c}, {"t": (keys, rows)})
        s.warm_up("t", keys)
        s.lookup("t", torch.from_numpy(keys))  # every key once more: misses fill where they fit
        got = s.lookup("t", torch.from_numpy(keys))
        assert torch.equal(got, reference_lookup(keys, rows, torch.from_numpy(keys), -7.0))
        hits = s.statistics.to_dict("t")["hits_all"]
        assert isinstance(hits, dict)
        if name == "static":
            assert len(c) == n and static.full and c.stats.evicted == 0
            assert hits["cache"] == 2 * n  # both lookups: every key a hit
        else:  # sets receiving more than 64 keys keep evicting
            assert len(c) < n and hits["volatile"] > 0


@pytest.mark.parametrize("compiled", [True, False])
def test_fused_rows_and_bags_equal_a_full_table_lookup(compiled: bool) -> None:
    """A SORTED static table, an IDENTITY one not yet full and a set-associative one in one
    fused call: keys absent from every tier, padding, SUM and MEAN bags."""
    if compiled and load_extension() is None:
        pytest.skip("compiled kernel not built")
    dim = 3
    t_sorted = make_table(300, dim, seed=1, key_space=5000)  # SORTED
    k_id = np.arange(200, dtype=np.int64)
    t_id = (k_id, np.random.default_rng(2).integers(-9, 9, (200, dim)).astype(np.float32))
    t_sets = make_table(100, dim, seed=3)
    tables = {"a": t_sorted, "b": t_id, "c": t_sets}
    caches: dict[str, EmbeddingCache] = {
        "a": StaticEmbeddingCache(t_sorted[0], dim),
        "b": StaticEmbeddingCache(k_id, dim),
        "c": EmbeddingCache(64, dim, ways=8),
    }
    assert caches["a"].layout is StaticLayout.SORTED  # type: ignore[attr-defined]
    s = _session(caches, tables)
    s.compiled = compiled
    s.warm_up("a", t_sorted[0])
    s.warm_up("b", k_id[:120])  # not full: keys 120..199 miss first
    g = np.random.default_rng(4)
    q = {
        "a": np.concatenate([t_sorted[0], [4999, 77777]])[g.integers(0, 302, (16, 3))],
        "b": g.integers(-1, 260, (16, 3)),  # -1 pads; 200..259 exist nowhere
        "c": np.concatenate([t_sets[0], [10**6]])[g.integers(0, 101, (16, 3))],
    }
    for _ in range(2):  # cold, then with the misses filled
        rows = s.lookup_many(["a", "c"], [torch.from_numpy(q["a"]), torch.from_numpy(q["c"])])
        for name, got in zip(["a", "c"], rows, strict=True):
            want = reference_lookup(*tables[name], torch.from_numpy(q[name]), -7.0)
            assert torch.equal(got, want)
        for mode in (Pooling.SUM, Pooling.MEAN):
            bags = s.lookup_pooled(list(q), [torch.from_numpy(q[n]) for n in q], mode)
            for j, name in enumerate(q):
                ids = torch.from_numpy(q[name])
                r = reference_lookup(*tables[name], ids.clamp(min=0), -7.0)
                valid = ids >= 0
                acc = torch.zeros(16, dim)
                for w in range(3):  # in request order, padding skipped
                    acc = torch.where(valid[:, w, None], acc + r[:, w], acc)
                if mode is Pooling.MEAN:
                    acc = acc / valid.sum(1).clamp(min=1)[:, None].to(torch.float32)
                assert torch.equal(bags[:, j * dim : (j + 1) * dim], acc)
    b = caches["b"]
    assert b.insert(torch.tensor([500]), torch.zeros(1, dim)) == 0  # not the table's key
    assert b.stats.overflowed == 1 and b.stats.evicted == 0


def test_parameter_server_builds_full_static_caches_that_updates_reach(tmp_path: Path) -> None:
    n, dim = 100, 4
    keys, rows = make_table(n, dim, seed=5)
    write_table(tmp_path / "sparse" / "t", keys, rows)
    model = {
        "max_batch_size": 128,
        "sparse_files": ["sparse/t"],
        "embedding_table_names": ["t"],
        "embedding_vecsize_per_table": [dim],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        "hit_rate_threshold": 1.0,
        "cache_exact": True,
    }
    doc = {
        "volatile_db": {"type": "parallel_hash_map", "num_partitions": 2},
        "persistent_db": {"type": "none"},
        "update_source": {"type": "file_log", "path": "u.log"},
        "models": [
            {**model, "model": "full", "gpucacheper": 1.0},
            {**model, "model": "half", "gpucacheper": 0.5},
        ],
    }
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    ps = HierarchicalParameterServer.from_config(tmp_path / "ps.json")
    try:
        s, half = ps.session("full"), ps.session("half")
        c = s.tables["t"].cache
        assert isinstance(c, StaticEmbeddingCache) and c.full
        assert type(half.tables["t"].cache) is EmbeddingCache
        v = ps.volatile
        assert isinstance(v, HashMapBackend) and v.front("t") is c
        assert v.stored_rows("t") == 0 and c.homed_rows() == n  # each row held once
        tiers = s.held_bytes("t").tiers
        assert tiers[Tier.CACHE] == TierBytes(n, n * 4 * dim, c.nbytes(), n)
        # rows, int32 keys, tags, counters, homed bits, the SORTED index (8 B per row) and the
        # one high 32-bit word every key shares (8 B for the whole cache)
        assert c.nbytes() == n * (4 * dim + 4 + 1 + 1) + -(-n // 8) + 8 * n + 8
        q = torch.from_numpy(keys)
        assert torch.equal(s.lookup("t", q), torch.from_numpy(rows))
        upd = np.full((n, dim), 5.0, np.float32)
        FileLogPublisher(tmp_path / "u.log").publish({"t": (keys[:10], upd[:10])})
        applier = ps.update_applier()
        assert applier is not None and applier.poll() == 1
        want = torch.from_numpy(np.concatenate([upd[:10], rows[10:]]))
        assert torch.equal(s.lookup("t", q), want)  # the next lookup sees the update
        assert torch.equal(s.lookup_many(["t"], [q])[0], want)
        assert c.invalidate(q[:5]) == 5 and not c.full and v.stored_rows("t") == 5
        assert torch.equal(s.lookup("t", q), want)  # refilled from the hash map
        hits = s.statistics.to_dict("t")["hits_all"]
        assert c.full and isinstance(hits, dict) and hits["volatile"] == 5
    finally:
        ps.close()


def test_keys_past_int32_and_negative_keys_are_held_as_low_words() -> None:
    """Keys >= 2**31 and negative keys share three high 32-bit words: the static cache holds
    int32 low words and a nibble per slot naming the high word (no int64 keys), and inserts,
    queries and invalidations behave as for small keys."""
    dim = 2
    keys = np.array([2**31, 2**31 + 7, 2**40 + 3, -5, -(2**33), 11, 0], dtype=np.int64)
    n = keys.size  # high words: 0 (2**31.., 11, 0), 256 (2**40 + 3), -1 (-5), -2 (-(2**33))
    rows = np.arange(n * dim, dtype=np.float32).reshape(n, dim)
    c = StaticEmbeddingCache(keys, dim)
    assert c.layout is StaticLayout.SORTED and c.slot_keys.keys.dtype == torch.int32
    q = torch.from_numpy(keys)
    assert c.insert(q, torch.from_numpy(rows)) == n and c.full
    assert (
        c.slot_keys.keys.dtype == torch.int32
        and c.slot_keys.high_words.numel() == 4
        and c.slot_keys.high_of is not None
    )
    got, hit = c.query(q)
    assert bool(hit.all()) and torch.equal(got, torch.from_numpy(rows))
    assert sorted(c.cached_keys().tolist()) == sorted(keys.tolist())
    # rows, int32 keys, tags, counters, homed bits, a nibble per slot, 4 high words and the
    # SORTED index (8 B per row)
    want = n * (4 * dim + 4 + 1 + 1) + -(-n // 8) + -(-n // 2) + 4 * 8 + 8 * n
    assert c.nbytes() == want
    assert c.invalidate(torch.tensor([2**40 + 3, -5, 12345])) == 2 and not c.full
    got, hit = c.query(q)
    assert hit.tolist() == [k not in (2**40 + 3, -5) for k in keys.tolist()]
    assert torch.equal(got[hit], torch.from_numpy(rows)[hit])
    assert c.insert(torch.tensor([-5]), torch.full((1, dim), 9.0)) == 1
    assert torch.equal(
        c.query(torch.tensor([-5, 2**31]))[0], torch.tensor([[9.0, 9.0], rows[0].tolist()])
    )


class _HandOffLock:
    """A lock that, once armed, runs ``hand_off`` right after its next release (so a thread
    waiting for it gets it before the releasing thread can take it again)."""

    def __init__(self) -> None:
        self._inner = threading.Lock()
        self.hand_off: Callable[[], object] | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._inner.acquire(blocking, timeout)

    def release(self) -> None:
        self._inner.release()
        hand_off, self.hand_off = self.hand_off, None
        if hand_off is not None:
            hand_off()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def test_full_is_never_seen_while_an_invalidation_has_cleared_tags() -> None:
    """A reader that holds the cache's lock (as the fused session does around its all-hit
    pass, which trusts ``full``) and takes it as soon as an invalidation that cleared a tag
    first lets go, sees ``full`` False: tags and the held count change in one critical
    section, with no window where the row's tag is gone and the cache still claims it all."""
    cache = StaticEmbeddingCache(np.arange(8), 4)
    cache.insert(torch.arange(8), torch.ones(8, 4))
    assert cache.full
    lock = _HandOffLock()
    cache._lock = lock  # type: ignore[assignment]
    seen: list[tuple[bool, int]] = []
    read = threading.Event()
    clear_homed = cache._set_homed

    def reader() -> None:
        with cache._lock:
            seen.append((cache.full, int(cache.tags.view(-1)[3])))
        read.set()

    def tags_cleared(slots: torch.Tensor, homed: bool) -> None:
        clear_homed(slots, homed)
        threads.append(threading.Thread(target=reader))
        threads[-1].start()  # waits for the lock the invalidation holds
        lock.hand_off = lambda: read.wait(5.0)

    threads: list[threading.Thread] = []
    cache._set_homed = tags_cleared  # type: ignore[method-assign]
    assert cache.invalidate(torch.tensor([3])) == 1
    for t in threads:
        t.join()
    assert seen == [(False, 0)] and not cache.full


def test_a_key_invalidated_twice_in_one_call_is_dropped_once() -> None:
    """``invalidate`` with a key given twice drops and counts it once, so the cache is full
    again once that row is inserted again (the all-hit pass needs ``full``)."""
    c = StaticEmbeddingCache(np.arange(10), 2)
    rows = torch.arange(20, dtype=torch.float32).view(10, 2)
    c.insert(torch.arange(10), rows)
    assert c.full
    assert c.invalidate(torch.tensor([3, 3, 4])) == 2 and not c.full
    c.insert(torch.tensor([3, 4]), rows[3:5])
    assert c.full
    got, hit = c.query(torch.arange(10))
    assert bool(hit.all()) and torch.equal(got, rows)
