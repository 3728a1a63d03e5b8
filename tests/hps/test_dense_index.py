"""The dense key index of a set-associative cache (hps.storage.cache.dense_index): exact after
every kind of change to the cache's slots, and the compiled pass that reads it equal to the
torch reference (which never reads it) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hps.config import parse_config
from hps.fused import GatherArgs, gather
from hps.kernels import load_extension
from hps.parameter_server import HierarchicalParameterServer
from hps.session import LookupSession, SessionTable
from hps.storage.cache import MAX_HIGH_WORDS, EmbeddingCache, dense_key_bound
from hps.storage.cache.dense_index import MAX_INDEX_SHARE, MAX_INDEXED_SLOTS
from hps.storage.sparse_files import write_table
from hps.storage.volatile import HashMapBackend
from hps.types import CachePolicy, Pooling
from tests.hps.hps_helpers import make_table, needs_ext, reference_lookup

SPECS = [(300, 4), (50, 8), (1000, 16)]  # (rows, dim) per table
NAMES = ["t0", "t1", "t2"]


def _rows(n: int, d: int) -> np.ndarray:
    return (np.arange(n * d, dtype=np.float32).reshape(n, d) % 97) - 40.0  # integer-valued


def _held_pairs(c: EmbeddingCache) -> dict[int, int]:
    """Key → slot of every held key, from the slots' own keys (the truth)."""
    slots = torch.nonzero(c.tags.view(-1) != 0).squeeze(1)
    return dict(zip(c.slot_keys.keys_of(slots).tolist(), slots.tolist(), strict=True))


def _assert_index_exact(c: EmbeddingCache, bound: int) -> None:
    """The index names exactly the held keys' slots, and the cache's torch lookups through it
    (:meth:`EmbeddingCache._slots`) find what the set probe finds, for keys inside the bound,
    negative and past it (a miss's slot a slot of the cache)."""
    dense = c.slot_keys.dense
    assert dense is not None and dense.bound == bound
    want = {k: s for k, s in _held_pairs(c).items() if 0 <= k < bound}
    keys, slots = dense.held()
    assert dict(zip(keys.tolist(), slots.tolist(), strict=True)) == want
    held = torch.tensor(sorted(_held_pairs(c)), dtype=torch.int64)
    q = torch.cat([torch.arange(-5, bound + 50), held])
    hit, slot = c._slots(q)
    hit_h, slot_h = c._hashed_slots(q)
    assert torch.equal(hit, hit_h) and torch.equal(slot[hit], slot_h[hit])
    assert int(slot.min()) >= 0 and int(slot.max()) < c.capacity
    assert torch.equal(c.contains(held), torch.ones(held.numel(), dtype=torch.bool))
    inside = torch.arange(bound)  # every key indexed: the gather alone, no key hashed
    hit, slot = c._slots(inside)
    hit_h, slot_h = c._hashed_slots(inside)
    assert torch.equal(hit, hit_h) and torch.equal(slot[hit], slot_h[hit])


@pytest.mark.parametrize(
    ("policy", "compact"),
    [(CachePolicy.LRU, True), (CachePolicy.LFU, True), (CachePolicy.LFU, False)],
)
def test_the_index_follows_inserts_evictions_and_invalidations(
    policy: CachePolicy, compact: bool
) -> None:
    """Inserts into a full cache (evictions), invalidations and keys outside the bound
    (negative, past it): after each, the index names exactly the held keys' slots."""
    bound = 500
    c = EmbeddingCache(64, 2, policy=policy, ways=8, compact_keys=compact, key_bound=bound)
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        keys = torch.unique(torch.randint(-50, bound + 200, (40,), generator=g))
        if step % 3 == 2:
            c.invalidate(keys)
        else:
            c.query(keys)  # ticks the LRU clock: older entries become victims
            prio = torch.randint(1, 50, (keys.numel(),), generator=g)
            c.insert(keys, torch.randn(keys.numel(), 2, generator=g), priority=prio)
        _assert_index_exact(c, bound)
    assert c.stats.evicted > 0 and len(c) > 0
    held = _held_pairs(c)
    assert any(k >= bound or k < 0 for k in held)  # held, hashed, not indexed


