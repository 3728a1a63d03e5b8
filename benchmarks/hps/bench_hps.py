"""HPS acceptance benchmarks, side by side in one run, JSON out.

    python -m benchmarks.hps.bench_hps                       # everything (~5 min on 2 cores)
    python -m benchmarks.hps.bench_hps --only hit_rate,rocksdb --rows 2000000

Sections (``--only``):
- ``hit_rate``: cache hit rate (over all keys and over each batch's unique keys) at 1/10/20%
  of a ``--rows``-row, dim-128 table under Zipf α = 1.05 and 1.2, LRU and LFU, streamed
  (sync fill) and warmed up from the hottest keys, against the ideal (hottest rows cached).
- ``cached``: session lookup throughput (keys/s, ``--batch`` Zipf keys) with a resident
  cache, and with a 10% cache over the in-process hash map, vs ``torch.index_select`` on the
  whole table in memory.
- ``rocksdb``: session over RocksDB only vs raw ``rocksdict`` multi-get (+ decode) on the same keys.
- ``redis``: session over a local 3-node Redis cluster only vs raw pipelined redis-py ``HMGET``
  (+ decode) on the same keys and layout.
- ``concurrency``: ``--callers`` threads calling one session for ``--seconds``: errors,
  lookups/s, p50/p99, peak RSS.
- ``drift``: popularity drift (~9 min). Zipf α = 1.05 over ``--rows`` keys, a 10% cache
  (``--drift-alpha``, ``--drift-cache-fraction``): ``--drift-before`` batches (120: the drift
  halfway; 480: a longer-lived server), then the popularity permuted (a new random key per
  rank) for ``--drift-batches`` (120), through a :class:`~hps.session.LookupSession`
  (synchronous fill, key statistics on: the admission priorities users get). LRU, LFU never
  aging and LFU aging every ``--drift-decays`` looked-up keys per slot; hit rate before the
  drift (its second half: the steady state), after it, and over its last quarter, against the
  ideal (the new distribution's hottest rows; the curve is the same). Figure: ``hps_drift.png``.

``--merge`` keeps the rows of the sections not run from the existing ``--out`` file (each
section's machine, date and arguments stay in ``section_meta``), so one section can be
re-run without losing the others:
``python -m benchmarks.hps.bench_hps --only drift --merge``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.meta import RESULTS_DIR, machine, write_json
from hps.advisor import zipf_hit_curve
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend, decode_rows, encode_keys
from hps.storage.volatile import HashMapBackend, split_by_partition
from hps.types import CachePolicy, StorageBackend

log = logging.getLogger("bench_hps")
SECTIONS = ("hit_rate", "cached", "rocksdb", "redis", "concurrency", "drift")
#: a row's "bench" → the section that writes it
SECTION_OF = {
    "hit_rate": "hit_rate",
    "cached_lookup": "cached",
    "rocksdb": "rocksdb",
    "redis": "redis",
    "concurrency": "concurrency",
    "drift": "drift",
}


class Zipf:
    """Zipf(α) over ``n`` rows; rank r → key ``perm[r]`` (hot keys are not 0, 1, 2, ...)."""

    def __init__(self, n: int, alpha: float, seed: int = 0) -> None:
        p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(p / p.sum())
        self.perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
        self.rng = np.random.default_rng(seed + 1)

    def sample(self, k: int) -> np.ndarray:
        r = np.minimum(np.searchsorted(self.cdf, self.rng.random(k)), self.cdf.size - 1)
        return self.perm[r]

    def hottest(self, k: int) -> np.ndarray:
        return self.perm[:k]


def side_by_side(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved (A B C A B C ...) so that
    the load of a shared machine hits every contender alike."""
    for fn in fns.values():
        fn()  # warm
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in ts.items()}


# ------------------------------------------------------------------------------ hit rate


