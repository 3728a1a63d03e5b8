"""HPS lookups at the memory limit, side by side in one process (issue 27).

    PYTHONPATH=. python -m benchmarks.hps.bench_lookup [--quick] [--only single,tables,memory]

Contenders, the same keys and the same FP32 rows (all resident: cache-hit path):

- ``hps``: :meth:`LookupSession.lookup_many` (rows) / :meth:`LookupSession.lookup_pooled`
  (bags) into a reused output buffer; ``hps_per_table``: :meth:`LookupSession.lookup`, one
  call per table (the per-table path); ``hps_static`` (26 tables): the same calls over full
  static caches (:class:`hps.storage.cache.StaticEmbeddingCache`, one slot per row, as the
  parameter server builds a cache that covers its table);
- ``index_select``: ``torch.index_select(W, 0, keys, out=buf)`` into a reused buffer (26 tables:
  ONE call over the tables' rows stacked, keys offset per table);
- ``embedding_bag``: one ``F.embedding_bag`` (sum) over the stacked rows, offsets per bag;
- ``*_huge``: the same ``index_select`` / ``embedding_bag`` over a copy of the rows on
  transparent huge pages (:func:`hps.storage.host_memory.huge_zeros`, as our caches hold their
  arrays): the peer with the same memory advice. Where ``transparent_hugepage/enabled`` is
  ``madvise`` (this machine) a user's tensors get 4 KiB pages; where it is ``always`` they get
  huge pages too, and the ``*_huge`` ratios are the ones that machine sees.
  ``peer_huge_pages_mib`` says how much of the copies the kernel backed with huge pages;
- ``fbgemm_<dtype>``: FBGEMM's CPU inference TBE (``IntNBitTableBatchedEmbeddingBagsCodegen``)
  with FP32 / FP16 / INT8 / INT4 / INT2 weights; rows as bags of one key;
- ``hps_<dtype>`` (single table): :meth:`LookupSession.lookup_many` over a cache whose storage
  holds the same rows in that :class:`hps.rowformat.RowDtype` (FBGEMM's layout, dequantized
  by the fused pass), against ``fbgemm_<dtype>``: the same dtype on both sides;
- ``hps_pooled_lfu_sampled`` (26 tables): ``hps_pooled`` over caches that count the LFU
  uses of one lookup in ``LFU_SAMPLING`` (8), each hit of that lookup as 8 uses
  (``EmbeddingCache(lfu_sampling=8)``): the other lookups read and write no counter. Its
  median is such a lookup; one in eight costs what ``hps_pooled`` does.

Every section is timed twice: wall-clock with the machine's threads (the contenders
interleaved, ``side_by_side``), and CPU time of the calling thread with one thread
(``cpu1_*``, interleaved too), which a loaded shared machine disturbs far less. Before every
timed call twice the machine's largest CPU cache is written, at least 64 MiB
(:class:`~benchmarks.hps.zipf_keys.CacheEvictor`, untimed; ``evicted_mib`` in each row), so
each call starts with its rows and the process's own objects out of the CPU's caches: without
it a contender timed right after one that read the same rows (``hps_static_pooled`` after
``hps_static_rows``) found them in a 32 MiB last-level cache. On the same code, eviction
slowed ``hps_static_pooled`` by 6–9 % in CPU time of one thread, and FBGEMM and
``embedding_bag`` by 2–3 %. On a machine whose last-level cache is 480 MiB, 64 MiB left a
contender's rows and objects in it: the exact-LFU pooled call read 1.9 ms timed alone and
3.1 ms interleaved with FBGEMM's (FBGEMM 2.0 and 3.0 ms).

Sections: ``single`` one table of 1M × 128 with 65,536 Zipf(1.05) keys (rows); ``tables`` the 26
tables of ``dlrm_dcnv2`` ÷ 300, one batch of ~65 k keys (rows and pooled); ``memory`` the bytes
held per resident row in each tier when every row is in host RAM (cache + in-process hash map).
Writes ``benchmarks/results/hps_lookup.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.hps.zipf_keys import CacheEvictor, Zipf, side_by_side
from benchmarks.meta import RESULTS_DIR, write_json
from hps.kernels import load_extension
from hps.rowformat import RowDtype, quantize_rows
from hps.session import DEFAULT_KEY_STATS_SAMPLING, LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache, StaticEmbeddingCache, dense_key_bound
from hps.storage.host_memory import huge_zeros
from hps.storage.volatile import HashMapBackend
from hps.types import Pooling

log = logging.getLogger(__name__)

#: ``getrusage`` of the calling thread (Linux; elsewhere the process's)
RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)

DIM = 128
ALPHA = 1.05
DTYPES = ("fp32", "fp16", "int8", "int4", "int2")
#: ``hps_pooled_lfu_sampled``: its caches count the LFU uses of one lookup in this many
LFU_SAMPLING = 8


def _tbe(rows: list[int], dtype: str, weights: list[torch.Tensor], pooled: bool) -> Any:
    """FBGEMM's CPU inference TBE over ``rows`` tables of DIM, its weights from ``weights``
    (quantized row-wise for INT8/INT4/INT2, as FBGEMM stores them)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    st = {
        "fp32": SparseType.FP32,
        "fp16": SparseType.FP16,
        "int8": SparseType.INT8,
        "int4": SparseType.INT4,
        "int2": SparseType.INT2,
    }[dtype]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [(f"t{i}", n, DIM, st, EmbeddingLocation.HOST) for i, n in enumerate(rows)],
        device="cpu",
        pooling_mode=PoolingMode.SUM,
        output_dtype=SparseType.FP32,
    )
    tbe.initialize_weights()
    if dtype in ("fp32", "fp16"):
        for (w, _), src in zip(tbe.split_embedding_weights(), weights, strict=True):
            w.copy_(
                src.to(torch.float16 if dtype == "fp16" else torch.float32)
                .view(torch.uint8)
                .view(w.shape)
            )
    else:
        tbe.fill_random_weights()  # the speed of a quantized gather does not depend on values
    return tbe


