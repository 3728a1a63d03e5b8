from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hps.storage.volatile import HashMapBackend, partition_of, split_by_partition
from tests.hps.hps_helpers import make_table


def test_partitioned_map_matches_a_dict() -> None:
    db = HashMapBackend(num_partitions=4)
    db.create_table("t", 3)
    keys, rows = make_table(500, 3, seed=0)
    db.insert("t", keys[:300], rows[:300])
    db.insert("t", keys[200:], rows[200:] + 1)  # overlap: overwrite 200..299
    assert db.size("t") == 500
    q = np.concatenate([keys, np.array([-5, 10**12], np.int64)])
    v, f = db.lookup("t", q)
    assert f[:500].all() and not f[500:].any()
    expect = rows.copy()
    expect[200:] += 1
    assert np.array_equal(v[:500], expect) and np.array_equal(v[500:], np.zeros((2, 3), np.float32))
    db.delete("t", keys[:10])
    assert db.size("t") == 490 and not db.lookup("t", keys[:10])[1].any()


@pytest.mark.parametrize("num_partitions", [1, 4])
def test_insert_refuses_duplicate_keys(num_partitions: int) -> None:
    db = HashMapBackend(num_partitions=num_partitions)
    db.create_table("t", 2)
    db.insert("t", np.array([1, 2], np.int64), np.ones((2, 2), np.float32))
    keys = np.array([7, 2, 9, 7], np.int64)  # 2 is already held, 7 is new and given twice
    with pytest.raises(
        ValueError,
        match=r"into 't': keys must be unique within a call, but key 7 occurs "
        r"more than once \(1 repeated key\(s\) among 4\)",
    ):
        db.insert("t", keys, np.full((4, 2), 5.0, np.float32))
    assert db.size("t") == 2  # nothing inserted, nothing overwritten
    v, f = db.lookup("t", np.array([1, 2, 7, 9], np.int64))
    assert f.tolist() == [True, True, False, False] and np.array_equal(
        v[:2], np.ones((2, 2), np.float32)
    )


def test_partitions_split_keys() -> None:
    k = np.arange(10_000, dtype=np.int64)
    parts = split_by_partition(k, 8)
    assert sorted(np.concatenate([i for _, i in parts]).tolist()) == list(range(10_000))
    counts = np.bincount(partition_of(k, 8), minlength=8)
    assert counts.min() > 1100


def _filled(policy: str, margin: int = 100) -> tuple[HashMapBackend, np.ndarray, np.ndarray]:
    db = HashMapBackend(
        num_partitions=1,
        overflow_margin=margin,
        overflow_policy=policy,
        overflow_resolution_target=0.5,
    )
    db.create_table("t", 2)
    keys, rows = make_table(100, 2, seed=3)
    db.insert("t", keys, rows)
    return db, keys, rows


def test_evict_least_used() -> None:
    db, keys, rows = _filled("evict_least_used")
    db.lookup("t", keys[:50])
    db.lookup("t", keys[:50])
    db.insert("t", np.array([10**9], np.int64), np.zeros((1, 2), np.float32))  # overflow: 101 > 100
    assert db.size("t") == 50 and db.evicted == 51
    v, f = db.lookup("t", keys[:50])
    assert f.all() and np.array_equal(v, rows[:50])


def test_evict_oldest() -> None:
    db, keys, rows = _filled("evict_oldest")
    db.lookup("t", keys[60:])  # keys[60:] touched last
    db.insert("t", keys[50:60], rows[50:60])  # rewritten: newer still
    db.insert("t", np.array([10**9], np.int64), np.zeros((1, 2), np.float32))
    assert db.size("t") == 50
    kept = db.lookup("t", keys)[1]
    # the 50 survivors are among the newest 51 (keys[50:] and the new key)
    assert not kept[:50].any() and kept[50:].sum() >= 49


def test_evict_random_reaches_target() -> None:
    db, keys, _ = _filled("evict_random")
    db.insert("t", np.array([10**9], np.int64), np.zeros((1, 2), np.float32))
    assert db.size("t") == 50
    v, f = db.lookup("t", keys)
    assert 40 <= f.sum() <= 50


def test_bad_inputs() -> None:
    db = HashMapBackend()
    db.create_table("t", 2)
    with pytest.raises(ValueError, match="dtype int64"):
        db.lookup("t", np.arange(3, dtype=np.int32))
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        db.insert("t", np.arange(3, dtype=np.int64), np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="no table 'x'"):
        db.lookup("x", np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="dim 2, not 5"):
        db.create_table("t", 5)
    with pytest.raises(ValueError, match="overflow_resolution_target"):
        HashMapBackend(overflow_resolution_target=1.5)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(-(2**63) + 1, 2**63 - 1), max_size=50, unique=True),
        min_size=1,
        max_size=5,
    ),
    st.integers(1, 5),
)
def test_hash_map_property(batches, parts) -> None:
    db = HashMapBackend(num_partitions=parts)
    db.create_table("t", 1)
    truth: dict[int, float] = {}
    for i, b in enumerate(batches):
        k = np.array(b, np.int64)
        db.insert("t", k, np.full((k.size, 1), i, np.float32))
        truth.update({x: float(i) for x in b})
    k = np.array(sorted(truth), np.int64)
    v, f = db.lookup("t", k)
    assert f.all() and [float(x) for x in v[:, 0]] == [truth[int(x)] for x in k]
    assert db.size("t") == len(truth)
