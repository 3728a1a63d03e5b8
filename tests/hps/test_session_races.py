"""Background cache work never undoes an online update, and LFU admission sees how hot a key is
across requests (not only within one)."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.volatile import HashMapBackend
from hps.updates import FileLogSource, UpdateApplier
from tests.hps.hps_helpers import needs_ext
from tests.hps.test_cache_aging import _AllKeys, _keys


def _session(tmp_path, vdb: HashMapBackend, cache: EmbeddingCache, exact: bool, threshold: float):
    s = LookupSession(
        [SessionTable("t", 2, 0.0, 10_000, cache)],
        vdb,
        None,
        exact=exact,
        hit_rate_threshold=threshold,
    )
    ap = UpdateApplier(
        FileLogSource(tmp_path / "none.log"), [s], vdb, None, offset_file=tmp_path / "off"
    )
    return s, ap


def _vdb(n: int, value: float, cls: type[HashMapBackend] = HashMapBackend) -> HashMapBackend:
    vdb = cls(num_partitions=1)
    vdb.create_table("t", 2)
    vdb.insert("t", np.arange(n, dtype=np.int64), np.full((n, 2), value, np.float32))
    return vdb


def _update(ap: UpdateApplier, key: int, value: float, offset: str) -> None:
    ap.apply({"t": (np.array([key], np.int64), np.full((1, 2), value, np.float32))}, offset)


def test_queued_insertion_of_rows_read_before_an_update_is_dropped(tmp_path) -> None:
    """Exact mode above the threshold: the lookup reads key 3's old row and queues its cache
    insertion; an update lands before the worker runs; the old row must not be cached."""
    vdb = _vdb(10, 0.0)
    s, ap = _session(tmp_path, vdb, EmbeddingCache(64, 2, ways=8), exact=True, threshold=0.0)
    gate = threading.Event()
    s.fill.submit(s.tables["t"], gate.wait)  # the worker is busy (as under load)
    assert s.lookup("t", torch.tensor([3])).tolist() == [[0.0, 0.0]]  # the old row; insert queued
    _update(ap, 3, 9.0, "1")
    gate.set()
    s.drain()
    assert s.lookup("t", torch.tensor([3])).tolist() == [[9.0, 9.0]]
    assert s.stats("t")["stale_dropped"] == 1
    s.close()


class _SlowVDB(HashMapBackend):
    """A volatile DB whose lookup calls ``hook`` right after reading (once)."""

    hook = None

    def lookup(self, table, keys):
        out = super().lookup(table, keys)
        if self.hook is not None:
            h, self.hook = self.hook, None
            h()
        return out


def test_refresh_and_an_update_do_not_interleave(tmp_path) -> None:
    """An update arriving while refresh has read key 3 waits until refresh has written it back,
    so the cache ends with the update's row."""
    vdb = _vdb(10, 0.0, _SlowVDB)
    cache = EmbeddingCache(64, 2, ways=8)
    s, ap = _session(tmp_path, vdb, cache, exact=True, threshold=1.0)
    s.lookup("t", torch.tensor([3]))  # cached (synchronous fill)
    updater = threading.Thread(target=_update, args=(ap, 3, 9.0, "1"))
    vdb.hook = lambda: (updater.start(), time.sleep(0.2))  # the update tries to land mid-refresh
    assert s.refresh("t", 1.0) == 1
    updater.join(timeout=10)
    assert not updater.is_alive() and ap.applied == 1
    assert cache.contains(torch.tensor([3])).all()
    assert s.lookup("t", torch.tensor([3])).tolist() == [[9.0, 9.0]]
    s.close()


def test_warm_up_after_update_caches_the_new_row(tmp_path) -> None:
    vdb = _vdb(10, 0.0)
    s, ap = _session(tmp_path, vdb, EmbeddingCache(64, 2, ways=8), exact=True, threshold=1.0)
    _update(ap, 4, 5.0, "1")
    assert s.warm_up("t", np.array([4, 2])) == 2
    assert s.lookup("t", torch.tensor([4])).tolist() == [[5.0, 5.0]]
    s.close()


def test_lfu_admits_a_key_hot_across_requests(tmp_path) -> None:
    """LFU, asynchronous insertion, a full cache of keys used once: key 500, looked up in every
    request, must get in (its priority counts earlier requests too) and then hit."""
    vdb = _vdb(1000, 1.0)
    cache = EmbeddingCache(8, 2, policy="lfu", ways=8)
    s, _ = _session(tmp_path, vdb, cache, exact=False, threshold=0.0)
    s.lookup("t", torch.arange(8))
    s.drain()
    assert cache.contains(torch.arange(8)).all()  # full, each key used once
    for _ in range(20):
        s.lookup("t", torch.tensor([500, 500]))
        s.drain()
    assert bool(cache.contains(torch.tensor([500])).all())
    assert s.stats("t")["hits_all"]["cache"] >= 2 * 18
    s.close()


def test_an_aging_in_the_fused_pass_halves_the_statistics_once_under_a_race() -> None:
    """The fused pass halves a table's key counter itself when its query crosses an aging. An
    aging of the statistics by another thread right after the pass (as the cache's clock
    moves) must see the old epoch with the old label or the new epoch with the new one, never
    the new epoch with the old label (the statistics would be halved twice)."""
    needs_ext()

    class Racing(EmbeddingCache):
        racer: threading.Thread | None = None

        def _advance_age(self, looked_up: int) -> int:
            crossed = super()._advance_age(looked_up)
            if crossed and Racing.racer is not None:
                racer, Racing.racer = Racing.racer, None
                racer.start()
                # a bound on the wait, not an assertion: racing ahead, it would halve now
                done.wait(1.0)
            return crossed

    def session(cache: EmbeddingCache) -> LookupSession:
        return LookupSession(
            [SessionTable("t", 1, -1.0, 10**6, cache)],
            _AllKeys(100),
            None,
            hit_rate_threshold=1.0,
            key_stats_sampling=1,
        )

    c = Racing(4, 1, policy="lfu", ways=4, lfu_decay_keys_per_slot=1.0)  # interval 4
    ref_cache = EmbeddingCache(4, 1, policy="lfu", ways=4, lfu_decay_keys_per_slot=1.0)
    s, ref = session(c), session(ref_cache)
    for x in (s, ref):
        x.lookup_many(["t"], [_keys(9, 9, 9)])
    done = threading.Event()

    def age() -> None:
        s._age_key_stats(s.tables["t"], c)
        done.set()

    Racing.racer = threading.Thread(target=age)
    racer = Racing.racer
    for x in (s, ref):
        x.lookup_many(["t"], [_keys(9, 9, 9)])  # crosses the aging at 4 keys
    racer.join(5)
    assert done.is_set() and c.decay_epoch == ref_cache.decay_epoch == 1
    assert s.key_stats is not None and ref.key_stats is not None
    assert s.key_stats["t"].counter is not None  # counted in the pass
    assert s.key_stats["t"].count_of(np.array([9])).tolist() == [4]  # 3 >> 1, then + 3
    assert s.key_stats["t"].count_of(np.array([9])) == ref.key_stats["t"].count_of(np.array([9]))
    assert s.key_stats["t"].aged_mass == ref.key_stats["t"].aged_mass
    assert s._stats_epoch["t"][1] == 1
    s.close()
    ref.close()