def cpu_side_by_side(
    fns: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`side_by_side` in CPU seconds of the calling thread, with one torch thread; and
    the median minor page faults of that thread per call (a contender that allocates its
    result afresh faults its pages in each time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    faults: dict[str, float] = {}
    try:
        cpu = side_by_side(fns, repeats, before, faults, time.thread_time, RUSAGE_THREAD)
    finally:
        torch.set_num_threads(threads)
    return cpu, faults


def _timed(
    row: dict[str, Any], fns: dict[str, Callable[[], object]], repeats: int, evict_mib: int | None
) -> None:
    """Both timings of ``fns`` into ``row``: ``<name>_ms`` (wall, all threads) and
    ``cpu1_<name>_ms`` (CPU time, one thread; not for the slow per-table path), with the
    median minor page faults per call of each (``<name>_faults``: the process's;
    ``cpu1_<name>_faults``: the calling thread's) and ``evicted_mib``. A peer whose call
    faulted pages in was timed with the kernel's work in it: :func:`keep_freed_memory` spares
    it that in most runs, not in all (the heap's layout decides)."""
    evict = CacheEvictor(evict_mib)
    row["evicted_mib"] = evict.mib
    wall_faults: dict[str, float] = {}
    wall = side_by_side(fns, repeats, evict, wall_faults)
    cpu, faults = cpu_side_by_side(
        {k: f for k, f in fns.items() if "per_table" not in k}, repeats, evict
    )
    row.update({f"{k}_ms": v * 1e3 for k, v in wall.items()})
    row.update({f"{k}_faults": v for k, v in wall_faults.items()})
    row.update({f"cpu1_{k}_ms": v * 1e3 for k, v in cpu.items()})
    row.update({f"cpu1_{k}_faults": v for k, v in faults.items()})


def keep_freed_memory() -> bool:
    """Ask glibc to serve every allocation below 1 GiB from its heap and never hand freed memory
    back (``mallopt``): a contender that allocates its result on each call (FBGEMM's TBE,
    ``embedding_bag``) then reuses the pages of its last one rather than faulting fresh ones
    in. With glibc's defaults each such call of the ``tables`` section faulted in ~1,000 pages,
    and after the cache eviction each fault took ~13 µs of kernel time (a 2-vCPU VM): 12-16 ms
    per call, on calls that take 3.5-7.5 ms of CPU without them. The peers are timed at their
    best; hps reuses its output buffer and allocates nothing per call either way. Returns
    whether glibc took both settings."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 31))


def _ratios(row: dict[str, Any], name: str, ours: str, theirs: str) -> None:
    """``theirs / ours`` (> 1: ours faster) for both timings."""
    row[name] = row[f"{theirs}_ms"] / row[f"{ours}_ms"]
    row[f"cpu1_{name}"] = row[f"cpu1_{theirs}_ms"] / row[f"cpu1_{ours}_ms"]


def anon_huge_mib() -> float:
    """MiB of this process's anonymous memory backed by transparent huge pages (0 where
    ``/proc/self/smaps`` is missing)."""
    try:
        with open("/proc/self/smaps") as f:
            kb = sum(int(x.split()[1]) for x in f if x.startswith("AnonHugePages:"))
    except OSError:
        return 0.0
    return kb / 1024


def on_huge_pages(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A copy of ``t`` on transparent huge pages (where the kernel grants them), and the MiB
    of huge pages it got."""
    before = anon_huge_mib()
    h = huge_zeros(tuple(t.shape), t.dtype, t.device)
    h.copy_(t)
    return h, anon_huge_mib() - before


def _store_as(cache: EmbeddingCache, dtype: RowDtype) -> torch.Tensor:
    """Re-store ``cache``'s rows as ``dtype`` (hps.rowformat's layout, ``row_format`` set),
    as a cache holding such rows keeps them; returns the FP32 storage to put back."""
    fp32 = cache.storage
    q = quantize_rows(cache.values, dtype)
    cache.storage, cache.row_bytes = q, q.shape[1]
    cache.row_format = dtype
    return fp32


def _restore(cache: EmbeddingCache, fp32: torch.Tensor) -> None:
    cache.storage, cache.row_bytes = fp32, fp32.shape[1]
    cache.row_format = RowDtype.FP32


def _resident_session(
    weights: list[torch.Tensor],
    names: list[str],
    max_keys: int,
    slack: float,
    key_stats_sampling: int = DEFAULT_KEY_STATS_SAMPLING,
    dense_index: bool = True,
    lfu_sampling: int = 1,
) -> LookupSession:
    """A session whose caches hold the rows of ``weights`` (capacity ``slack`` × rows: at 2 no
    64-way set overflows, at 1.25 a few percent of the rows stay out), in front of an empty
    volatile DB; its key statistics count the hits of one lookup in ``key_stats_sampling`` (per
    table). ``dense_index``: each cache keeps a dense key index of its table's keys ``0 ..
    rows - 1`` where :func:`~hps.storage.cache.dense_key_bound` grants one, as the parameter
    server builds it; ``False``: every key is hashed. ``lfu_sampling``: each LFU cache counts
    the uses of one lookup in that many (:class:`~hps.storage.cache.EmbeddingCache`)."""
    tables = []
    v = HashMapBackend(num_partitions=1)
    for name, w in zip(names, weights, strict=True):
        v.create_table(name, DIM)
        cap = max(64, int(w.shape[0] * slack))
        bound = dense_key_bound(int(w.shape[0]), cap, 4 * DIM) if dense_index else None
        c = EmbeddingCache(cap, DIM, policy="lfu", key_bound=bound, lfu_sampling=lfu_sampling)
        keys = torch.arange(w.shape[0])
        for s in range(0, keys.numel(), 1 << 18):
            c.insert(keys[s : s + (1 << 18)], w[s : s + (1 << 18)])
        tables.append(SessionTable(name, DIM, 0.0, max_keys, c))
    return LookupSession(
        tables, v, None, hit_rate_threshold=0.0, key_stats_sampling=key_stats_sampling
    )


def _static_session(weights: list[torch.Tensor], names: list[str], max_keys: int) -> LookupSession:
    """A session whose caches are static and full (one slot per row, keys 0..n-1: the
    IDENTITY layout, as the parameter server builds for a cache that covers its table), in
    front of an empty volatile DB."""
    tables = []
    v = HashMapBackend(num_partitions=1)
    for name, w in zip(names, weights, strict=True):
        v.create_table(name, DIM)
        keys = torch.arange(w.shape[0])
        c = StaticEmbeddingCache(keys, DIM, policy="lfu")
        c.insert(keys, w)
        assert c.full
        tables.append(SessionTable(name, DIM, 0.0, max_keys, c))
    return LookupSession(tables, v, None, hit_rate_threshold=0.0)


def bench_single(args: argparse.Namespace) -> list[dict[str, Any]]:
    n_rows = 100_000 if args.quick else 1_000_000
    n_keys = 65_536
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_rows, DIM, generator=g)
    s = _resident_session([w], ["t"], 1 << 20, slack=1.25)
    cache = s.tables["t"].cache
    assert cache is not None
    z = Zipf(n_rows, ALPHA, seed=1)
    q = torch.from_numpy(z.sample(2 * n_keys))
    q = q[cache.contains(q)][:n_keys].contiguous()
    assert q.numel() == n_keys, "too few resident keys"
    buf = torch.empty(n_keys * DIM)
    ibuf = torch.empty(n_keys, DIM)
    ref = w.index_select(0, q)
    got = s.lookup_many(["t"], [q], out=buf)[0]
    assert torch.equal(got, ref), "hps rows differ from index_select"
    w_huge, huge_mib = on_huge_pages(w)
    fns: dict[str, Any] = {
        "hps": lambda: s.lookup_many(["t"], [q], out=buf),
        "hps_per_table": lambda: s.lookup("t", q),
        "index_select": lambda: torch.index_select(w, 0, q, out=ibuf),
        "index_select_huge": lambda: torch.index_select(w_huge, 0, q, out=ibuf),
    }
    q32 = q.to(torch.int32)
    offs = torch.arange(n_keys + 1, dtype=torch.int32)
    tbes = {dt: _tbe([n_rows], dt, [w], pooled=False) for dt in DTYPES}
    fns["fbgemm_fp32"] = lambda: tbes["fp32"](q32, offs)
    row: dict[str, Any] = {
        "section": "single",
        "rows": n_rows,
        "keys": n_keys,
        "unique": int(q.unique().numel()),
        "peer_huge_pages_mib": huge_mib,
    }
    _timed(row, fns, args.repeats, args.evict_mib)
    _ratios(row, "hps_vs_index_select", "hps", "index_select")
    _ratios(row, "hps_vs_index_select_huge", "hps", "index_select_huge")
    _ratios(row, "hps_vs_fbgemm_fp32", "hps", "fbgemm_fp32")
    for dt in DTYPES[1:]:  # the same dtype on both sides
        fp32 = _store_as(cache, RowDtype(dt))
        try:
            s.lookup_many(["t"], [q], out=buf)
            pair = {
                f"hps_{dt}": lambda: s.lookup_many(["t"], [q], out=buf),
                f"fbgemm_{dt}": lambda tbe=tbes[dt]: tbe(q32, offs),
            }
            _timed(row, pair, args.repeats, args.evict_mib)
        finally:
            _restore(cache, fp32)
        _ratios(row, f"hps_vs_fbgemm_{dt}", f"hps_{dt}", f"fbgemm_{dt}")
    return [row]


