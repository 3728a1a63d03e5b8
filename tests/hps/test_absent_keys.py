"""The negative cache of a lookup session (:class:`hps.session.tiers.AbsentKeys`): keys no
tier holds are answered with the default vector without a database read, until an update may
have added them; bounded per table; counted in the session's statistics."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from hps.session import LookupSession, SessionTable
from hps.session.tiers import AbsentKeys
from hps.storage.cache import EmbeddingCache
from hps.storage.volatile import HashMapBackend
from tests.hps.hps_helpers import make_table

DIM = 4
DEFAULT = -7.0
N = 64


class _CountingHashMap(HashMapBackend):
    """A hash map that records the keys of every read."""

    def __init__(self) -> None:
        super().__init__(num_partitions=2)
        self.reads: list[np.ndarray] = []

    def read(self, table: str, keys: np.ndarray):  # type: ignore[no-untyped-def]
        self.reads.append(np.array(keys))
        return super().read(table, keys)


def _session(max_absent_keys: int = 1024):
    keys, rows = make_table(N, DIM, seed=3)
    name = f"t_{uuid.uuid4().hex[:8]}"
    vdb = _CountingHashMap()
    vdb.create_table(name, DIM)
    vdb.insert(name, keys, rows)
    vdb.mark_loaded(name)
    cache = EmbeddingCache(N * 2, DIM, ways=8)
    s = LookupSession(
        [SessionTable(name, DIM, DEFAULT, 10_000, cache)],
        vdb,
        None,
        hit_rate_threshold=1.0,  # synchronous fill: every miss is read now
        exact=True,
        max_absent_keys=max_absent_keys,
    )
    return s, name, keys, rows, vdb


def _read_keys(vdb: _CountingHashMap) -> set[int]:
    return {int(k) for r in vdb.reads for k in r}


@pytest.mark.parametrize("fused", [False, True])
def test_absent_keys_are_not_read_again_and_are_counted(fused: bool) -> None:
    s, name, keys, rows, vdb = _session()
    absent = torch.tensor([10_001, 10_002], dtype=torch.int64)
    present = torch.from_numpy(keys[:3].copy())
    batch = torch.cat([absent, present])

    def look() -> torch.Tensor:
        if fused:
            return s.lookup_many([name], [batch])[0].clone()
        return s.lookup(name, batch)

    first = look()
    assert {10_001, 10_002} <= _read_keys(vdb)
    vdb.reads.clear()
    second = look()
    assert not ({10_001, 10_002} & _read_keys(vdb)), "absent keys were read again"
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert bool((second[:2] == DEFAULT).all())
    torch.testing.assert_close(second[2:], torch.from_numpy(rows[:3]), rtol=0, atol=0)
    st = s.stats(name)["known_absent"]
    assert st == {"held": 2, "answered": 2, "restarts": 0}
    assert s.stats(name)["hits_all"]["default"] == 4  # type: ignore[index]
    s.close()


def test_a_key_added_by_an_update_is_served_not_the_default() -> None:
    s, name, _, _, vdb = _session()
    k = torch.tensor([20_000], dtype=torch.int64)
    assert bool((s.lookup(name, k) == DEFAULT).all())
    assert bool((s.lookup(name, k) == DEFAULT).all())  # now from the negative cache
    row = np.full((1, DIM), 3.5, np.float32)
    s.update_lock.acquire_write()  # as an online update does (hps.updates.applier)
    try:
        vdb.insert(name, k.numpy(), row)
    finally:
        s.update_lock.release_write()
    torch.testing.assert_close(s.lookup(name, k), torch.from_numpy(row), rtol=0, atol=0)
    assert s.stats(name)["known_absent"]["held"] == 0  # type: ignore[index]
    s.close()


def test_forget_absent_keys_for_writers_outside_the_update_lock() -> None:
    s, name, _, _, vdb = _session()
    k = torch.tensor([30_000], dtype=torch.int64)
    s.lookup(name, k)
    vdb.insert(name, k.numpy(), np.ones((1, DIM), np.float32))
    assert bool((s.lookup(name, k) == DEFAULT).all())  # the negative cache still answers
    s.forget_absent_keys(name)
    assert bool((s.lookup(name, k) == 1.0).all())
    s.close()


def test_a_key_no_tier_could_read_is_never_taken_as_absent() -> None:
    ab = AbsentKeys(8)
    assert ab.known("t", np.array([1, 2], np.int64), 0) is None
    ab.add("t", np.array([5, 3, 5], np.int64), 0)
    got = ab.known("t", np.array([3, 4, 5, 6], np.int64), 0)
    assert got is not None and got.tolist() == [True, False, True, False]
    assert ab.known("t", np.array([3], np.int64), 1) is None  # a write section since: stale


def test_the_negative_cache_is_bounded() -> None:
    ab = AbsentKeys(4)
    ab.add("t", np.arange(3, dtype=np.int64), 0)
    ab.add("t", np.arange(10, 13, dtype=np.int64), 0)  # 6 > 4: starts over from these
    assert ab.stats("t", 0) == {"held": 3, "answered": 0, "restarts": 1}
    assert ab.known("t", np.array([0], np.int64), 0) is None
    off = AbsentKeys(0)
    off.add("t", np.arange(3, dtype=np.int64), 0)
    assert off.known("t", np.arange(3, dtype=np.int64), 0) is None
    with pytest.raises(ValueError, match="max_absent_keys must be an integer >= 0, got -1"):
        AbsentKeys(-1)
