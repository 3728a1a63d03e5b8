"""The negative cache of a lookup session (:class:`hps.session.tiers.AbsentKeys`): keys no
tier holds are answered with the default vector without a database read (on the synchronous
and the asynchronous path), until an update may have added them or they are older than
``max_absent_age_s``; never a key a tier failed to read; bounded per table; counted in the
session's statistics."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.session import LookupSession, SessionTable
from hps.session.tiers import AbsentKeys
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.volatile import HashMapBackend
from hps.types import TierRead, TierUnavailableError
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


class _FailingHashMap(HashMapBackend):
    """A hash map whose reads fail for keys >= ``fail_from`` (as a down Redis node's would)."""

    name = "flaky"

    def __init__(self, fail_from: int) -> None:
        super().__init__(num_partitions=2)
        self.fail_from = fail_from

    def read(self, table: str, keys: np.ndarray) -> TierRead:
        values, found = self.lookup(table, keys)
        failed = keys >= self.fail_from
        values[failed], found[failed] = 0.0, False
        return TierRead(values, found, failed, "node 127.0.0.1:1 down")


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _session(max_absent_keys: int = 1024, asynchronous: bool = False):
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
        # 1.0: synchronous fill, every miss is read now; 0.0 (not exact): every miss gets the
        # default now and is read by a background job
        hit_rate_threshold=0.0 if asynchronous else 1.0,
        exact=not asynchronous,
        max_absent_keys=max_absent_keys,
        # ages are tested with a hand-moved clock below; here a busy machine's seconds
        # between two lookups must not expire the entries under test
        max_absent_age_s=math.inf,
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


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_key_no_tier_could_read_is_never_taken_as_absent(
    tmp_path: Path, asynchronous: bool
) -> None:
    # key 150: its volatile read fails; the persistent DB lacks it and does not hold every row
    keys = np.arange(200, dtype=np.int64)
    rows = np.arange(200 * DIM, dtype=np.float32).reshape(200, DIM)
    vdb = _FailingHashMap(fail_from=100)
    vdb.create_table("t", DIM)
    vdb.insert("t", keys, rows)
    pdb = RocksDBBackend(tmp_path / "pdb")
    pdb.create_table("t", DIM)
    pdb.insert("t", keys[:100], rows[:100])
    s = LookupSession(
        [SessionTable("t", DIM, DEFAULT, 10_000, EmbeddingCache(16, DIM, ways=4))],
        vdb,
        pdb,
        hit_rate_threshold=0.0 if asynchronous else 1.0,
        exact=not asynchronous,
    )
    try:
        q = torch.tensor([150, 250], dtype=torch.int64)  # 250: fails too, the pdb lacks it
        for _ in range(2):
            if asynchronous:  # the default now; the background read fails for both keys
                assert bool((s.lookup("t", q) == DEFAULT).all())
                s.drain()
            else:
                with pytest.raises(TierUnavailableError, match=r"2 key\(s\) could not be read"):
                    s.lookup("t", q)
        assert s.stats("t")["known_absent"] == {"held": 0, "answered": 0, "restarts": 0}
        # a key the volatile DB answered (not failed) and the pdb lacks is absent
        s.lookup("t", torch.tensor([-5], dtype=torch.int64))
        s.drain()
        assert s.stats("t")["known_absent"]["held"] == 1  # type: ignore[index]
    finally:
        s.close()
        pdb.close()


def test_an_absent_key_is_not_read_again_in_the_background() -> None:
    s, name, keys, rows, vdb = _session(asynchronous=True)
    absent = torch.tensor([10_001, 10_002], dtype=torch.int64)
    assert bool((s.lookup(name, absent) == DEFAULT).all())
    s.drain()  # the background job read them: no tier holds them
    assert {10_001, 10_002} <= _read_keys(vdb)
    assert s.stats(name)["known_absent"]["held"] == 2  # type: ignore[index]
    vdb.reads.clear()
    batch = torch.cat([absent, torch.from_numpy(keys[:2].copy())])
    out = s.lookup(name, batch)
    s.drain()
    assert not ({10_001, 10_002} & _read_keys(vdb)), "absent keys were read again"
    assert _read_keys(vdb) == {int(k) for k in keys[:2]}  # the others still are
    assert bool((out == DEFAULT).all())  # asynchronous: every miss gets the default now
    vdb.reads.clear()
    s.lookup(name, absent)  # nothing left to read: no background job at all
    s.drain()
    assert vdb.reads == []
    assert s.stats(name)["known_absent"]["answered"] == 4  # type: ignore[index]
    s.close()


def test_an_absent_key_older_than_the_age_is_read_again() -> None:
    s, name, _, _, vdb = _session()
    clock = _Clock()
    s.absent = s.fill.absent = AbsentKeys(1024, max_age_s=1.0, clock=clock)
    k = torch.tensor([40_000], dtype=torch.int64)
    assert bool((s.lookup(name, k) == DEFAULT).all())
    # another process adds the key to the shared tier: no update generation moves here
    vdb.insert(name, k.numpy(), np.full((1, DIM), 2.5, np.float32))
    clock.now += 0.9
    vdb.reads.clear()
    assert bool((s.lookup(name, k) == DEFAULT).all())  # within the age: not read
    assert vdb.reads == []
    clock.now += 0.1  # the entry is 1.0 s old: expired
    assert s.stats(name)["known_absent"]["held"] == 0  # type: ignore[index]
    assert bool((s.lookup(name, k) == 2.5).all())
    assert 40_000 in _read_keys(vdb)
    s.close()


def test_absent_keys_go_stale_with_a_write_section_or_their_age() -> None:
    clock = _Clock()
    ab = AbsentKeys(8, max_age_s=2.0, clock=clock)
    assert ab.known("t", np.array([1, 2], np.int64), 0) is None
    ab.add("t", np.array([5, 3, 5], np.int64), 0)
    got = ab.known("t", np.array([3, 4, 5, 6], np.int64), 0)
    assert got is not None and got.tolist() == [True, False, True, False]
    assert ab.known("t", np.array([3], np.int64), 1) is None  # a write section since: stale
    clock.now += 1.5
    ab.add("t", np.array([7], np.int64), 0)  # merged: the entry keeps its first key's time
    clock.now += 0.5
    assert ab.known("t", np.array([3, 7], np.int64), 0) is None
    ab.add("t", np.array([7], np.int64), 0)  # an expired entry starts over, aged 0
    got = ab.known("t", np.array([3, 7], np.int64), 0)
    assert got is not None and got.tolist() == [False, True]
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="max_absent_age_s must be a number > 0, got"):
            AbsentKeys(8, max_age_s=bad)


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