def tables_setup(
    scale: int,
) -> tuple[list[str], list[torch.Tensor], list[int], int, list[torch.Tensor]]:
    """The ``tables`` section's data: ``dlrm_dcnv2`` ÷ ``scale``'s table names, their rows
    (``(rows, DIM)`` float32, seed 0), hotness, the batch (65,536 keys over all tables) and
    each table's Zipf(``ALPHA``) keys (``(batch, hotness)`` int64, seed 10 + table)."""
    from embark.models.workloads import get_workload

    wl = get_workload("dlrm_dcnv2").scaled(scale)
    rows = [t.num_rows for t in wl.tables]
    hot = [t.hotness for t in wl.tables]
    batch = 65_536 // sum(hot)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, DIM, generator=g) for n in rows]
    keys = [
        torch.from_numpy(Zipf(n, ALPHA, seed=10 + i).sample(batch * h)).view(batch, h)
        for i, (n, h) in enumerate(zip(rows, hot, strict=True))
    ]
    return [t.name for t in wl.tables], ws, hot, batch, keys


def bench_tables(args: argparse.Namespace) -> list[dict[str, Any]]:
    names, ws, hot, batch, keys = tables_setup(3000 if args.quick else 300)
    rows = [int(w.shape[0]) for w in ws]
    s = _resident_session(ws, names, 1 << 20, slack=2.0)
    s8 = _resident_session(ws, names, 1 << 20, slack=2.0, lfu_sampling=LFU_SAMPLING)
    st = _static_session(ws, names, 1 << 20)
    stacked = torch.cat(ws)
    base = torch.tensor([0, *np.cumsum(rows)[:-1].tolist()])
    # one fused index_select: every table's keys offset into the stacked rows, table after table
    flat = torch.cat([k.reshape(-1) + base[i] for i, k in enumerate(keys)])
    # one fused embedding_bag: bags sample-major (b, t), the bag of table t of sample b
    bag_keys = torch.cat([keys[i] + base[i] for i in range(len(keys))], dim=1)  # (B, Σ h)
    bag_ids = torch.cat([k.reshape(-1) + base[i] for i, k in enumerate(keys)])
    bag_offsets = torch.tensor(
        [0, *np.cumsum([h for h in hot for _ in range(batch)])[:-1].tolist()]
    )
    n_keys = int(flat.numel())
    rbuf = torch.empty(n_keys * DIM)
    ibuf = torch.empty(n_keys, DIM)
    pbuf = torch.empty(batch, DIM * len(names))
    pooling = [Pooling.SUM] * len(names)
    ref_rows = stacked.index_select(0, flat)
    got = torch.cat([r.reshape(-1, DIM) for r in s.lookup_many(names, keys, out=rbuf)])
    assert torch.equal(got, ref_rows), "hps rows differ from index_select"
    ref_bags = F.embedding_bag(bag_ids, stacked, bag_offsets, mode="sum").view(
        len(names), batch, DIM
    )
    got_bags = s.lookup_pooled(names, keys, pooling, out=pbuf).view(batch, len(names), DIM)
    torch.testing.assert_close(got_bags.transpose(0, 1), ref_bags, rtol=1e-5, atol=1e-4)
    pbuf8 = torch.empty_like(pbuf)
    got8 = s8.lookup_pooled(names, keys, pooling, out=pbuf8).view(batch, len(names), DIM)
    assert torch.equal(got8, got_bags), "bags with sampled LFU uses differ"
    sbuf = torch.empty(batch, DIM * len(names))
    srbuf = torch.empty(n_keys * DIM)
    got = torch.cat([r.reshape(-1, DIM) for r in st.lookup_many(names, keys, out=srbuf)])
    assert torch.equal(got, ref_rows), "hps rows over static caches differ from index_select"
    got_static = st.lookup_pooled(names, keys, pooling, out=sbuf).view(batch, len(names), DIM)
    assert torch.equal(got_static, got_bags), "static and set-associative bags differ"
    torch.testing.assert_close(got_static.transpose(0, 1), ref_bags, rtol=1e-5, atol=1e-4)
    del bag_keys
    stacked_huge, huge_mib = on_huge_pages(stacked)
    fns: dict[str, Any] = {
        "hps_rows": lambda: s.lookup_many(names, keys, out=rbuf),
        "index_select_rows": lambda: torch.index_select(stacked, 0, flat, out=ibuf),
        "index_select_rows_huge": lambda: torch.index_select(stacked_huge, 0, flat, out=ibuf),
        "hps_pooled": lambda: s.lookup_pooled(names, keys, pooling, out=pbuf),
        "hps_pooled_lfu_sampled": lambda: s8.lookup_pooled(names, keys, pooling, out=pbuf8),
        "embedding_bag_pooled": lambda: F.embedding_bag(bag_ids, stacked, bag_offsets, mode="sum"),
        "embedding_bag_pooled_huge": lambda: F.embedding_bag(
            bag_ids, stacked_huge, bag_offsets, mode="sum"
        ),
        "hps_static_rows": lambda: st.lookup_many(names, keys, out=srbuf),
        "hps_static_pooled": lambda: st.lookup_pooled(names, keys, pooling, out=sbuf),
        "hps_per_table_rows": lambda: [s.lookup(n, k) for n, k in zip(names, keys, strict=True)],
    }
    tbe_idx = torch.cat([k.reshape(-1) for k in keys]).to(torch.int32)
    tbe_off = torch.tensor(
        [0, *np.cumsum([h for h in hot for _ in range(batch)]).tolist()], dtype=torch.int32
    )
    for dt in DTYPES:
        tbe = _tbe(rows, dt, ws, pooled=True)
        fns[f"fbgemm_{dt}_pooled"] = lambda tbe=tbe: tbe(tbe_idx, tbe_off)
    row: dict[str, Any] = {
        "section": "tables",
        "tables": len(names),
        "batch": batch,
        "keys": n_keys,
        "rows_total": int(sum(rows)),
        "peer_huge_pages_mib": huge_mib,
    }
    _timed(row, fns, args.repeats, args.evict_mib)
    for ours, theirs in (
        ("hps_rows", "index_select_rows_huge"),
        ("hps_pooled", "embedding_bag_pooled_huge"),
        ("hps_static_rows", "index_select_rows_huge"),
        ("hps_static_pooled", "embedding_bag_pooled_huge"),
    ):
        _ratios(row, f"{ours}_vs_{theirs}", ours, theirs)
    _ratios(row, "hps_rows_vs_index_select", "hps_rows", "index_select_rows")
    _ratios(row, "hps_pooled_vs_embedding_bag", "hps_pooled", "embedding_bag_pooled")
    _ratios(row, "hps_pooled_vs_fbgemm_fp32", "hps_pooled", "fbgemm_fp32_pooled")
    _ratios(
        row, "hps_pooled_lfu_sampled_vs_fbgemm_fp32", "hps_pooled_lfu_sampled", "fbgemm_fp32_pooled"
    )
    _ratios(
        row,
        "hps_pooled_lfu_sampled_vs_embedding_bag",
        "hps_pooled_lfu_sampled",
        "embedding_bag_pooled",
    )
    row["lfu_sampling"] = LFU_SAMPLING
    _ratios(row, "hps_static_rows_vs_index_select", "hps_static_rows", "index_select_rows")
    _ratios(row, "hps_static_pooled_vs_embedding_bag", "hps_static_pooled", "embedding_bag_pooled")
    _ratios(row, "hps_static_pooled_vs_fbgemm_fp32", "hps_static_pooled", "fbgemm_fp32_pooled")
    return [row]


