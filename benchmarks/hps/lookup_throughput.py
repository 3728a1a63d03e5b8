"""Cache-hit lookup throughput of INT8 rows against FP32 rows, side by side in one process
(the ``throughput`` section of :mod:`benchmarks.hps.bench_quantized`).

One table of ``rows × dim`` float32 values; for each dtype a session whose cache holds every
row in that format (capacity 1.25 × rows, so no 64-way set overflows and every queried key is
resident) in front of an empty hash map. The same ``keys`` Zipf(α) keys, resident in both
caches, are looked up with :meth:`~hps.session.LookupSession.lookup_many` into one reused
output buffer, the dtypes' calls interleaved (A B A B ...) so a shared machine's load hits both
alike. Three timings: wall-clock with the machine's threads, wall-clock with one thread
(``wall1_``) and CPU time of the calling thread with one thread (``cpu1_``: what a loaded
shared machine disturbs least). Each result is checked first: FP32 rows equal the table's, INT8 rows equal
``dequantize_rows(quantize_rows(W))`` bit for bit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.hps.zipf_keys import Zipf
from hps.kernels import load_extension
from hps.rowformat import RowDtype, dequantize_rows, quantize_rows, row_bytes
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.volatile import HashMapBackend
from hps.types import CachePolicy

DTYPES = (RowDtype.FP32, RowDtype.INT8)
KEYS = 65_536
_INSERT_CHUNK = 1 << 18


def _resident(w: torch.Tensor, dtype: RowDtype) -> LookupSession:
    n, dim = w.shape
    v = HashMapBackend(num_partitions=1)
    v.create_table("t", dim, dtype)
    c = EmbeddingCache(int(n * 1.25), dim, policy=CachePolicy.LFU, row_format=dtype)
    keys = torch.arange(n)
    for s in range(0, n, _INSERT_CHUNK):
        c.insert(keys[s : s + _INSERT_CHUNK], w[s : s + _INSERT_CHUNK])
    return LookupSession(
        [SessionTable("t", dim, 0.0, 1 << 20, c)],
        v,
        None,
        hit_rate_threshold=0.0,
        record_key_stats=False,
    )


def _interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Seconds of each call by ``clock``, calls interleaved, after one warm call each."""
    for fn in fns.values():
        fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            ts[k].append(clock() - t0)
    return ts


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def bench_throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    n, dim = args.rows, args.dim
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, dim, generator=g)
    sessions = {dt: _resident(w, dt) for dt in DTYPES}
    z = Zipf(n, args.alpha, seed=1)
    q = torch.from_numpy(z.sample(2 * KEYS))
    for s in sessions.values():
        cache = s.tables["t"].cache
        assert cache is not None
        q = q[cache.contains(q)]
    q = q[:KEYS].contiguous()
    assert q.numel() == KEYS, "too few resident keys"
    buf = torch.empty(KEYS * dim)
    expect = {
        RowDtype.FP32: w.index_select(0, q),
        RowDtype.INT8: dequantize_rows(
            quantize_rows(w.index_select(0, q), RowDtype.INT8), RowDtype.INT8, dim
        ),
    }
    for dt, s in sessions.items():
        got = s.lookup_many(["t"], [q], out=buf)[0]
        assert torch.equal(got, expect[dt]), f"{dt.value} rows differ from the reference"
    fns: dict[str, Callable[[], object]] = {
        dt.value: (lambda s=s: s.lookup_many(["t"], [q], out=buf)) for dt, s in sessions.items()
    }
    load_before, up_before = os.getloadavg(), _uptime()
    t0 = time.perf_counter()
    wall = _interleaved(fns, args.repeats, time.perf_counter)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wall1 = _interleaved(fns, args.repeats, time.perf_counter)
        cpu1 = _interleaved(fns, args.repeats, time.thread_time)
    finally:
        torch.set_num_threads(threads)
    row: dict[str, Any] = {
        "section": "throughput",
        "rows": n,
        "dim": dim,
        "alpha": args.alpha,
        "keys": KEYS,
        "unique": int(q.unique().numel()),
        "repeats": args.repeats,
        "compiled": load_extension() is not None,
        "threads": threads,
        "seconds": time.perf_counter() - t0,
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "uptime_before": up_before,
        "uptime_after": _uptime(),
    }
    for timing, ts in (("", wall), ("wall1_", wall1), ("cpu1_", cpu1)):
        for dt in DTYPES:
            t = np.asarray(ts[dt.value])
            row[f"{timing}{dt.value}_ms"] = float(np.median(t)) * 1e3
            row[f"{timing}{dt.value}_ms_q25_q75"] = [
                float(x) * 1e3 for x in np.quantile(t, [0.25, 0.75])
            ]
            row[f"{timing}{dt.value}_rows_per_s"] = KEYS / float(np.median(t))
            row[f"{timing}{dt.value}_stored_bytes_per_row"] = row_bytes(dt, dim)
        # > 1: INT8 looks up more rows per second than FP32
        row[f"{timing}int8_vs_fp32"] = (
            row[f"{timing}int8_rows_per_s"] / row[f"{timing}fp32_rows_per_s"]
        )
    for s in sessions.values():
        s.close()
    return [row]
