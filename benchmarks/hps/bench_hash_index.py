"""The hash map's key index laid out by density against the sorted int64 index, side by side
in one process: bytes per row for each row format and the peak memory of a load, and the
speed of ``lookup_rows`` (rows/s, a batch of Zipf keys).

    python -m benchmarks.hps.bench_hash_index            # 1 M rows × 128
    python -m benchmarks.hps.bench_hash_index --quick    # 100 k rows (a smoke run)

Each table is loaded as the parameter server loads it (``insert_rows`` of 256 k rows at a time,
8 partitions) with identity keys ``0..n-1`` (what exports write) — DIRECT for the compact map;
``--sparse`` adds a table whose keys are ``5·i`` (a fifth of the range: SORTED_U32). The
reference is ``HashMapBackend(compact_keys=False)``: sorted int64 keys + int32 slots
(12 B per row). FBGEMM's row (``hps.rowformat.row_bytes``) is the yardstick:
512 / 256 / 132 / 68 B for FP32 / FP16 / INT8 / INT4 at dim 128. Lookups are timed
interleaved (A B A B ...), median of ``repeats``.
"""

from __future__ import annotations

import argparse
import logging
import os
import tracemalloc
from functools import partial
from typing import Any

import numpy as np
import torch

from benchmarks.hps.zipf_keys import Zipf, side_by_side
from benchmarks.meta import RESULTS_DIR, write_json
from hps.rowformat import RowDtype, row_bytes
from hps.storage.row_codec import RowCodec
from hps.storage.volatile import HashMapBackend

log = logging.getLogger("bench_hash_index")

DTYPES = (RowDtype.FP32, RowDtype.FP16, RowDtype.INT8, RowDtype.INT4)
CHUNK = 262_144  # rows per insert, as hps.parameter_server loads sparse files
LAYOUTS = {"compact": True, "reference": False}


def _load(dtype: RowDtype, keys: np.ndarray, dim: int, compact: bool) -> HashMapBackend:
    v = HashMapBackend(num_partitions=8, compact_keys=compact)
    v.create_table("t", dim, row_format=dtype)
    codec = RowCodec(dim, dtype, "bench")
    g = torch.Generator().manual_seed(0)
    for s in range(0, keys.size, CHUNK):
        k = keys[s : s + CHUNK]
        v.insert_rows("t", k, codec.encode(torch.randn(k.size, dim, generator=g).numpy()))
    return v


def bench_bytes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Bytes per row (``nbytes / rows``) and the peak traced memory of the load over the
    table's final bytes, for each format and index, one map at a time."""
    out = []
    keys = np.arange(args.rows, dtype=np.int64)
    for dt in DTYPES:
        rb = row_bytes(dt, args.dim)
        row: dict[str, Any] = {"section": "bytes", "dtype": dt.value, "rows": args.rows}
        row["fbgemm_row_bytes"] = rb
        for name, compact in LAYOUTS.items():
            tracemalloc.start()
            v = _load(dt, keys, args.dim, compact)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            nb = v.nbytes("t")
            row[f"{name}_layout"] = v.key_layout("t").value
            row[f"{name}_bytes_per_row"] = nb / args.rows
            row[f"{name}_vs_fbgemm"] = nb / args.rows / rb
            row[f"{name}_load_peak_bytes_per_row"] = peak / args.rows
            row[f"{name}_load_peak_vs_final"] = peak / nb
            del v
        log.info("%s", row)
        out.append(row)
    return out


def bench_lookup(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``lookup_rows`` of one batch of Zipf keys, compact and reference maps side by side."""
    out = []
    tables = [("identity", 1)] + ([("sparse", 5)] if args.sparse else [])
    for dt in (RowDtype.INT8, RowDtype.FP32):
        for rows in sorted({args.rows // 10, args.rows}):
            for kind, step in tables:
                keys = np.arange(rows, dtype=np.int64) * step
                maps = {n: _load(dt, keys, args.dim, c) for n, c in LAYOUTS.items()}
                q = keys[Zipf(rows, args.alpha, seed=1).sample(args.batch)]

                fns = {n: partial(v.lookup_rows, "t", q) for n, v in maps.items()}
                (a, fa), (b, fb) = fns["compact"](), fns["reference"]()
                assert np.array_equal(fa, fb) and np.array_equal(a, b)  # bit-equal answers
                t = side_by_side(fns, args.repeats)
                row: dict[str, Any] = {
                    "section": "lookup",
                    "dtype": dt.value,
                    "keys": kind,
                    "rows": rows,
                    "batch": args.batch,
                    "compact_layout": maps["compact"].key_layout("t").value,
                    "compact_rows_per_s": args.batch / t["compact"],
                    "reference_rows_per_s": args.batch / t["reference"],
                    "compact_vs_reference": t["reference"] / t["compact"],
                    "load_avg": os.getloadavg()[0],
                }
                log.info("%s", row)
                out.append(row)
                del maps
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 k rows, fewer repeats")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sparse", action="store_true", help="also a table of keys 5·i")
    ap.add_argument("--only", default="bytes,lookup")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = 100_000, 5
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sections = {"bytes": bench_bytes, "lookup": bench_lookup}
    rows: list[dict[str, Any]] = []
    for name in args.only.split(","):
        rows += sections[name](args)
    out = RESULTS_DIR / ("hps_hash_index_quick.json" if args.quick else "hps_hash_index.json")
    write_json(out, rows, threads=torch.get_num_threads(), load_avg=os.getloadavg())
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