def bench_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    n_rows = 50_000 if args.quick else 200_000
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_rows, DIM, generator=g)
    keys = np.arange(n_rows, dtype=np.int64)
    v = HashMapBackend(num_partitions=8)
    v.create_table("t", DIM)
    for s in range(0, n_rows, 1 << 16):
        v.insert("t", keys[s : s + (1 << 16)], w[s : s + (1 << 16)].numpy())
    # with its dense key index and exclusive with the hash map, as the parameter server builds it
    c = EmbeddingCache(
        n_rows, DIM, policy="lfu", key_bound=dense_key_bound(n_rows, n_rows, 4 * DIM)
    )
    v.attach_cache("t", c)
    s = LookupSession([SessionTable("t", DIM, 0.0, 1 << 20, c)], v, None, hit_rate_threshold=1.0)
    s.warm_up("t", keys)
    held = len(c)
    vb, cb = v.nbytes("t"), c.nbytes()
    return [
        {
            "section": "memory",
            "rows": n_rows,
            "row_bytes": 4 * DIM,
            "cache_rows": held,
            "volatile_rows": v.stored_rows("t"),
            "volatile_bytes_per_row": vb / n_rows,
            "cache_bytes_per_row": cb / n_rows,
            "total_bytes_per_row": (vb + cb) / n_rows,
            "target_bytes_per_row": 1.15 * 4 * DIM,
        }
    ]