def test_the_index_survives_widening_to_int64_keys() -> None:
    """Keys of more than MAX_HIGH_WORDS high words widen the keys to int64; the index keeps
    the slots of the keys in range (their slots do not move)."""
    bound = 100
    c = EmbeddingCache(256, 2, ways=8, key_bound=bound)
    c.insert(torch.arange(60), torch.zeros(60, 2))
    wide = torch.tensor([(w + 1) << 32 for w in range(MAX_HIGH_WORDS + 1)])
    c.insert(wide, torch.zeros(wide.numel(), 2))
    assert c.slot_keys.wide
    _assert_index_exact(c, bound)
    c.invalidate(torch.arange(0, 60, 2))
    _assert_index_exact(c, bound)


def test_an_evicted_key_leaves_the_index_before_its_high_word_is_reused() -> None:
    """One set of 16 ways holding keys of 16 high words, the only key of high word 0 (3, in
    the index's range) the coldest: a key of a 17th high word evicts it and reuses word 0.
    The evicted key is read (and forgotten) before the word is reused, so the index drops 3
    and does not keep a stale entry for it."""
    c = EmbeddingCache(16, 1, policy="lfu", ways=16, key_bound=10)
    far = torch.tensor([(w << 32) | 5 for w in range(1, 16)])
    c.insert(far, torch.zeros(15, 1), priority=torch.full((15,), 100))
    c.insert(torch.tensor([3]), torch.ones(1, 1), priority=torch.tensor([1]))
    assert len(c) == 16 and c.slot_keys.dense is not None and c.slot_keys.dense.slots[3] >= 0
    new = torch.tensor([(16 << 32) | 7])
    assert c.insert(new, torch.full((1, 1), 2.0), priority=torch.tensor([50])) == 1
    assert not c.slot_keys.wide and 16 in c.slot_keys.high_words.tolist()  # word 0 reused
    assert int(c.slot_keys.dense.slots[3]) == -1
    _assert_index_exact(c, 10)


def test_a_cache_too_large_for_int32_slots_takes_no_index() -> None:
    assert dense_key_bound(100, MAX_INDEXED_SLOTS + 1, 512) is None
    assert dense_key_bound(100, MAX_INDEXED_SLOTS, 512) == 100
    with pytest.raises(ValueError, match="names slots as int32.*2147483712 slots"):
        EmbeddingCache(
            MAX_INDEXED_SLOTS + 65, 1, ways=64, key_bound=10
        )  # refused before allocating


def test_nbytes_counts_the_index_and_bad_bounds_are_named() -> None:
    plain = EmbeddingCache(64, 4, ways=8)
    indexed = EmbeddingCache(64, 4, ways=8, key_bound=1000)
    assert indexed.nbytes() - plain.nbytes() == 4 * 1000
    for bad in (0, -3, 2**31, 1.5, True, "7"):
        with pytest.raises(ValueError, match=r"key_bound must be an int in \[1, 2\*\*31\).*"):
            EmbeddingCache(64, 4, ways=8, key_bound=bad)  # type: ignore[arg-type]


def test_dense_key_bound_takes_at_most_its_share_of_the_rows() -> None:
    # FP32 rows of dim 128 (512 B) in a cache of 1,000 slots: 64,000 B of index at most
    limit = int(MAX_INDEX_SHARE * 1000 * 512) // 4
    assert dense_key_bound(limit, 1000, 512) == limit
    assert dense_key_bound(limit + 1, 1000, 512) is None
    assert dense_key_bound(0, 1000, 512) is None
    assert dense_key_bound(2**31, 2**40, 512) is None


