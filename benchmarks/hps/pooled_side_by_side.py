"""Set-associative pooled lookups against one fused ``embedding_bag``, alone (issue 27).

    PYTHONPATH=. python -m benchmarks.hps.pooled_side_by_side --label after --out FILE.json

The ``tables`` section of :mod:`benchmarks.hps.bench_lookup` reduced to its pooled pair: the
26 tables of ``dlrm_dcnv2`` ÷ 300 (65,484 Zipf(1.05) keys, batch 306, 128-wide FP32), every
row resident in a set-associative LFU cache (capacity 2 × rows), ``lookup_pooled`` into a
reused buffer against ``F.embedding_bag`` (sum) over the stacked rows, the two calls
alternated, CPU time of the calling thread with one torch thread, medians. Each run appends
one row (``label``, both medians, the ratio, the load average) to ``--out``, so that runs of
two builds (this checkout and another one on ``PYTHONPATH``, run by file path) can alternate
and land in one JSON. Only the bench's setup helpers are imported from ``benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.hps.bench_lookup import DIM, _resident_session, tables_setup
from benchmarks.meta import write_json
from hps.types import Pooling

log = logging.getLogger(__name__)


def run(repeats: int) -> dict[str, Any]:
    """One setup, ``repeats`` alternated pairs; medians in ms and the ratio (> 1: ours faster)."""
    names, ws, hot, batch, keys = tables_setup(300)
    rows = [int(w.shape[0]) for w in ws]
    s = _resident_session(ws, names, 1 << 20, slack=2.0)
    stacked = torch.cat(ws)
    base = torch.tensor([0, *np.cumsum(rows)[:-1].tolist()])
    ids = torch.cat([k.reshape(-1) + base[i] for i, k in enumerate(keys)])
    offsets = torch.tensor([0, *np.cumsum([h for h in hot for _ in range(batch)])[:-1].tolist()])
    out = torch.empty(batch, DIM * len(names))
    pooling = [Pooling.SUM] * len(names)
    ref = F.embedding_bag(ids, stacked, offsets, mode="sum").view(len(names), batch, DIM)
    got = s.lookup_pooled(names, keys, pooling, out=out).view(batch, len(names), DIM)
    torch.testing.assert_close(got.transpose(0, 1), ref, rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            s.lookup_pooled(names, keys, pooling, out=out)
            F.embedding_bag(ids, stacked, offsets, mode="sum")
        ours, theirs = [], []
        for _ in range(repeats):
            t0 = time.thread_time()
            s.lookup_pooled(names, keys, pooling, out=out)
            ours.append(time.thread_time() - t0)
            t0 = time.thread_time()
            F.embedding_bag(ids, stacked, offsets, mode="sum")
            theirs.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    a, b = float(np.median(ours)) * 1e3, float(np.median(theirs)) * 1e3
    return {"hps_pooled_cpu1_ms": a, "embedding_bag_cpu1_ms": b, "ratio": b / a}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--label", default="this checkout")
    # beside this file, not the imported checkout's: run by path with another build on
    # PYTHONPATH, the rows still land here
    here = Path(__file__).resolve().parent.parent / "results"
    ap.add_argument("--out", type=Path, default=here / "hps_pooled_side_by_side.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = os.getloadavg()[0]
    row: dict[str, Any] = {"label": args.label, "repeats": args.repeats, "load_1min": load}
    row.update(run(args.repeats))
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    write_json(args.out, [*rows, row], bench="hps_pooled_side_by_side")
    log.info("%s", json.dumps(row))


if __name__ == "__main__":
    main()
