"""HPS benchmark sections over the databases (``python -m benchmarks.hps.bench_hps --only
rocksdb,redis,concurrency``): a session against the raw client on the same keys, and many
callers on one session.

- ``rocksdb``: session over RocksDB only vs raw ``rocksdict`` multi-get (+ decode).
- ``redis``: session over a local 3-node Redis cluster only vs raw pipelined redis-py ``HMGET``
  (+ decode) on the same keys and layout (the cluster from ``tests.hps.redis_local``).
- ``concurrency``: ``--callers`` threads calling one session for ``--seconds``: errors,
  lookups/s, p50/p99, peak RSS.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.hps.zipf_keys import Zipf, side_by_side
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend, decode_rows, encode_keys
from hps.storage.redis_cluster import RedisClusterBackend, partition_name
from hps.storage.volatile import HashMapBackend, split_by_partition

log = logging.getLogger("bench_hps")


def bench_rocksdb(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    n, dim = args.db_rows, args.dim
    W = np.random.default_rng(3).standard_normal((n, dim)).astype(np.float32)
    pdb = RocksDBBackend(workdir / "rocks")
    pdb.create_table("t", dim)
    t0 = time.perf_counter()
    pdb.bulk_load("t", np.arange(n, dtype=np.int64), W)
    load_s = time.perf_counter() - t0
    z = Zipf(n, 1.05, seed=4)
    q = z.sample(args.batch)
    cf = pdb._cf["t"]

    def raw(keys: np.ndarray) -> np.ndarray:
        res = cf.get(encode_keys(keys))
        return decode_rows(res, dim, "raw")[0]

    sess = LookupSession(
        [SessionTable("t", dim, 0.0, 10**7, None)], None, pdb, record_key_stats=False
    )
    qt = torch.from_numpy(q)
    ok = np.array_equal(sess.lookup("t", qt).numpy(), raw(q))
    uq = np.unique(q)
    tt = side_by_side(
        {
            "raw": lambda: raw(q),
            "ours": lambda: sess.lookup("t", qt),
            "raw_u": lambda: raw(uq),
            "ours_u": lambda: sess.lookup("t", torch.from_numpy(uq)),
            "raw_nodecode": lambda: cf.get(encode_keys(q)),
        },
        args.repeats,
    )
    t_raw, t_ours, t_raw_u, t_ours_u, t_raw_nodecode = (
        tt[k] for k in ("raw", "ours", "raw_u", "ours_u", "raw_nodecode")
    )
    sess.close()
    pdb.close()
    row = {
        "bench": "rocksdb",
        "rows": n,
        "dim": dim,
        "batch": args.batch,
        "unique_keys": int(uq.size),
        "load_s": load_s,
        "session_keys_per_s": args.batch / t_ours,
        "raw_multiget_keys_per_s": args.batch / t_raw,
        "raw_multiget_no_decode_keys_per_s": args.batch / t_raw_nodecode,
        "ratio_vs_raw_same_keys": t_raw / t_ours,
        "ratio_vs_raw_unique_keys_both": t_raw_u / t_ours_u,
        "rows_equal": ok,
    }
    log.info(
        "rocksdb: session ×%.2f of raw multi-get (same keys), ×%.2f (unique keys both)",
        row["ratio_vs_raw_same_keys"],
        row["ratio_vs_raw_unique_keys_both"],
    )
    return [row]


def bench_redis(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    from tests.hps.redis_local import LocalRedisCluster, redis_available  # a test fixture

    if not redis_available():
        log.error("redis-server not installed: redis section skipped")
        return [{"bench": "redis", "skipped": "redis-server not installed"}]
    n, dim, parts = args.db_rows, args.dim, 8
    W = np.random.default_rng(5).standard_normal((n, dim)).astype(np.float32)
    with LocalRedisCluster(3, workdir / "redis") as rc:
        vdb = RedisClusterBackend(rc.addresses, num_partitions=parts, socket_timeout_s=30.0)
        vdb.create_table("t", dim)
        t0 = time.perf_counter()
        for s in range(0, n, 65536):
            vdb.insert("t", np.arange(s, min(s + 65536, n), dtype=np.int64), W[s : s + 65536])
        vdb.mark_loaded("t")  # every row is in: reads answer "not found" (not "failed")
        load_s = time.perf_counter() - t0
        client = vdb._client
        q = Zipf(n, 1.05, seed=6).sample(args.batch)

        def raw(keys: np.ndarray) -> np.ndarray:
            """What a user writes by hand: one pipelined HMGET per partition, decode."""
            pipe = client.pipeline()
            groups = split_by_partition(keys, parts)
            for p, idx in groups:
                pipe.hmget(partition_name("t", p), encode_keys(keys[idx]))
            out = np.empty((keys.size, dim), np.float32)
            for (_, idx), res in zip(groups, pipe.execute()):
                out[idx] = decode_rows(res, dim, "raw")[0]
            return out

        sess = LookupSession(
            [SessionTable("t", dim, 0.0, 10**7, None)], vdb, None, record_key_stats=False
        )
        qt = torch.from_numpy(q)
        ok = np.array_equal(sess.lookup("t", qt).numpy(), raw(q))
        uq = np.unique(q)
        tt = side_by_side(
            {
                "raw": lambda: raw(q),
                "ours": lambda: sess.lookup("t", qt),
                "raw_u": lambda: raw(uq),
                "ours_u": lambda: sess.lookup("t", torch.from_numpy(uq)),
            },
            args.repeats,
        )
        t_raw, t_ours, t_raw_u, t_ours_u = (tt[k] for k in ("raw", "ours", "raw_u", "ours_u"))
        sess.close()
        vdb.close()
    row = {
        "bench": "redis",
        "nodes": 3,
        "rows": n,
        "dim": dim,
        "batch": args.batch,
        "unique_keys": int(uq.size),
        "load_s": load_s,
        "session_keys_per_s": args.batch / t_ours,
        "raw_pipelined_keys_per_s": args.batch / t_raw,
        "ratio_vs_raw_same_keys": t_raw / t_ours,
        "ratio_vs_raw_unique_keys_both": t_raw_u / t_ours_u,
        "rows_equal": ok,
    }
    log.info(
        "redis: session ×%.2f of raw pipelined HMGET (same keys), ×%.2f (unique keys both)",
        row["ratio_vs_raw_same_keys"],
        row["ratio_vs_raw_unique_keys_both"],
    )
    return [row]


class _CallerLoad:
    """``callers`` threads calling one session with Zipf batches until stopped; counts
    lookups and errors, spot-checks rows against the table, samples the peak RSS."""

    def __init__(self, sess: LookupSession, table: np.ndarray, callers: int, batch: int) -> None:
        import psutil

        self.sess, self.table, self.batch = sess, torch.from_numpy(table), batch
        self.proc = psutil.Process()
        self.rss_start = self.proc.memory_info().rss
        self.rss_peak = self.rss_start
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = [0] * callers
        self.wrong_rows = 0

    def run(self, seconds: float) -> float:
        """Call for ``seconds``; returns the wall time until every thread stopped."""
        threads = [threading.Thread(target=self._call, args=(i,)) for i in range(len(self.done))]
        threads.append(threading.Thread(target=self._sample_rss))
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(seconds)
        self.stop.set()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    def _call(self, i: int) -> None:
        z = Zipf(self.table.shape[0], 1.05, seed=100 + i)
        while not self.stop.is_set():
            try:
                q = torch.from_numpy(z.sample(self.batch))
                out = self.sess.lookup("t", q)
                if i == 0 and self.done[i] % 20 == 0:  # spot check: exact rows or the default
                    good = (out == self.table[q]).all(1) | (out == 0).all(1)
                    self.wrong_rows += int((~good).sum())
                self.done[i] += 1
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                self.errors.append(f"{type(e).__name__}: {e}")

    def _sample_rss(self) -> None:
        while not self.stop.is_set():
            self.rss_peak = max(self.rss_peak, self.proc.memory_info().rss)
            time.sleep(0.2)


def bench_concurrency(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    n, dim = args.db_rows, args.dim
    W = np.random.default_rng(7).standard_normal((n, dim)).astype(np.float32)
    keys = np.arange(n, dtype=np.int64)
    vdb = HashMapBackend(num_partitions=8)
    vdb.create_table("t", dim)
    vdb.insert("t", keys[: n // 2], W[: n // 2])
    pdb = RocksDBBackend(workdir / "rocks_conc")
    pdb.create_table("t", dim)
    pdb.bulk_load("t", keys, W)
    cache = EmbeddingCache(n // 10, dim)
    sess = LookupSession(
        [SessionTable("t", dim, 0.0, 10**6, cache)],
        vdb,
        pdb,
        hit_rate_threshold=0.9,
        max_concurrent=4,
    )
    load = _CallerLoad(sess, W, args.callers, args.concurrent_batch)
    wall = load.run(args.seconds)
    st: dict[str, Any] = sess.stats("t")
    sess.close()
    pdb.close()
    lookups = sum(load.done)
    row = {
        "bench": "concurrency",
        "callers": args.callers,
        "seconds": wall,
        "batch": args.concurrent_batch,
        "rows": n,
        "dim": dim,
        "max_concurrent": 4,
        "lookups": lookups,
        "errors": len(load.errors),
        "error_examples": load.errors[:3],
        "wrong_rows_spot_check": load.wrong_rows,
        "lookups_per_s": lookups / wall,
        "keys_per_s": lookups * args.concurrent_batch / wall,
        "latency_p50_ms": st["latency_p50_ms"],
        "latency_p99_ms": st["latency_p99_ms"],
        "hit_rate_all": st["hit_rate"]["all"],
        "rss_start_mib": load.rss_start / 2**20,
        "rss_peak_mib": load.rss_peak / 2**20,
        "rss_end_mib": load.proc.memory_info().rss / 2**20,
        "dropped_async": st["dropped_async"],
    }
    log.info(
        "concurrency: %d callers, %d lookups, %d errors, peak RSS %.0f MiB (start %.0f)",
        args.callers,
        row["lookups"],
        row["errors"],
        row["rss_peak_mib"],
        row["rss_start_mib"],
    )
    return [row]
