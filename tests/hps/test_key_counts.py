"""KeyCounts (hash map, O(keys) per update) answers as KeyStatistics (the reference) does."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hps.advisor import KeyStatistics
from hps.kernels import load_extension
from hps.key_counts import KeyCounts


def _needs_ext() -> None:
    if load_extension() is None:
        if os.environ.get("CI"):
            pytest.fail("the hps compiled kernel could not be built (python -m hps.build_ext -v)")
        pytest.skip("the hps compiled kernel is not built")


def test_counts_equal_the_reference() -> None:
    _needs_ext()
    rng = np.random.default_rng(0)
    fast, ref = KeyCounts(), KeyStatistics()
    assert fast.counter is not None
    for step in range(30):
        keys = rng.integers(-50, 5000, size=rng.integers(1, 3000)).astype(np.int64)
        if step % 3:
            fast.update(keys)
            ref.update(keys)
        else:
            u, c = np.unique(keys, return_counts=True)
            fast.update(u, c * 3)
            ref.update(u, c * 3)
        if step % 7 == 6:
            fast.halve(1 + step % 2)
            ref.halve(1 + step % 2)
        q = rng.integers(-60, 5100, size=500).astype(np.int64)
        assert np.array_equal(fast.count_of(q), ref.count_of(q))
    assert fast.total == ref.total and fast.aged_mass == ref.aged_mass
    assert np.array_equal(fast.hottest(), ref.hottest())  # ties: the smaller key first, both
    assert np.array_equal(fast.hottest(10), ref.hottest(10))
    assert np.array_equal(fast.counts(), ref.counts())


def test_trim_keeps_the_hottest() -> None:
    _needs_ext()
    fast = KeyCounts(max_keys=10)
    hot = np.arange(10, dtype=np.int64)
    fast.update(hot, np.full(10, 100, np.int64))
    fast.update(np.arange(100, 125, dtype=np.int64))  # 35 distinct > 2 × 10: trimmed
    assert sorted(fast.hottest().tolist()) == hot.tolist()
    assert fast.count_of(np.array([3, 110]))[0] == 100 and fast.count_of(np.array([110]))[0] == 0


def test_halve_rejects_negative_times() -> None:
    with pytest.raises(ValueError, match="times >= 0"):
        KeyCounts().halve(-1)
