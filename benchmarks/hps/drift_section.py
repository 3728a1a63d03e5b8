"""The ``drift`` section of the HPS benchmarks (``python -m benchmarks.hps.bench_hps --only
drift``): hit rates through a popularity drift for LRU, LFU never aging and LFU aging, and
the figure ``hps_drift.png``."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.hps.zipf_keys import Zipf
from hps.advisor import zipf_hit_curve
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.types import CachePolicy, StorageBackend

log = logging.getLogger("bench_hps")


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