def _session(
    compiled: bool, bound: bool, policy: str, sampling: int = 1, compact: bool = True
) -> LookupSession:
    v = HashMapBackend(num_partitions=2)
    tables = []
    for name, (n, d) in zip(NAMES, SPECS, strict=True):
        v.create_table(name, d)
        v.insert(name, np.arange(n + 40, dtype=np.int64), _rows(n + 40, d))
        cache = EmbeddingCache(
            n // 3,
            d,
            policy=policy,
            ways=8,
            lfu_decay_keys_per_slot=0.5,
            key_bound=n if bound else None,  # keys n .. n + 39 are hashed
            compact_keys=compact,
        )
        tables.append(SessionTable(name, d, -1.0, 10**6, cache))
    return LookupSession(
        tables,
        v,
        None,
        hit_rate_threshold=1.0,
        exact=True,
        compiled=compiled,
        key_stats_sampling=sampling,
    )


def _same_state(a: LookupSession, b: LookupSession) -> None:
    for n in NAMES:
        ca, cb = a.tables[n].cache, b.tables[n].cache
        assert ca is not None and cb is not None
        assert torch.equal(ca.slot_keys.keys, cb.slot_keys.keys)
        assert torch.equal(ca.counters, cb.counters) and torch.equal(ca.tags, cb.tags)
        assert int(ca.counters.max()) < 128 and ca.stats == cb.stats
    sa, sb = a.stats(), b.stats()
    for n in NAMES:
        for k in ("lookups", "keys_all", "keys_unique", "hits_unique", "hits_all"):
            assert sa[n][k] == sb[n][k], (n, k)


