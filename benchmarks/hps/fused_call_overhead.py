"""A fused pooled lookup's cost at small batches, where the per-call work dominates (issue 27).

    PYTHONPATH=. python -m benchmarks.hps.fused_call_overhead --label after --out FILE.json

The 26 tables of ``dlrm_dcnv2`` ÷ 300 (128-wide FP32, Zipf(1.05) keys, every row resident),
``lookup_pooled`` into a reused buffer at batches 1, 16 and the full 306, over two sessions:
full static caches (IDENTITY, as the parameter server builds a cache that covers its table)
and set-associative LFU caches (capacity 2 × rows). CPU time of the calling thread with one
torch thread, medians of ``--repeats`` calls per cell after 20 warm-up calls. Each run appends
one row (``label``, the load average, ms per cell) to ``--out``, so that runs of two builds (this
checkout and another on ``PYTHONPATH``, run by file path) can alternate and land in one JSON.
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

from benchmarks.hps.bench_lookup import DIM, _resident_session, _static_session, tables_setup
from benchmarks.meta import write_json
from hps.types import Pooling

log = logging.getLogger(__name__)

BATCHES = (1, 16)


def run(repeats: int) -> dict[str, Any]:
    """Per session kind and batch, the median ms of one pooled lookup."""
    names, ws, _, batch, keys = tables_setup(300)
    sessions = {
        "static": _static_session(ws, names, 1 << 20),
        "set_associative": _resident_session(ws, names, 1 << 20, slack=2.0),
    }
    pooling = [Pooling.SUM] * len(names)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    try:
        for kind, s in sessions.items():
            for b in (*BATCHES, batch):
                ks = [k[:b].contiguous() for k in keys]
                out = torch.empty(b, DIM * len(names))
                for _ in range(20):
                    s.lookup_pooled(names, ks, pooling, out=out)
                ts = []
                for _ in range(repeats):
                    t0 = time.thread_time()
                    s.lookup_pooled(names, ks, pooling, out=out)
                    ts.append(time.thread_time() - t0)
                res[f"{kind}_batch{b}_cpu1_ms"] = float(np.median(ts)) * 1e3
    finally:
        torch.set_num_threads(threads)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--label", default="this checkout")
    # beside this file, not the imported checkout's: run by path with another build on
    # PYTHONPATH, the rows still land here
    here = Path(__file__).resolve().parent.parent / "results"
    ap.add_argument("--out", type=Path, default=here / "hps_fused_call_overhead.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    row: dict[str, Any] = {
        "label": args.label,
        "repeats": args.repeats,
        "load_1min": os.getloadavg()[0],
    }
    row.update(run(args.repeats))
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    write_json(args.out, [*rows, row], bench="hps_fused_call_overhead")
    log.info("%s", json.dumps(row))


if __name__ == "__main__":
    main()
