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

The database sections live in :mod:`benchmarks.hps.db_sections`, the drift in
:mod:`benchmarks.hps.drift_section`.

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
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.hps.db_sections import bench_concurrency, bench_redis, bench_rocksdb
from benchmarks.hps.drift_section import bench_drift, plot_drift
from benchmarks.hps.zipf_keys import Zipf, side_by_side
from benchmarks.meta import RESULTS_DIR, machine, write_json
from hps.advisor import zipf_hit_curve
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.volatile import HashMapBackend
from hps.types import CachePolicy

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