@pytest.mark.parametrize(
    ("policy", "compact"),
    [(CachePolicy.LRU, True), (CachePolicy.LFU, True), (CachePolicy.LFU, False)],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("within", [False, True])
def test_the_compiled_pass_through_the_index_equals_the_reference(
    policy: CachePolicy, compact: bool, threads: int, within: bool
) -> None:
    """Bags (SUM, MEAN, padding) and rows (a -1 there is a key, hashed), keys inside and past
    the bound, hits, misses and evictions, int32 and int64 slot keys: the compiled pass reading
    the index equals the reference pass, outputs and state bit for bit, and a session without
    an index in outputs. Two threads with over 8,192 keys: the parallel gather, each table
    whole on one thread, and one table alone cut across both with its uses made separately.
    ``within``: every key inside the bound (rows: and >= 0), so each table
    counts its unique hits by key and pools its bags (copies its rows) in the index's own
    passes; rows with one -1 among them go through the probe pass instead."""
    needs_ext()
    a, b, c = (
        _session(True, True, policy, compact=compact),
        _session(False, True, policy, compact=compact),
        _session(True, False, policy, compact=compact),
    )
    g = torch.Generator().manual_seed(3)
    modes = [Pooling.SUM, Pooling.MEAN, Pooling.SUM]
    batch = 16 if threads == 1 else 4096
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(4):
            past = 0 if within else 40
            keys = [torch.randint(-1, n + past, (batch, 3), generator=g) for n, _ in SPECS]
            got = a.lookup_pooled(NAMES, keys, modes)
            assert torch.equal(got, b.lookup_pooled(NAMES, keys, modes))
            assert torch.equal(got, c.lookup_pooled(NAMES, keys, modes))
            # one table alone: with two threads and over 8,192 keys it is cut across them
            one = [keys[2]]
            alone = a.lookup_pooled(["t2"], one, [Pooling.MEAN])
            assert torch.equal(alone, b.lookup_pooled(["t2"], one, [Pooling.MEAN]))
            assert torch.equal(alone, c.lookup_pooled(["t2"], one, [Pooling.MEAN]))
            rows = [k[:8].clamp_min(0) if within else k[:8] for k in keys]
            # within the bound but for one -1 per table: a key of its own (hashed), so the
            # rows are not taken by the index's rows pass
            neg = [k[:8].clone().clamp_min(0) for k in keys]
            for k in neg:
                k[0, 0] = -1
            for r in (rows, neg):
                for x, y, z in zip(
                    a.lookup_many(NAMES, r),
                    b.lookup_many(NAMES, r),
                    c.lookup_many(NAMES, r),
                    strict=True,
                ):
                    assert torch.equal(x, y) and torch.equal(x, z)
            _same_state(a, b)
            for name, (n, _) in zip(NAMES, SPECS, strict=True):
                _assert_index_exact(a.tables[name].cache, n)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(old)
    assert a.tables["t2"].cache.stats.hits > 0  # type: ignore[union-attr]


def test_an_index_entry_outside_the_cache_reads_as_a_miss() -> None:
    """A corrupt entry (a slot past the cache, or below -1) is never followed: the compiled
    pass reads the key as a miss, served by the tier below with its own row, and the cache's
    torch lookups (the miss path's insertion among them) find the key by its set, so it is
    not placed twice, and the insertion mends the entry."""
    needs_ext()
    s = _session(True, True, "lfu")
    cache = s.tables["t2"].cache
    assert cache is not None and cache.slot_keys.dense is not None
    key = torch.tensor([[7]])
    want = torch.from_numpy(_rows(1040, 16)[7])
    assert torch.equal(s.lookup_pooled(["t2"], [key])[0], want)
    slot = int(cache.slot_keys.dense.slots[7])
    assert slot >= 0  # now cached and indexed
    held = len(cache)
    for bad in (cache.capacity + 5, -7):
        cache.slot_keys.dense.slots[7] = bad
        before = cache.stats.hits
        assert torch.equal(s.lookup_pooled(["t2"], [key])[0], want)
        assert cache.stats.hits == before  # answered by the miss path
        assert bool(cache.contains(torch.tensor([7]))[0]) and len(cache) == held
        assert int(cache.slot_keys.dense.slots[7]) == slot  # the miss path's insertion mended it


def test_an_entry_naming_another_keys_slot_is_hashed_by_the_torch_operations_and_mended() -> None:
    """An entry of a held key that names another held key's slot: the cache's torch
    operations check the slot's key, find the key by its set instead (so an insertion
    overwrites its own row, not the other key's, and places nothing twice), and the
    insertion points the entry back at the key's slot."""
    c = EmbeddingCache(64, 2, ways=8, key_bound=100)
    c.insert(torch.arange(20), torch.arange(40, dtype=torch.float32).view(20, 2))
    dense = c.slot_keys.dense
    assert dense is not None
    own, other = int(dense.slots[7]), int(dense.slots[8])
    dense.slots[7] = other
    hit, slot = c._slots(torch.tensor([7, 8]))
    assert hit.tolist() == [True, True] and slot.tolist() == [own, other]
    assert c.insert(torch.tensor([7]), torch.full((1, 2), -1.0)) == 0  # overwritten in place
    assert int(dense.slots[7]) == own and len(c) == 20
    rows, hit = c.query(torch.tensor([7, 8]))
    assert hit.all() and rows.tolist() == [[-1.0, -1.0], [16.0, 17.0]]
    _assert_index_exact(c, 100)


def test_an_entry_naming_an_empty_slot_of_an_empty_cache_is_hashed() -> None:
    """No key written yet (no high word known): an entry naming a slot is checked against the
    slot's tag before any key is read, and the key is a miss."""
    c = EmbeddingCache(64, 2, ways=8, key_bound=100)
    assert c.slot_keys.dense is not None
    c.slot_keys.dense.slots[5] = 3
    hit, _ = c._slots(torch.tensor([5, 6]))
    assert hit.tolist() == [False, False]
    assert c.insert(torch.tensor([5]), torch.ones(1, 2)) == 1
    _assert_index_exact(c, 100)


def test_the_kernel_refuses_an_index_of_the_wrong_dtype_naming_the_table() -> None:
    needs_ext()
    ext = load_extension()
    assert ext is not None
    s = _session(True, True, "lfu")
    cache = s.tables["t0"].cache
    assert cache is not None and cache.slot_keys.dense is not None
    cache.slot_keys.dense.slots = cache.slot_keys.dense.slots.to(torch.int64)
    args = GatherArgs(
        caches=[cache],
        keys=[torch.tensor([1, 2])],
        out=torch.empty(2 * 4),
        out_offsets=[0],
        out_stride=0,
        hotness=[0],
        mean=[False],
        stamps=[-1],
        streams=[0],
        looked_up=[0],
        intervals=[0],
        key_counters=None,
    )
    with pytest.raises(ValueError, match="table 0: a dense key index must be"):
        gather(args)


def test_the_parameter_server_indexes_a_cache_whose_index_pays(tmp_path) -> None:
    """Set-associative caches of the parameter server: a table of 64-wide rows gets an index
    up to its largest key (4 B per key: within an eighth of its cache's 256-byte rows), one of
    2-wide rows none (past an eighth of its 8-byte rows); both answer as the table."""
    n = 400
    doc: dict = {"volatile_db": {"type": "hash_map"}, "models": []}
    tables = {"wide": 64, "narrow": 2}
    data = {}
    for name, dim in tables.items():
        keys, rows = make_table(n, dim, seed=dim, key_space=n + 50)
        write_table(tmp_path / f"sparse/{name}", keys, rows)
        data[name] = (keys, rows)
    doc["models"].append(
        {
            "model": "m",
            "max_batch_size": 64,
            "sparse_files": [f"sparse/{t}" for t in tables],
            "embedding_table_names": list(tables),
            "embedding_vecsize_per_table": list(tables.values()),
            "maxnum_catfeature_query_per_table_per_sample": [2, 2],
            "default_value_for_each_table": [0.0, 0.0],
            "gpucacheper": 0.25,
            "cache_exact": True,
        }
    )
    ps = HierarchicalParameterServer(parse_config(doc, tmp_path))
    try:
        s = ps.session("m")
        wide, narrow = s.tables["wide"].cache, s.tables["narrow"].cache
        assert wide is not None and narrow is not None
        assert wide.slot_keys.dense is not None and narrow.slot_keys.dense is None
        assert wide.slot_keys.dense.bound == int(data["wide"][0].max()) + 1
        g = torch.Generator().manual_seed(9)
        for _ in range(6):
            q = [torch.randint(-1, n + 55, (32, 2), generator=g) for _ in tables]
            got = s.lookup_many(list(tables), [k.clamp(min=0) for k in q])
            for name, k, x in zip(tables, q, got, strict=True):
                keys, rows = data[name]
                assert torch.equal(x, reference_lookup(keys, rows, k.clamp(min=0), 0.0))
        assert wide.stats.hits > 0
        _assert_index_exact(wide, wide.slot_keys.dense.bound)
    finally:
        ps.close()


def test_a_replica_that_loads_no_keys_bounds_its_index_by_the_row_count(tmp_path) -> None:
    """Keys 0, 2, .., 198 of a 100-row table: the loading server bounds its cache's index by
    the largest key (199); a replica that loads nothing knows only the row count (100), and
    hashes the keys past it. Both serve every key as the table."""
    keys = np.arange(0, 200, 2, dtype=np.int64)
    rows = _rows(100, 64)
    write_table(tmp_path / "sparse/t", keys, rows)
    doc = {
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": "pdb"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 256,
                "sparse_files": ["sparse/t"],
                "embedding_table_names": ["t"],
                "embedding_vecsize_per_table": [64],
                "maxnum_catfeature_query_per_table_per_sample": [1],
                "default_value_for_each_table": [0.0],
                "gpucacheper": 0.5,
                "cache_exact": True,
            }
        ],
    }
    q = torch.arange(-1, 205).view(-1, 1)
    want = reference_lookup(keys, rows, q.clamp(min=0), 0.0)
    want[0] = reference_lookup(keys, rows, torch.tensor([[-1]]), 0.0)[0]
    for load, bound in ((True, 199), (False, 100)):
        ps = HierarchicalParameterServer(parse_config(doc, tmp_path), load=load)
        try:
            s = ps.session("m")
            cache = s.tables["t"].cache
            assert cache is not None and cache.slot_keys.dense is not None
            assert cache.slot_keys.dense.bound == bound
            for _ in range(2):  # misses, then hits
                got = s.lookup_many(["t"], [q])[0]
                assert torch.equal(got, want)
            assert cache.stats.hits > 0
            _assert_index_exact(cache, bound)
        finally:
            ps.close()
