"""Quantized rows in the HPS tiers: hit rate of caches of equal bytes holding FP32, FP16, INT8
and INT4 rows (Zipf keys, the cache at a fraction of the FP32 table's bytes), the bytes
each tier holds per row, and the cache-hit lookup throughput of INT8 rows against FP32 rows.

    python -m benchmarks.hps.bench_quantized            # 1 M rows × 128, cache 10 %
    python -m benchmarks.hps.bench_quantized --quick    # 100 k rows (a smoke run)
    python -m benchmarks.hps.bench_quantized --only throughput --repeats 40

``bytes``: per dtype and key set (dense ``0..n-1``; sparse in ``[0, 2**32)``; int64 keys of
16 high words, 8 tables' ids offset by ``table << 40``; 64-bit hashes), the hash map's bytes per
row after one load (and its key layout) and a full cache's bytes per slot (and how it holds
its keys).

``throughput``: two sessions in one process, one whose cache holds the table's rows as FP32
and one as INT8 (every row resident: the cache-hit path), look up the same 65,536 Zipf(α) keys
with :meth:`~hps.session.LookupSession.lookup_many` into a reused output buffer, calls
interleaved (FP32, INT8, FP32, ...); rows/s from the median call, wall-clock with the
machine's threads and CPU time of the calling thread with one thread (``cpu1_``), beside the
load average.

Every cache gets the same byte budget (``cache_fraction`` × the FP32 table's rows × 512 B) and
as many slots as fit: a slot costs its row (``hps.rowformat.row_bytes``) plus 6.125 B of int32
low word, counter byte, tag byte and homed bit (``EmbeddingCache.nbytes``; 6.625 B with up to
16 high words, 10.125 B with int64 keys). The same key stream
(Zipf ``alpha``, a fixed seed) is looked up through a :class:`~hps.session.LookupSession`
(misses filled synchronously, LFU) against a stand-in database of zero rows (a hit rate needs
no values); the first ``warm`` batches warm the cache and are not counted.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import numpy as np
import torch

from benchmarks.hps.bench_lookup import _kept_sections
from benchmarks.hps.drift_section import ZeroRows
from benchmarks.hps.lookup_throughput import bench_throughput
from benchmarks.hps.zipf_keys import Zipf
from benchmarks.meta import RESULTS_DIR, write_json
from hps.rowformat import RowDtype, row_bytes
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.volatile import HashMapBackend
from hps.types import CachePolicy

log = logging.getLogger("bench_quantized")

DTYPES = (RowDtype.FP32, RowDtype.FP16, RowDtype.INT8, RowDtype.INT4)


def _slot_bytes(dtype: RowDtype, dim: int, compact_keys: bool = True) -> float:
    c = EmbeddingCache(64, dim, ways=64, row_format=dtype, compact_keys=compact_keys)
    return c.nbytes() / c.capacity


def bench_hit_rates(args: argparse.Namespace) -> list[dict[str, Any]]:
    n, dim = args.rows, args.dim
    budget = int(args.cache_fraction * n * row_bytes(RowDtype.FP32, dim))
    out = []
    for dt in DTYPES:
        slot = _slot_bytes(dt, dim)
        cap = int(budget // slot)
        cache = EmbeddingCache(cap, dim, policy=CachePolicy.LFU, row_format=dt)
        s = LookupSession(
            [SessionTable("t", dim, 0.0, 1 << 22, cache)],
            ZeroRows(n, dim),
            None,
            hit_rate_threshold=1.0,  # every miss filled now: the hit rate is the cache's alone
            record_key_stats=False,
        )
        z = Zipf(n, args.alpha, seed=0)
        for _ in range(args.warm):
            s.lookup("t", torch.from_numpy(z.sample(args.batch)))
        q0, h0 = cache.stats.queries, cache.stats.hits
        for _ in range(args.batches):
            s.lookup("t", torch.from_numpy(z.sample(args.batch)))
        q, h = cache.stats.queries - q0, cache.stats.hits - h0
        s.close()
        out.append(
            {
                "section": "hit_rate",
                "dtype": dt.value,
                "rows": n,
                "dim": dim,
                "alpha": args.alpha,
                "budget_bytes": budget,
                "slot_bytes": slot,
                "cache_bytes": cache.nbytes(),
                "cache_slots": cache.capacity,
                "cached_rows": len(cache),
                "unique_hit_rate": h / q,
            }
        )
        log.info("%s", out[-1])
    fp32 = out[0]
    for r in out:
        r["slots_vs_fp32"] = r["cache_slots"] / fp32["cache_slots"]
    return out


#: key sets of the bytes section: what the tiers' key indices are laid out by
KEY_SETS = ("dense", "sparse_u32", "int64_words", "int64_hashed")


def _keys(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct int64 keys: ``0..n-1``; spread over ``[0, 2**32)``; 8 tables' ids
    offset by ``table << 40``, some negative (16 high words); 64-bit hashes."""
    if kind == "dense":
        return np.arange(n, dtype=np.int64)
    if kind == "sparse_u32":
        k = np.unique(rng.integers(0, 2**32 - 1, size=2 * n))
    elif kind == "int64_words":
        ids = np.arange(n, dtype=np.int64)
        k = ((ids % 8) << 40) + ids // 8 - n // 32
    else:
        k = np.unique(rng.integers(-(2**63) + 1, 2**63 - 1, size=2 * n))
    return rng.permutation(k)[:n].astype(np.int64)