def bench_hit_rate(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    dim = args.dim
    for alpha in (1.05, 1.2):
        z = Zipf(args.rows, alpha, seed=1)
        batches = [z.sample(args.batch) for _ in range(args.warm_batches + args.measure_batches)]
        for frac in (0.01, 0.10, 0.20):
            cap = int(frac * args.rows)
            ideal = float(zipf_hit_curve(args.rows, alpha, np.array([cap]))[0])
            for policy, warm in (
                (CachePolicy.LRU, False),
                (CachePolicy.LFU, False),
                (CachePolicy.LFU, True),
            ):
                cache = EmbeddingCache(cap, dim, policy=policy)
                if warm:  # warm-up from the hottest keys, hottest first (LookupSession.warm_up)
                    hot = torch.from_numpy(z.hottest(cap).copy())
                    for chunk in hot.split(262144):
                        cache.insert(chunk, torch.zeros(chunk.numel(), dim))
                hits_all = keys_all = hits_u = keys_u = 0
                t0 = time.perf_counter()
                for i, b in enumerate(batches):
                    u, counts = torch.unique(torch.from_numpy(b), return_counts=True)
                    _, hit = cache.query(u, counts=counts)  # as LookupSession does (it also adds
                    # each key's count in earlier requests to the admission priority; not here)
                    miss = u[~hit]
                    cache.insert(
                        miss, torch.zeros(miss.numel(), dim), priority=counts[~hit]
                    )  # sync fill
                    if i >= args.warm_batches:
                        hits_all += int(counts[hit].sum())
                        keys_all += int(counts.sum())
                        hits_u += int(hit.sum())
                        keys_u += int(u.numel())
                row = {
                    "bench": "hit_rate",
                    "alpha": alpha,
                    "rows": args.rows,
                    "dim": dim,
                    "cache_fraction": frac,
                    "policy": policy.value,
                    "warm_up_hottest": warm,
                    "hit_rate_all_keys": hits_all / keys_all,
                    "hit_rate_unique_keys": hits_u / keys_u,
                    "ideal_hottest_rows": ideal,
                    "gap_to_ideal": ideal - hits_all / keys_all,
                    "overflowed_inserts": cache.stats.overflowed,
                    "batches_measured": args.measure_batches,
                    "seconds": time.perf_counter() - t0,
                }
                log.info(
                    "hit rate α=%.2f %4.0f%% %s%s: %.4f (ideal %.4f)",
                    alpha,
                    frac * 100,
                    policy.value,
                    "+warm" if warm else "",
                    row["hit_rate_all_keys"],
                    ideal,
                )
                rows.append(row)
                del cache
    return rows


# ------------------------------------------------------------------------------ cached path


def bench_cached(args: argparse.Namespace) -> list[dict[str, Any]]:
    n, dim = args.rows, args.dim
    W = torch.randn(n, dim)
    z = Zipf(n, 1.05, seed=2)
    qs = [torch.from_numpy(z.sample(args.batch)) for _ in range(8)]
    it = iter(range(10**9))

    def next_q() -> torch.Tensor:
        return qs[next(it) % len(qs)]

    out = []
    vdb = HashMapBackend(num_partitions=8)
    vdb.create_table("t", dim)
    keys = np.arange(n, dtype=np.int64)
    for s in range(0, n, 262144):
        vdb.insert("t", keys[s : s + 262144], W[s : s + 262144].numpy())
    for label, frac in (("resident_cache", 1.0), ("cache_10pct_over_hash_map", 0.10)):
        cache = EmbeddingCache(
            int(frac * n * (1.25 if frac == 1.0 else 1.0)), dim, policy=CachePolicy.LFU
        )
        sess = LookupSession(
            [SessionTable("t", dim, 0.0, 10**7, cache)],
            vdb,
            None,
            hit_rate_threshold=1.0,
            record_key_stats=False,
            max_concurrent=1,
        )
        for q in qs:  # fill: every key of the query set gets a chance to be cached
            sess.lookup("t", q)
        ok = torch.equal(sess.lookup("t", qs[0]), torch.index_select(W, 0, qs[0]))
        before = sess.stats("t")["hits_all"]["cache"]
        tt = side_by_side(
            {
                "index_select": lambda: torch.index_select(W, 0, next_q()),
                "session": lambda s=sess: s.lookup("t", next_q()),
            },
            args.repeats,
        )
        base, t = tt["index_select"], tt["session"]
        st = sess.stats("t")
        hit = (st["hits_all"]["cache"] - before) / max(1, (args.repeats + 1) * args.batch)
        out.append(
            {
                "bench": "cached_lookup",
                "config": label,
                "rows": n,
                "dim": dim,
                "batch": args.batch,
                "alpha": 1.05,
                "session_keys_per_s": args.batch / t,
                "index_select_keys_per_s": args.batch / base,
                "ratio_vs_index_select": base / t,
                "cache_hit_rate_all_keys": hit,
                "rows_equal": ok,
            }
        )
        log.info(
            "cached %s: %.2fM keys/s vs index_select %.2fM keys/s (×%.2f)",
            label,
            args.batch / t / 1e6,
            args.batch / base / 1e6,
            base / t,
        )
        sess.close()
        del cache, sess
    return out


# ------------------------------------------------------------------------------ RocksDB path


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


# ------------------------------------------------------------------------------ Redis path


def bench_redis(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    from hps.storage.redis_cluster import RedisClusterBackend, partition_name
    from tests.hps.redis_local import LocalRedisCluster, redis_available

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


# ------------------------------------------------------------------------------ concurrency


def bench_concurrency(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    import psutil

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
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    peak = [rss0]
    stop = threading.Event()
    errors: list[str] = []
    done = [0] * args.callers
    wrong = [0]

    def caller(i: int) -> None:
        z = Zipf(n, 1.05, seed=100 + i)
        while not stop.is_set():
            try:
                q = torch.from_numpy(z.sample(args.concurrent_batch))
                out = sess.lookup("t", q)
                if (
                    i == 0 and done[i] % 20 == 0
                ):  # spot check against the table (exact rows or default)
                    ref = torch.from_numpy(W)[q]
                    good = (out == ref).all(1) | (out == 0).all(1)
                    wrong[0] += int((~good).sum())
                done[i] += 1
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{type(e).__name__}: {e}")

    def sampler() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.2)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(args.callers)]
    ts = threading.Thread(target=sampler)
    t0 = time.perf_counter()
    for t in [*threads, ts]:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in [*threads, ts]:
        t.join()
    wall = time.perf_counter() - t0
    st = sess.stats("t")
    sess.close()
    pdb.close()
    row = {
        "bench": "concurrency",
        "callers": args.callers,
        "seconds": wall,
        "batch": args.concurrent_batch,
        "rows": n,
        "dim": dim,
        "max_concurrent": 4,
        "lookups": int(sum(done)),
        "errors": len(errors),
        "error_examples": errors[:3],
        "wrong_rows_spot_check": wrong[0],
        "lookups_per_s": sum(done) / wall,
        "keys_per_s": sum(done) * args.concurrent_batch / wall,
        "latency_p50_ms": st["latency_p50_ms"],
        "latency_p99_ms": st["latency_p99_ms"],
        "hit_rate_all": st["hit_rate"]["all"],
        "rss_start_mib": rss0 / 2**20,
        "rss_peak_mib": peak[0] / 2**20,
        "rss_end_mib": proc.memory_info().rss / 2**20,
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


# ------------------------------------------------------------------------------ drift


class ZeroRows(StorageBackend):
    """A database holding every key in ``[0, n)`` with a zero row (hit rates need no values)."""

    name = "zero_rows"

    def __init__(self, n: int, dim: int) -> None:
        self.n, self.dim = n, dim

    def create_table(self, table: str, dim: int) -> None:
        pass

    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((keys.size, self.dim), np.float32), (keys >= 0) & (keys < self.n)

    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        raise ValueError(
            f"{self.name}: a read-only stand-in database; insert into {table!r} refused"
        )

    def size(self, table: str) -> int:
        return self.n


def bench_drift(args: argparse.Namespace) -> list[dict[str, Any]]:
    n, dim, alpha, frac, nb = (
        args.rows,
        args.dim,
        args.drift_alpha,
        args.drift_cache_fraction,
        args.drift_batches,
    )
    cap = int(frac * n)
    ideal = float(zipf_hit_curve(n, alpha, np.array([cap]))[0])
    configs = [(CachePolicy.LRU, 0.0), (CachePolicy.LFU, 0.0)]
    configs += [(CachePolicy.LFU, float(x)) for x in args.drift_decays.split(",") if x.strip()]
    out = []
    for n0 in (int(x) for x in args.drift_before.split(",") if x.strip()):
        for policy, per_slot in configs:
            # the same key stream for every config: same curve before and after, a new key per rank
            before, after = Zipf(n, alpha, seed=8), Zipf(n, alpha, seed=9)
            cache = EmbeddingCache(cap, dim, policy=policy, lfu_decay_keys_per_slot=per_slot)
            sess = LookupSession(
                [SessionTable("t", dim, 0.0, 10**7, cache)],
                ZeroRows(n, dim),
                None,
                hit_rate_threshold=1.0,
                max_concurrent=1,
            )  # sync fill, key statistics on
            series = []
            hits = 0
            t0 = time.perf_counter()
            for i in range(n0 + nb):
                b = (before if i < n0 else after).sample(args.batch)
                sess.lookup("t", torch.from_numpy(b))
                now = sess.stats("t")["hits_all"]["cache"]
                series.append((now - hits) / b.size)
                hits = now
            cached = cache.cached_keys().numpy()
            sess.close()
            old_hot, new_hot = before.hottest(cap), after.hottest(cap)
            label = (
                policy.value
                if policy is CachePolicy.LRU
                else (
                    f"lfu, aging every {per_slot:g} keys/slot" if per_slot else "lfu, never aging"
                )
            )
            row = {
                "bench": "drift",
                "config": label,
                "policy": policy.value,
                "lfu_decay_keys_per_slot": per_slot,
                "lfu_decay_interval_keys": cache.lfu_decay_interval,
                "decays": cache.stats.decays,
                "alpha": alpha,
                "rows": n,
                "dim": dim,
                "cache_fraction": frac,
                "batch": args.batch,
                "batches_before_drift": n0,
                "batches_after_drift": nb,
                "hit_rate_before_drift": float(np.mean(series[n0 // 2 : n0])),  # steady state
                "hit_rate_after_drift": float(np.mean(series[n0:])),
                "hit_rate_after_drift_last_quarter": float(np.mean(series[-max(1, nb // 4) :])),
                "ideal_hottest_rows": ideal,
                "cached_new_hot_fraction": float(np.isin(cached, new_hot).sum() / cap),
                "cached_stale_old_hot": int(np.isin(cached, np.setdiff1d(old_hot, new_hot)).sum()),
                "hit_rate_per_batch": [round(x, 4) for x in series],
                "seconds": time.perf_counter() - t0,
            }
            log.info(
                "drift after %d: %-30s before %.4f  after %.4f  last quarter %.4f  (ideal %.4f)",
                n0,
                label,
                row["hit_rate_before_drift"],
                row["hit_rate_after_drift"],
                row["hit_rate_after_drift_last_quarter"],
                ideal,
            )
            out.append(row)
            del cache, sess
    return out


def plot_drift(rows: list[dict[str, Any]], path: Path) -> None:
    """Hit rate per batch, one panel per drift point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted({r["batches_before_drift"] for r in rows})
    fig, axes = plt.subplots(len(points), 1, figsize=(7, 3.2 * len(points)), squeeze=False)
    for ax, n0 in zip(axes[:, 0], points):
        sel = [r for r in rows if r["batches_before_drift"] == n0]
        for r in sel:
            ys = r["hit_rate_per_batch"]
            ax.plot(np.arange(1, len(ys) + 1), ys, label=r["config"], lw=0.8)
        r = sel[0]
        ax.axhline(r["ideal_hottest_rows"], color="k", ls="--", lw=1, label="ideal (hottest rows)")
        ax.axvline(n0 + 0.5, color="grey", ls=":", lw=1)
        ax.set_xlabel(f"batch of {r['batch']} keys (popularity permuted after batch {n0})")
        ax.set_ylabel("hit rate (all keys)")
        low = min(
            float(np.percentile(r["hit_rate_per_batch"], 2)) for r in sel
        )  # the drop itself clipped
        ax.set_ylim(np.floor(low * 20) / 20, 1.0)
        ax.set_title(
            f"Zipf α={r['alpha']}, {r['rows']:,} rows, {r['cache_fraction']:.0%} cache", fontsize=9
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def merge_previous(
    path: Path, rows: list[dict[str, Any]], only: list[str], section_meta: dict[str, Any]
) -> list[dict[str, Any]]:
    """``rows`` plus the rows of the sections not in ``only`` from the JSON at ``path``, in
    section order; ``section_meta`` gains the kept sections' meta (their own, or the file's)."""
    if not path.exists():
        return rows
    old = json.loads(path.read_text())
    kept = [r for r in old["rows"] if SECTION_OF.get(r.get("bench")) not in only]
    for r in kept:
        sec = SECTION_OF.get(r.get("bench"), str(r.get("bench")))
        section_meta.setdefault(
            sec,
            old.get("section_meta", {}).get(
                sec, {**old["meta"], "args": old.get("args"), "load": old.get("load")}
            ),
        )
    order = {s: i for i, s in enumerate(SECTIONS)}
    return sorted(
        kept + rows, key=lambda r: order.get(SECTION_OF.get(r.get("bench"), ""), len(order))
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for alpha in (1.05, 1.2):
        sel = [r for r in rows if r.get("bench") == "hit_rate" and r["alpha"] == alpha]
        if not sel:
            continue
        fr = sorted({r["cache_fraction"] for r in sel})
        ax.plot(
            fr,
            [next(r["ideal_hottest_rows"] for r in sel if r["cache_fraction"] == f) for f in fr],
            "k--",
            label=f"ideal α={alpha}",
        )
        for pol, warm, mk in (("lru", False, "o"), ("lfu", False, "s"), ("lfu", True, "^")):
            ys = [
                next(
                    r["hit_rate_all_keys"]
                    for r in sel
                    if r["cache_fraction"] == f
                    and r["policy"] == pol
                    and r["warm_up_hottest"] == warm
                )
                for f in fr
            ]
            ax.plot(fr, ys, marker=mk, label=f"{pol}{'+warm' if warm else ''} α={alpha}")
    ax.set_xlabel("cache size (fraction of rows)")
    ax.set_ylabel("hit rate (all keys)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument(
        "--rows", type=int, default=2_000_000, help="rows of the hit-rate / cached-path table"
    )
    ap.add_argument("--db-rows", type=int, default=500_000, help="rows loaded into RocksDB / Redis")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--warm-batches", type=int, default=40)
    ap.add_argument("--measure-batches", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--callers", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrent-batch", type=int, default=4096)
    ap.add_argument(
        "--drift-before", default="120,480", help="batches before the drift, one run each"
    )
    ap.add_argument("--drift-batches", type=int, default=120, help="batches after the drift")
    ap.add_argument("--drift-alpha", type=float, default=1.05)
    ap.add_argument("--drift-cache-fraction", type=float, default=0.10)
    ap.add_argument(
        "--drift-decays",
        default="10,20,50",
        help="LFU aging periods to run, looked-up keys per slot",
    )
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "hps.json")
    ap.add_argument("--merge", action="store_true", help="keep the other sections' rows of --out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {SECTIONS}")
    workdir = Path(tempfile.mkdtemp(prefix="bench_hps_"))
    rows: list[dict[str, Any]] = []
    load = {"loadavg_before": os.getloadavg()}
    try:
        for section in only:
            t0 = time.perf_counter()
            if section == "hit_rate":
                rows += bench_hit_rate(args)
            elif section == "cached":
                rows += bench_cached(args)
            elif section == "rocksdb":
                rows += bench_rocksdb(args, workdir)
            elif section == "redis":
                rows += bench_redis(args, workdir)
            elif section == "drift":
                rows += bench_drift(args)
            else:
                rows += bench_concurrency(args, workdir)
            log.info(
                "section %s took %.1f s (load %.2f)",
                section,
                time.perf_counter() - t0,
                os.getloadavg()[0],
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load["loadavg_after"] = os.getloadavg()
    run_args = {k: str(v) for k, v in vars(args).items()}
    section_meta = {s: {**machine(), "args": run_args, "load": load} for s in only}
    if args.merge:
        rows = merge_previous(args.out, rows, only, section_meta)
    path = write_json(args.out, rows, args=run_args, load=load, section_meta=section_meta)
    if any(r.get("bench") == "hit_rate" for r in rows):
        plot(rows, path.with_suffix(".png"))
    drift = [r for r in rows if r.get("bench") == "drift"]
    if drift:
        plot_drift(drift, path.with_name(path.stem + "_drift.png"))
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
