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