def _kept_sections(out: Path, rerun: set[str]) -> list[dict[str, Any]]:
    """Rows of ``out`` from sections not run this time (``--only``), each marked with the
    ``git_sha`` of the run that measured it, so a partial run never drops the others."""
    if not out.exists():
        return []
    doc = json.loads(out.read_text())
    sha = doc.get("meta", {}).get("git_sha")
    kept = [r for r in doc.get("rows", []) if r.get("section") not in rerun]
    return [{**r, "measured_at": r.get("measured_at", sha)} for r in kept]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small tables (a smoke run)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--only", default="single,tables,memory")
    ap.add_argument("--out", type=Path, default=None, help="JSON to write (default: results/)")
    ap.add_argument(
        "--evict-mib",
        type=int,
        default=None,
        help="MiB written before each timed call (default: twice the largest CPU cache, >= 64)",
    )
    ap.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="leave glibc's malloc as it is (peers then fault their results in on each call)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kept = False if args.glibc_defaults else keep_freed_memory()
    if load_extension() is None:
        log.warning("the compiled kernel is not built: hps runs its reference path")
    sections = {"single": bench_single, "tables": bench_tables, "memory": bench_memory}
    rows: list[dict[str, Any]] = []
    for name in args.only.split(","):
        rows += sections[name](args)
        log.info("%s", rows[-1])
    out = args.out or RESULTS_DIR / ("hps_lookup_quick.json" if args.quick else "hps_lookup.json")
    for r in rows:  # this run's rows (those kept from an earlier run say their own)
        r["malloc_keeps_freed"] = kept
    rows = _kept_sections(out, {r["section"] for r in rows}) + rows
    write_json(out, rows, threads=torch.get_num_threads())
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
