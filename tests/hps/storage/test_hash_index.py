"""The hash map's key index laid out by density (``hps.storage.hash_partition``): the layout
each key set gets, the bytes per row of each layout and row format exactly, the same answers,
pools and evictions as the sorted int64 reference on random operation sequences, switches
both ways (density, keys past the bound, negative and 64-bit keys) and reads during them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hps.rowformat import RowDtype, row_bytes
from hps.session import LookupSession, SessionTable
from hps.storage import hash_partition
from hps.storage.cache import EmbeddingCache
from hps.storage.volatile import HashMapBackend, KeyLayout
from hps.types import OverflowPolicy

DIM = 128  # the shape: FBGEMM's rows are 512 / 256 / 132 / 68 B
FBGEMM_ROW = {RowDtype.FP32: 512, RowDtype.FP16: 256, RowDtype.INT8: 132, RowDtype.INT4: 68}


def _rows(n: int, rb: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, rb), dtype=np.uint8)


def _map(dtype: RowDtype = RowDtype.INT4, dim: int = DIM, **kw: object) -> HashMapBackend:
    v = HashMapBackend(**kw)  # type: ignore[arg-type]
    v.create_table("t", dim, row_format=dtype)
    return v


@pytest.mark.parametrize(
    ("keys", "layout"),
    [
        (np.arange(1000), KeyLayout.DIRECT),  # an identity vocabulary
        (np.arange(0, 2000, 2), KeyLayout.DIRECT),  # half the range: 4 B × 2 per row ≤ 8 B
        (np.arange(0, 3000, 3) + 2, KeyLayout.SORTED_U32),  # a third: sorted uint32 is smaller
        (np.arange(1000) + 2**32 - 1000, KeyLayout.SORTED_U32),  # dense but far from 0
        (np.arange(1000) - 1, KeyLayout.SORTED_I64),  # a negative key
        (np.arange(1000) * 2**33, KeyLayout.SORTED_I64),  # keys past 2**32
    ],
    ids=["identity", "half", "third", "high", "negative", "wide"],
)
def test_layout_follows_the_density_of_the_keys(keys: np.ndarray, layout: KeyLayout) -> None:
    v = _map(num_partitions=4)
    keys = keys.astype(np.int64)
    rows = _rows(keys.size, row_bytes(RowDtype.INT4, DIM), 0)
    v.insert_rows("t", keys, rows)
    assert v.key_layout("t") is layout
    got, found = v.lookup_rows("t", keys)
    assert found.all() and np.array_equal(got, rows)
    assert not v.lookup_rows("t", np.array([-7, 2**40 + 1, 2**32 + 5], np.int64))[1].any()


@pytest.mark.parametrize("dtype", list(FBGEMM_ROW), ids=lambda d: d.value)
def test_bytes_per_row_exactly_for_each_layout_and_format(dtype: RowDtype) -> None:
    """One load into 4 partitions of 1024+ rows each: pools exactly full, so the bytes are
    the rows plus the index: 4 B per key of the range (direct), 4 B (sorted uint32 keys, the
    rows in key order; int64 keys of a few high words, as runs), 8 B (int64 keys of many high
    words, and the reference layout); the 4 B layouts are within 1.1× FBGEMM's row."""
    rb = row_bytes(dtype, DIM)
    assert rb == FBGEMM_ROW[dtype]
    n = 4096
    cases = [
        (np.arange(n), {}, KeyLayout.DIRECT, 4),
        (np.arange(n) * 5, {}, KeyLayout.SORTED_U32, 4),
        (np.arange(n) * 2**33, {}, KeyLayout.SORTED_I64, 8),
        (np.arange(n), {"compact_keys": False}, KeyLayout.SORTED_I64, 8),
    ]
    for keys, kw, layout, index_bytes in cases:
        v = _map(dtype, num_partitions=4, **kw)
        v.insert_rows("t", keys.astype(np.int64), _rows(n, rb, 1))
        assert v.key_layout("t") is layout
        assert all(p.rows.shape[0] == p.size for p in v._table("t").parts)  # no slack
        assert v.nbytes("t") == n * (rb + index_bytes), (layout, kw)
    # int64 keys of a few high words: runs of low words, + 8 B per run's word and per start
    # (one more start per partition): 2 runs (negative keys and 0..) and 1 run (past 2**32)
    for keys, runs in ((np.arange(n) - n // 2, 2), (np.arange(n) * 5 + 2**40, 1)):
        v = _map(dtype, num_partitions=4)
        v.insert_rows("t", keys.astype(np.int64), _rows(n, rb, 1))
        assert v.key_layout("t") is KeyLayout.SORTED_I64
        assert v.nbytes("t") == n * (rb + 4) + 4 * (8 * runs + 8 * (runs + 1)), runs
        got, found = v.lookup_rows("t", keys.astype(np.int64))
        assert found.all() and np.array_equal(got, _rows(n, rb, 1))
        assert not v.lookup_rows("t", keys.astype(np.int64) + 2**36)[1].any()
    compact = rb + 4
    assert compact <= 1.1 * FBGEMM_ROW[dtype], compact


def _pools(v: HashMapBackend) -> list[tuple[bytes, ...]]:
    """Each partition's content as bytes, key by key in key order: the keys it holds, their
    rows, counts and stamps (where each row sits in the pool is the layout's own: a sorted
    index keeps its rows in key order)."""
    out = []
    for p in v._table("t").parts:
        keys, slots = p.live()
        parts = [keys.astype(np.int64).tobytes(), p.rows[slots].tobytes()]
        parts += [a[slots].tobytes() for a in (p.uses, p.stamp) if a is not None]
        out.append(tuple(parts))
    return out


@pytest.mark.parametrize("policy", list(OverflowPolicy), ids=lambda p: p.value)
@pytest.mark.parametrize("parts", [1, 3])
def test_random_sequences_match_the_sorted_int64_reference(
    policy: OverflowPolicy, parts: int
) -> None:
    """Random inserts (dense runs, scattered keys, in the sparse phase a negative and a 64-bit
    key with its first insert and now and then after), deletes and lookups, with evictions:
    every answer, size, eviction count and pool (rows, free list, counts, stamps, slot of each
    key) equals the reference layout's, while the compact map passes through all three
    layouts. Which keys an eviction takes among equally used ones follows numpy's
    ``argpartition``, whose order among ties depends on the CPU's vector instructions, so
    the wide keys' insert is not left to the random draws."""
    rng = np.random.default_rng(parts)
    kw = {
        "num_partitions": parts,
        "overflow_margin": 900 // parts,
        "overflow_policy": policy,
        "overflow_resolution_target": 0.75,
    }
    v, ref = _map(RowDtype.INT8, 4, **kw), _map(RowDtype.INT8, 4, compact_keys=False, **kw)
    rb = row_bytes(RowDtype.INT8, 4)
    seen = set()
    outliers: list[int] = []
    for step in range(120):
        space = 8000 if 40 <= step < 80 else 1000  # dense, then sparse, then dense again
        if step == 80:  # clear what the sparse phase left beyond the dense range
            gone = np.concatenate([np.arange(1000, 8000), outliers]).astype(np.int64)
            v.delete("t", gone)
            ref.delete("t", gone)
        op = rng.integers(0, 10)
        if op < 5:  # insert: a dense run or scattered keys, rarely beyond uint32 or negative
            if rng.random() < 0.5:
                start = int(rng.integers(0, space - 300))
                k = np.arange(start, start + int(rng.integers(1, 300)))
            else:
                k = np.unique(rng.choice(space, size=int(rng.integers(1, 200))))
            # the sparse phase's first insert always, later ones now and then
            if space > 1000 and (not outliers or rng.random() < 0.1):
                outliers += [-(2**40) - step, 2**35 + step]
                k = np.concatenate([k, outliers[-2:]])
            k = rng.permutation(k).astype(np.int64)
            rows = _rows(k.size, rb, step)
            v.insert_rows("t", k, rows)
            ref.insert_rows("t", k, rows)
            seen.add(v.key_layout("t"))  # right after the insert: evictions may move it on
        elif op < 7:  # delete, some keys absent
            k = rng.integers(-5, space, size=int(rng.integers(1, space // 10))).astype(np.int64)
            v.delete("t", k)
            ref.delete("t", k)
        q = np.concatenate([rng.integers(-3, 8500, size=300), outliers[-4:]])
        a, b = v.lookup_rows("t", q.astype(np.int64)), ref.lookup_rows("t", q.astype(np.int64))
        assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0]), step
        assert v.size("t") == ref.size("t") and v.evicted == ref.evicted, step
        assert _pools(v) == _pools(ref), step
        seen.add(v.key_layout("t"))
    assert seen == set(KeyLayout), seen
    assert v.evicted > 0


def test_switches_when_density_drops_and_for_keys_past_the_bound() -> None:
    v = _map(RowDtype.INT4, 8, num_partitions=2)
    rb = row_bytes(RowDtype.INT4, 8)
    truth = {}

    def put(k: np.ndarray) -> None:
        rows = _rows(k.size, rb, int(k[0]) & 0xFFFF)
        v.insert_rows("t", k.astype(np.int64), rows)
        truth.update(zip(k.tolist(), rows, strict=True))

    def check(layout: KeyLayout) -> None:
        assert v.key_layout("t") is layout
        k = np.array(sorted(truth), np.int64)
        got, found = v.lookup_rows("t", k)
        want = np.stack([truth[x] for x in k.tolist()]) if truth else got
        assert found.all() and np.array_equal(got, want)
        assert v.size("t") == len(truth)

    put(np.arange(1000))
    check(KeyLayout.DIRECT)
    assert v._table("t").direct.size == 1000  # the largest key + 1
    put(np.array([1010]))  # a little past the bound: grows by an eighth
    check(KeyLayout.DIRECT)
    assert v._table("t").direct.size == 1125
    put(np.array([2000]))  # 3 · 1002 ≥ 2001: still dense enough to grow
    check(KeyLayout.DIRECT)
    v.delete("t", np.arange(0, 1000, 2, dtype=np.int64))  # 502 of 2001 left: under a third
    for k in range(0, 1000, 2):
        truth.pop(k)
    check(KeyLayout.SORTED_U32)
    put(np.arange(0, 1000, 2))  # back over half the range
    check(KeyLayout.DIRECT)
    put(np.array([2**32 + 1]))  # a key past uint32: the partition holding it widens
    check(KeyLayout.SORTED_I64)
    v.delete("t", np.array([2**32 + 1], np.int64))
    truth.pop(2**32 + 1)
    check(KeyLayout.DIRECT)
    put(np.array([-1]))
    check(KeyLayout.SORTED_I64)
    v.delete("t", np.arange(-1, 2001, dtype=np.int64))
    truth.clear()
    check(KeyLayout.SORTED_U32)
    assert v.nbytes("t") < 1000 * rb  # the pools compacted, no index left


def test_reads_stay_exact_while_writers_switch_layouts() -> None:
    """Two readers look up keys that are always held while a writer makes the table switch
    between the direct and the sorted index (inserting and deleting half the range)."""
    v = _map(RowDtype.INT8, 4, num_partitions=4)
    rb = row_bytes(RowDtype.INT8, 4)
    stable = np.arange(0, 4000, 4, dtype=np.int64)
    rows = _rows(stable.size, rb, 3)
    v.insert_rows("t", stable, rows)
    churn = np.setdiff1d(np.arange(4000), stable).astype(np.int64)
    errors: list[str] = []
    layouts = set()
    done = threading.Event()

    def read(seed: int) -> None:
        g = np.random.default_rng(seed)
        while not done.is_set():
            i = g.integers(0, stable.size, size=256)
            got, found = v.lookup_rows("t", stable[i])
            if not (found.all() and np.array_equal(got, rows[i])):
                errors.append(f"reader {seed}: a held row was missed or wrong")

    readers = [threading.Thread(target=read, args=(s,)) for s in range(2)]
    for th in readers:
        th.start()
    try:
        for r in range(15):
            v.insert_rows("t", churn, _rows(churn.size, rb, r))
            layouts.add(v.key_layout("t"))
            v.delete("t", churn)
            layouts.add(v.key_layout("t"))
    finally:
        done.set()
        for th in readers:
            th.join()
    assert not errors, errors[:3]
    assert layouts == {KeyLayout.DIRECT, KeyLayout.SORTED_U32}


def test_the_end_of_a_load_gives_back_the_pools_slack() -> None:
    """A second chunk grows the pool by a quarter (slack); ``mark_loaded`` compacts it to the
    rows held, keeping every row and the direct index."""
    v = _map(RowDtype.INT4, DIM, num_partitions=1)
    rb = row_bytes(RowDtype.INT4, DIM)
    keys = np.concatenate([np.arange(0, 2000, 2), np.arange(1, 61, 2)]).astype(np.int64)
    rows = _rows(keys.size, rb, 5)
    v.insert_rows("t", keys[:1000], rows[:1000])
    v.insert_rows("t", keys[1000:], rows[1000:])
    part = v._table("t").parts[0]
    assert v.key_layout("t") is KeyLayout.DIRECT and part.rows.shape[0] == 1250
    v.mark_loaded("t")
    assert part.rows.shape[0] == keys.size and part.free.size == 0
    assert v.nbytes("t") == keys.size * rb + 4 * 1999  # rows + the index over [0, 1999)
    got, found = v.lookup_rows("t", keys)
    assert found.all() and np.array_equal(got, rows)


def test_rows_move_to_an_exclusive_cache_and_back_through_a_direct_index() -> None:
    """An identity table (direct index) under an exclusive cache of most of its rows: lookups
    stay exact while rows move up and are evicted back down (the map falls under a third of
    its range: sorted), every row held in exactly one of the two; inserts of new keys make
    the map dense again (direct) and lookups stay exact."""
    n, dim = 2000, 4
    v = HashMapBackend(num_partitions=4)
    v.create_table("t", dim)
    keys = np.arange(n, dtype=np.int64)
    rows = np.random.default_rng(0).integers(-99, 99, size=(n, dim)).astype(np.float32)
    v.insert("t", keys, rows)
    assert v.key_layout("t") is KeyLayout.DIRECT
    cache = EmbeddingCache(1536, dim, ways=8)
    v.attach_cache("t", cache)
    s = LookupSession([SessionTable("t", dim, 0.0, n, cache)], v, None, hit_rate_threshold=1.0)
    g = torch.Generator().manual_seed(0)
    seen = [v.key_layout("t")]
    for i in range(30):
        hot = i < 15  # a hot set the cache takes in, then the whole range (evictions back)
        q = torch.randint(0, 1400 if hot else n, (512,), generator=g)
        assert torch.equal(s.lookup("t", q), torch.from_numpy(rows)[q])
        seen.append(v.key_layout("t"))
        stored = np.concatenate([p.live()[0] for p in v._table("t").parts])
        homed = cache.slot_keys.keys.view(-1)[cache.homed].numpy()
        assert np.array_equal(np.sort(np.concatenate([stored, homed])), keys)
    assert seen[0] is KeyLayout.DIRECT and seen[-1] is KeyLayout.SORTED_U32, seen
    more = np.arange(n, 2 * n, dtype=np.int64)  # new keys: the map holds over half again
    v.insert("t", more, rows[::-1].copy())
    assert v.key_layout("t") is KeyLayout.DIRECT
    both = np.concatenate([rows, rows[::-1]])
    for _ in range(5):
        q = torch.randint(0, 2 * n, (512,), generator=g)
        assert torch.equal(s.lookup("t", q), torch.from_numpy(both)[q])
    got, found = v.lookup("t", np.concatenate([keys, more]))
    assert found.all() and np.array_equal(got, both)
    assert v.size("t") == 2 * n == v.stored_rows("t") + cache.homed_rows()


class _Hashes:
    """Every key array :func:`hps.storage.hash_partition.partition_of` hashes: its size and
    whether a partition lock of table ``t`` was held meanwhile."""

    def __init__(self, v: HashMapBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, bool]] = []
        real = hash_partition.partition_of

        def spy(keys: np.ndarray, num_partitions: int) -> np.ndarray:
            locked = any(p.lock.locked() for p in v._table("t").parts)
            self.calls.append((int(keys.size), locked))
            return real(keys, num_partitions)

        monkeypatch.setattr(hash_partition, "partition_of", spy)

    def total(self) -> int:
        return sum(n for n, _ in self.calls)


def test_an_eviction_through_a_direct_index_enumerates_its_partition_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every partition of an identity table at its overflow margin evicts on each insert: the
    first such insert scans the direct index once for all partitions, the next hash only
    their own keys (no scan of the table per eviction: O(partition), not O(table))."""
    n, parts = 4096, 4
    margin = int(0.6 * n / parts)
    kw = {
        "num_partitions": parts,
        "overflow_margin": margin,
        "overflow_policy": OverflowPolicy.EVICT_OLDEST,
        "overflow_resolution_target": 1.0,
    }
    v, ref = _map(RowDtype.INT8, 4, **kw), _map(RowDtype.INT8, 4, compact_keys=False, **kw)
    rb = row_bytes(RowDtype.INT8, 4)
    rows = _rows(n, rb, 0)
    for m in (v, ref):
        m.insert_rows("t", np.arange(n, dtype=np.int64), rows)
    assert v.key_layout("t") is KeyLayout.DIRECT and v.size("t") == parts * margin
    hashes = _Hashes(v, monkeypatch)
    for step in range(6):
        q = np.arange(n, dtype=np.int64)
        a, b = v.lookup_rows("t", q), ref.lookup_rows("t", q)  # stamps both alike
        assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0]), step
        absent = np.flatnonzero(~a[1])
        k = absent[step * 7 : step * 7 + 64].astype(np.int64)
        before, evicted = hashes.total(), v.evicted
        v.insert_rows("t", k, rows[k])
        hashed = hashes.total() - before
        ref.insert_rows("t", k, rows[k])
        assert v.evicted - evicted >= parts  # every partition evicted
        assert v.key_layout("t") is KeyLayout.DIRECT
        # the batch's split, plus one scan of the index (the held keys) on the first insert
        assert hashed <= k.size + (v.size("t") + k.size if step == 0 else 0), (step, hashed)
    q = np.arange(n, dtype=np.int64)
    a, b = v.lookup_rows("t", q), ref.lookup_rows("t", q)
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0])
    assert v.evicted == ref.evicted
    t = v._table("t")  # the owners cost 4 B per slot, counted in nbytes
    assert all(p.owner is not None and p.owner.dtype == np.uint32 for p in t.parts)
    cap = sum(p.rows.shape[0] for p in t.parts)
    free = sum(p.free.size for p in t.parts)
    assert v.nbytes("t") == 4 * t.direct.size + cap * (rb + 8 + 4) + 4 * free  # stamps, owners


def test_a_direct_index_is_scanned_once_per_load_end_and_switched_outside_the_locks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``mark_loaded`` trims every partition from one scan of a direct index (not one per
    partition), and a switch to the sorted layout hashes the index with no partition lock
    held (lookups go on meanwhile)."""
    v = _map(RowDtype.INT8, 4, num_partitions=4)
    rb = row_bytes(RowDtype.INT8, 4)
    keys = np.arange(1100, dtype=np.int64)
    rows = _rows(keys.size, rb, 1)
    v.insert_rows("t", keys[:1000], rows[:1000])
    v.insert_rows("t", keys[1000:], rows[1000:])  # grows the pools: slack to trim
    assert v.key_layout("t") is KeyLayout.DIRECT
    assert all(p.free.size for p in v._table("t").parts)
    hashes = _Hashes(v, monkeypatch)
    v.mark_loaded("t")
    assert hashes.total() == keys.size
    assert all(p.free.size == 0 for p in v._table("t").parts)
    hashes.calls.clear()
    v.delete("t", np.arange(1, 1100, 3, dtype=np.int64))  # 733 held: still direct
    v.delete("t", np.arange(0, 1100, 3, dtype=np.int64))  # 366 of 1100: sorted
    assert v.key_layout("t") is KeyLayout.SORTED_U32
    # the switch's scan of the 366 held keys, the last (a delete's compaction scans before)
    assert hashes.calls[-1] == (366, False), hashes.calls
    left = np.arange(2, 1100, 3)
    got, found = v.lookup_rows("t", left.astype(np.int64))
    assert found.all() and np.array_equal(got, rows[left])


def test_a_mostly_overwriting_insert_counts_only_its_new_keys_against_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overwriting held keys plus one key far past a direct index's bound: the held keys do
    not count as new rows, so the index switches to sorted without first growing."""
    v = _map(RowDtype.INT8, 4, num_partitions=2)
    rb = row_bytes(RowDtype.INT8, 4)
    v.insert_rows("t", np.arange(1000, dtype=np.int64), _rows(1000, rb, 2))
    t = v._table("t")
    switched_from: list[int] = []
    real = HashMapBackend._to_sorted

    def spy(self: HashMapBackend, table: object) -> None:
        switched_from.append(t.direct.size if t.direct is not None else -1)
        real(self, table)  # type: ignore[arg-type]

    monkeypatch.setattr(HashMapBackend, "_to_sorted", spy)
    # 1001 rows over a bound of 4001: too sparse; counting the 1001 keys of the call as new
    # (3 · 2001 ≥ 4001) would grow the index to 4001 first
    k = np.concatenate([np.arange(1000), [4000]]).astype(np.int64)
    v.insert_rows("t", k, _rows(k.size, rb, 3))
    assert v.key_layout("t") is KeyLayout.SORTED_U32
    assert switched_from == [1000]


def test_sparse_inserts_in_random_order_merge_into_keys_alone() -> None:
    """Sparse uint32 keys (and int64 keys) inserted in random order, in chunks: new keys go to
    the side part, which merges into the main part (rows in key order) before it outgrows an
    eighth of it, so the index stays near 4 B (8 B) per row while lookups stay exact; the end
    of a load leaves the keys alone, exactly."""
    rb = row_bytes(RowDtype.INT4, DIM)
    rng = np.random.default_rng(5)
    for keys, key_bytes in (
        (np.unique(rng.integers(0, 2**32 - 1, size=6000)), 4),
        (np.unique(rng.integers(-(2**62), 2**62, size=6000)), 8),
        (np.unique(rng.integers(-(2**33), 2**33, size=6000)), 4),  # 4 runs a partition
    ):
        keys = rng.permutation(keys).astype(np.int64)
        rows = _rows(keys.size, rb, 3)
        v = _map(num_partitions=2)
        for chunk in np.array_split(np.arange(keys.size), 12):
            v.insert_rows("t", keys[chunk], rows[chunk])
            for p in v._table("t").parts:
                ix = p.sorted_index
                assert ix.side_keys.size <= max(64, ix.keys.size // 8)
        got, found = v.lookup_rows("t", keys)
        assert found.all() and np.array_equal(got, rows)
        v.delete("t", keys[:500])  # deleted main keys are marked (1 B per main key)
        assert not v.lookup_rows("t", keys[:500])[1].any()
        v.insert_rows("t", keys[:250], rows[:250])  # back into the freed slots, side part
        kept = np.r_[0:250, 500 : keys.size]
        got, found = v.lookup_rows("t", keys[kept])
        assert found.all() and np.array_equal(got, rows[kept])
        assert not v.lookup_rows("t", keys[250:500])[1].any()
        v.mark_loaded("t")
        n = keys.size - 250
        runs = sum(
            0 if p.sorted_index.runs is None else p.sorted_index.runs[0].size
            for p in v._table("t").parts
        )
        run_bytes = 16 * runs + 8 * sum(
            p.sorted_index.runs is not None for p in v._table("t").parts
        )
        assert runs == (8 if key_bytes == 4 and keys.min() < 0 else 0)
        assert v.nbytes("t") == n * (rb + key_bytes) + run_bytes, key_bytes


def test_a_merge_builds_outside_the_partition_lock_lookups_read_the_old_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a merge builds the new index (the writer's lock held), a lookup of the same
    partition runs to the end and finds every key with its row (the old pool and index); the
    use counts it writes meanwhile survive the swap."""
    v = _map(RowDtype.INT4, 8, num_partitions=1, overflow_policy=OverflowPolicy.EVICT_LEAST_USED)
    rb = row_bytes(RowDtype.INT4, 8)
    main = np.arange(0, 4000, 4, dtype=np.int64)
    rows = _rows(main.size, rb, 1)
    v.insert_rows("t", main, rows)
    part = v._table("t").parts[0]
    seen: list[bool] = []

    class Probe(hash_partition.SortedIndex):
        def reset(self, keys: np.ndarray, keep: bool = False) -> None:
            out: list[tuple[np.ndarray, np.ndarray]] = []
            reader = threading.Thread(target=lambda: out.append(v.lookup_rows("t", main)))
            reader.start()
            reader.join(timeout=10)
            seen.append(part.lock.locked())
            ok = bool(out) and out[0][1].all() and np.array_equal(out[0][0], rows)
            assert ok, "a lookup during the merge's build did not finish or went wrong"
            super().reset(keys, keep)

    monkeypatch.setattr(hash_partition, "SortedIndex", Probe)
    side = np.arange(1, 4000, 4, dtype=np.int64)[::-1][:200]  # > main / 8: a merge
    side_rows = _rows(side.size, rb, 2)
    for k, r in zip(side, side_rows, strict=True):  # one key at a time: side inserts
        v.insert_rows("t", k[None], r[None])
    assert seen and not any(seen)  # the build ran, never under the partition lock
    assert isinstance(part.sorted_index, Probe) and part.sorted_index.side_size < 200
    # each build's lookup read every main key once, on the old pool's slots: the counts
    # moved to the new slots with their rows; the side keys were never read
    assert part.uses is not None
    live_keys, live_slots = part.live()
    uses = dict(zip(live_keys.tolist(), part.uses[live_slots].tolist(), strict=True))
    assert [uses[k] for k in main.tolist()] == [len(seen)] * main.size
    assert [uses[k] for k in side.tolist()] == [0] * side.size
    keys = np.concatenate([main, side])
    got, found = v.lookup_rows("t", keys)
    assert found.all() and np.array_equal(got, np.concatenate([rows, side_rows]))
