"""Set-associative pooled lookups against one fused ``embedding_bag``, alone (issue 27).

    PYTHONPATH=. python -m benchmarks.hps.pooled_side_by_side --label after --out FILE.json

The ``tables`` section of :mod:`benchmarks.hps.bench_lookup` reduced to its pooled pair: the
26 tables of ``dlrm_dcnv2`` ÷ 300 (65,484 Zipf(1.05) keys, batch 306, 128-wide FP32), every
row resident in a set-associative LFU cache (capacity 2 × rows), ``lookup_pooled`` into a
reused buffer against ``F.embedding_bag`` (sum) over the stacked rows, the calls alternated,
CPU time of the calling thread with one torch thread, medians and means, the sessions' order
rotated every round. ``embedding_bag`` runs twice a round, in alternating order: over the
stacked rows as torch allocates them, and over a copy on transparent huge pages
(``embedding_bag_huge``: the memory advice our caches' arrays get, and what every tensor gets
where ``transparent_hugepage/enabled`` is ``always``). ``--sampling 8,1`` (the default) runs
one session per key statistics sampling (8, the session default: the hits of one lookup in 8
counted per table; 1: every key), each cache with its dense key index (as the parameter
server builds it, :mod:`hps.storage.cache.dense_index`); one more session at the first sampling
hashes every key (no index; ``--no-hashed`` leaves it out). Each run
appends one row (``label``, the medians, means and ratios, the load average) to ``--out``, so
that runs of two builds of stop 36 or later (this checkout and another one on ``PYTHONPATH``,
run by file path) can alternate
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

from benchmarks.hps.bench_lookup import DIM, _resident_session, on_huge_pages, tables_setup
from benchmarks.meta import write_json
from hps.session import DEFAULT_KEY_STATS_SAMPLING
from hps.types import Pooling

log = logging.getLogger(__name__)


def run(repeats: int, samplings: list[int], hashed: bool) -> dict[str, Any]:
    """One setup, ``repeats`` alternated rounds (one call per session, one ``embedding_bag``);
    per session (its key statistics sampling ``s``: one lookup in ``s`` counted per table) the
    median and mean in ms and the ratios (> 1: ours faster). With ``s > 1`` one lookup in
    ``s`` counts a given table's keys, so the calls' costs differ: the mean is the amortised
    figure, the median a typical call's."""
    names, ws, hot, batch, keys = tables_setup(300)
    rows = [int(w.shape[0]) for w in ws]
    sessions = {
        f"sampling_{s}": _resident_session(ws, names, 1 << 20, slack=2.0, key_stats_sampling=s)
        for s in samplings
    }
    if hashed:  # the same caches without their dense key index: every key hashed
        s = samplings[0]
        sessions[f"sampling_{s}_hashed"] = _resident_session(
            ws, names, 1 << 20, slack=2.0, key_stats_sampling=s, dense_index=False
        )
    stacked = torch.cat(ws)
    stacked_huge, huge_mib = on_huge_pages(stacked)
    base = torch.tensor([0, *np.cumsum(rows)[:-1].tolist()])
    ids = torch.cat([k.reshape(-1) + base[i] for i, k in enumerate(keys)])
    offsets = torch.tensor([0, *np.cumsum([h for h in hot for _ in range(batch)])[:-1].tolist()])
    out = torch.empty(batch, DIM * len(names))
    pooling = [Pooling.SUM] * len(names)
    ref = F.embedding_bag(ids, stacked, offsets, mode="sum").view(len(names), batch, DIM)
    assert torch.equal(F.embedding_bag(ids, stacked_huge, offsets, mode="sum").view_as(ref), ref)
    for s in sessions.values():
        got = s.lookup_pooled(names, keys, pooling, out=out).view(batch, len(names), DIM)
        torch.testing.assert_close(got.transpose(0, 1), ref, rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ours: dict[str, list[float]] = {k: [] for k in sessions}
    theirs: list[float] = []
    theirs_huge: list[float] = []
    try:
        for _ in range(3):
            for s in sessions.values():
                s.lookup_pooled(names, keys, pooling, out=out)
            F.embedding_bag(ids, stacked, offsets, mode="sum")
            F.embedding_bag(ids, stacked_huge, offsets, mode="sum")
        items = list(sessions.items())
        for r in range(repeats):
            for k, s in items[r % len(items) :] + items[: r % len(items)]:
                t0 = time.thread_time()
                s.lookup_pooled(names, keys, pooling, out=out)
                ours[k].append(time.thread_time() - t0)
            peers = [(stacked, theirs), (stacked_huge, theirs_huge)]
            for w, times in peers if r % 2 == 0 else peers[::-1]:  # neither always second
                t0 = time.thread_time()
                F.embedding_bag(ids, w, offsets, mode="sum")
                times.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    b_med, b_mean = float(np.median(theirs)) * 1e3, float(np.mean(theirs)) * 1e3
    h_med, h_mean = float(np.median(theirs_huge)) * 1e3, float(np.mean(theirs_huge)) * 1e3
    res: dict[str, Any] = {
        "embedding_bag_cpu1_ms": b_med,
        "embedding_bag_cpu1_mean_ms": b_mean,
        "embedding_bag_huge_cpu1_ms": h_med,
        "embedding_bag_huge_cpu1_mean_ms": h_mean,
        "peer_huge_pages_mib": huge_mib,
    }
    for k, v in ours.items():
        a_med, a_mean = float(np.median(v)) * 1e3, float(np.mean(v)) * 1e3
        res[k] = {
            "hps_pooled_cpu1_ms": a_med,
            "hps_pooled_cpu1_mean_ms": a_mean,
            "ratio": b_med / a_med,
            "ratio_of_means": b_mean / a_mean,
            "ratio_vs_huge": h_med / a_med,
            "ratio_of_means_vs_huge": h_mean / a_mean,
        }
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--label", default="this checkout")
    ap.add_argument(
        "--sampling",
        default=f"{DEFAULT_KEY_STATS_SAMPLING},1",
        help="comma-separated key statistics samplings, one session each (1: exact counts)",
    )
    ap.add_argument(
        "--no-hashed",
        action="store_true",
        help="leave out the session whose caches hash every key (no dense key index)",
    )
    # beside this file, not the imported checkout's: run by path with another build on
    # PYTHONPATH, the rows still land here
    here = Path(__file__).resolve().parent.parent / "results"
    ap.add_argument("--out", type=Path, default=here / "hps_pooled_side_by_side.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = os.getloadavg()[0]
    row: dict[str, Any] = {"label": args.label, "repeats": args.repeats, "load_1min": load}
    row.update(run(args.repeats, [int(x) for x in args.sampling.split(",")], not args.no_hashed))
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    write_json(args.out, [*rows, row], bench="hps_pooled_side_by_side")
    log.info("%s", json.dumps(row))


if __name__ == "__main__":
    main()
