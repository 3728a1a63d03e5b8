"""The sorted key index's costs, checked by structure (no timing): appends write in place
in a doubling buffer, side inserts rarely rewrite the side's larger level, the extent never
reads the deleted marks."""

from __future__ import annotations

import numpy as np

from hps.storage.sorted_index import MIN_MERGE, SortedIndex


def _index(keys: np.ndarray) -> SortedIndex:
    idx = SortedIndex(compact=True)
    idx.add(keys, np.arange(keys.size, dtype=np.int32))
    return idx


def test_appends_write_in_place_and_reallocate_log_times() -> None:
    idx = _index(np.arange(0, 100, dtype=np.int64) * 10)
    reallocations = 0
    for i in range(1000):
        before = idx.keys
        m = before.size
        idx.add(np.array([1000 + 10 * i], np.int64), np.array([m], np.int32))
        if np.shares_memory(before, idx.keys):
            assert idx.keys.base is before.base or idx.keys.base is before
        else:
            reallocations += 1
        assert idx.capacity < 2 * idx.keys.size + 1
    assert reallocations <= 5  # 100 → 1100 keys: doublings only
    assert idx.keys.dtype == np.uint32 and idx.runs is None
    want = np.concatenate([np.arange(100) * 10, 1000 + 10 * np.arange(1000)])
    assert np.array_equal(idx.live()[0], want)
    found, slots = idx.find(want)
    assert found.all() and np.array_equal(slots, np.arange(1100))


def test_appends_past_uint32_add_a_run_only_when_the_high_word_changes() -> None:
    idx = _index(np.arange(10, dtype=np.int64))
    words = [0, 0, 1, 1, 1, 5, 5, 7]
    keys: list[int] = list(range(10))
    for i, w in enumerate(words):
        k = (w << 32) | (100 + i)
        idx.add(np.array([k], np.int64), np.array([len(keys)], np.int32))
        keys.append(k)
    assert idx.runs is not None and idx.keys.dtype == np.uint32
    assert idx.runs[0].tolist() == [0, 1, 5, 7]
    assert idx.runs[1].tolist() == [0, 12, 15, 17, 18]
    assert np.array_equal(idx.live()[0], np.array(keys))
    found, slots = idx.find(np.array(keys + [100 + 2, (1 << 32) | 101]))
    assert found.tolist() == [True] * len(keys) + [False, False]
    assert np.array_equal(slots, np.arange(len(keys)))


def test_side_inserts_rewrite_the_larger_level_once_per_sqrt_inserts() -> None:
    n = 1 << 16
    idx = _index(np.arange(n, dtype=np.int64) * 4)
    rng = np.random.default_rng(0)
    side = rng.choice(n, size=2000, replace=False) * 4 + 1
    rewrites = 0
    for i, k in enumerate(side.tolist()):
        before = idx.side_keys
        idx.add(np.array([k], np.int64), np.array([n + i], np.int32))
        rewrites += idx.side_keys is not before
        assert idx.tail_keys.size <= max(MIN_MERGE, int(np.sqrt(idx.side_keys.size))) + 1
    assert rewrites <= 2000 // MIN_MERGE
    found, slots = idx.find(side)
    assert found.all() and np.array_equal(slots, n + np.arange(2000))
    idx.remove(side[:1000], n + np.arange(1000))
    found, _ = idx.find(side)
    assert found.tolist() == [False] * 1000 + [True] * 1000
    assert idx.size == n + 1000
    keys, slots = idx.live()
    assert np.array_equal(keys, np.sort(np.concatenate([np.arange(n) * 4, side[1000:]])))


class _Untouchable:
    """Stands for the deleted marks where they must not be read."""

    def __getitem__(self, _: object) -> None:
        raise AssertionError("the deleted marks were read")

    def __invert__(self) -> None:
        raise AssertionError("the deleted marks were read")


def test_extent_is_the_live_bounds_without_reading_the_deleted_marks() -> None:
    idx = _index(np.arange(1000, dtype=np.int64) + 5)
    idx.remove(np.array([5, 6, 1004], np.int64), np.array([0, 1, 999]))
    idx.remove(np.arange(600, 1004, dtype=np.int64), np.arange(595, 999))
    dead = idx.dead
    idx.dead = _Untouchable()  # type: ignore[assignment]
    assert idx.extent() == (7, 599)
    idx.dead = dead
    idx.add(np.array([2000], np.int64), np.array([1000], np.int32))
    idx.dead = _Untouchable()  # type: ignore[assignment]
    assert idx.extent() == (7, 2000)
    idx.dead = dead
    idx.remove(np.arange(7, 600, dtype=np.int64), np.arange(2, 595))
    assert idx.extent() == (2000, 2000)