def _cache_slot_bytes(dtype: RowDtype, dim: int, keys: np.ndarray) -> tuple[float, str]:
    """Bytes per slot of a full cache of ``keys`` (its high words included), and how it holds
    its keys."""
    c = EmbeddingCache(keys.size, dim, ways=64, row_format=dtype)
    k = torch.from_numpy(keys)
    c.insert(k, torch.zeros(0, dim), rows=torch.zeros(keys.size, c.row_bytes, dtype=torch.uint8))
    how = (
        "int64"
        if c.slot_keys.keys.dtype == torch.int64
        else f"int32+{c.slot_keys.high_words.numel()}_words"
    )
    return c.nbytes() / c.capacity, how


def bench_bytes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Bytes per row held by the hash map alone (every row stored, no cache; one load) and by
    a full cache (per slot), for each dtype and key set, against FBGEMM's row
    (``row_bytes``)."""
    n, dim = min(args.rows, 100_000), args.dim
    cache_slots = 16_384
    out = []
    for kind in KEY_SETS:
        keys = _keys(kind, n, np.random.default_rng(0))
        for dt in DTYPES:
            rb = row_bytes(dt, dim)
            rows = np.random.default_rng(1).integers(0, 256, size=(n, rb), dtype=np.uint8)
            v = HashMapBackend(num_partitions=8)
            v.create_table("t", dim, row_format=dt)
            v.insert_rows("t", keys, rows)
            slot, how = _cache_slot_bytes(dt, dim, keys[:cache_slots])
            out.append(
                {
                    "section": "bytes",
                    "keys": kind,
                    "dtype": dt.value,
                    "rows": n,
                    "fbgemm_row_bytes": rb,
                    "hash_map_bytes_per_row": v.nbytes("t") / n,
                    "hash_map_layout": v.key_layout("t").value,
                    "hash_map_vs_fbgemm": v.nbytes("t") / n / rb,
                    "cache_slots": cache_slots,
                    "cache_bytes_per_slot": slot,
                    "cache_keys": how,
                    "cache_vs_fbgemm": slot / rb,
                }
            )
            log.info("%s", out[-1])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 k rows, fewer batches")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--cache-fraction", type=float, default=0.10, help="of the FP32 table's bytes")
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument(
        "--warm", type=int, default=50, help="batches before counting (fills the cache)"
    )
    ap.add_argument("--batches", type=int, default=10, help="batches counted")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per contender")
    ap.add_argument("--only", default="hit_rate,bytes,throughput")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.warm, args.batches, args.repeats = 100_000, 5, 5, 5
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sections = {"hit_rate": bench_hit_rates, "bytes": bench_bytes, "throughput": bench_throughput}
    rows: list[dict[str, Any]] = []
    for name in args.only.split(","):
        rows += sections[name](args)
    out = RESULTS_DIR / ("hps_quantized_quick.json" if args.quick else "hps_quantized.json")
    rows = _kept_sections(out, {r["section"] for r in rows}) + rows
    write_json(out, rows, threads=torch.get_num_threads())
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