class _LostPartitions(_CountingHashMap):
    """A hash map standing in for a Redis cluster whose partitions lost their rows."""

    def __init__(self) -> None:
        super().__init__()
        self.errors, self.unmarked_reads = 1, 0

    def unmarked_partitions(self, table: str) -> list[int]:
        return [0, 1]

    def mark_loaded(self, table: str, partitions: list[int] | None = None) -> None:
        super().mark_loaded(table)


def test_the_volatile_repair_forgets_absent_keys(tmp_path: Path) -> None:
    from hps.config import TableSpec
    from hps.storage.sparse_files import write_table
    from hps.volatile_repair import VolatileRepair

    keys, rows = make_table(N, DIM, seed=3)
    vdb = _LostPartitions()
    vdb.create_table("t", DIM)  # every row lost
    c = EmbeddingCache(N * 2, DIM, ways=8)
    s = LookupSession([SessionTable("t", DIM, DEFAULT, 10_000, c)], vdb, None, exact=True)
    q = torch.from_numpy(keys[:2].copy())
    assert bool((s.lookup("t", q) == DEFAULT).all())  # "not found": taken as absent
    assert s.stats("t")["known_absent"]["held"] == 2  # type: ignore[index]
    write_table(tmp_path / "t", keys, rows)
    spec = TableSpec("t", str(tmp_path / "t"), DIM, 1, DEFAULT)
    # written under the reader side of the update lock: no generation moves
    assert VolatileRepair(vdb, None, [spec], [s]).repair_once() == 2  # type: ignore[arg-type]
    torch.testing.assert_close(s.lookup("t", q), torch.from_numpy(rows[:2]), rtol=0, atol=0)
    s.close()
