"""Hit rate of an LFU cache whose admission reads exact or sampled key statistics, and whose
counters count every lookup's uses or one lookup's in ``--lfu-sampling`` (issue 27).

    python -m benchmarks.hps.sampling_hit_rate --sampling 1,8,16 [--lfu-sampling 1,8]

One table of 100,000 rows × 16 (FP32, in the in-process hash map), an LFU cache of 10 % of
them (admission on the missed keys' priorities: their uses in the call plus the session's key
statistics), 400 pooled lookups of 1,024 bags × 4 Zipf(1.05) keys (ranks permuted over the
ids), misses admitted within the call; the hit rate over unique keys of the last 200 lookups,
per ``LookupSession(key_stats_sampling=s)`` and ``EmbeddingCache(lfu_sampling=k)``, the same
keys for every pair. JSON to ``benchmarks/results/hps_sampling_hit_rate.json``.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from benchmarks.meta import RESULTS_DIR, write_json
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache
from hps.storage.volatile import HashMapBackend

ROWS, DIM, BAGS, HOT = 100_000, 16, 1024, 4


def zipf_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` batches of ``(BAGS, HOT)`` keys: Zipf(1.05) ranks below ``ROWS``, permuted ids."""
    rng = np.random.default_rng(seed)
    perm = np.random.default_rng(seed + 1).permutation(ROWS)
    out = []
    for _ in range(n):
        r = rng.zipf(1.05, BAGS * HOT * 4)
        r = r[r <= ROWS][: BAGS * HOT] - 1
        assert r.size == BAGS * HOT
        out.append(torch.from_numpy(perm[r].reshape(BAGS, HOT).astype(np.int64)))
    return out


def hit_rate(sampling: int, batches: list[torch.Tensor], lfu_sampling: int = 1) -> dict[str, Any]:
    """Unique-key hit rate of the last half of ``batches`` with ``key_stats_sampling`` and the
    cache's ``lfu_sampling``."""
    v = HashMapBackend(num_partitions=1)
    v.create_table("t", DIM)
    rows = np.random.default_rng(2).standard_normal((ROWS, DIM)).astype(np.float32)
    v.insert("t", np.arange(ROWS, dtype=np.int64), rows)
    c = EmbeddingCache(ROWS // 10, DIM, policy="lfu", lfu_sampling=lfu_sampling)
    s = LookupSession(
        [SessionTable("t", DIM, 0.0, 10**6, c)],
        v,
        None,
        hit_rate_threshold=1.0,
        key_stats_sampling=sampling,
    )
    hits0 = queries0 = 0
    try:
        for i, b in enumerate(batches):
            if i == len(batches) // 2:
                hits0, queries0 = c.stats.hits, c.stats.queries
            s.lookup_pooled(["t"], [b])
    finally:
        s.close()
    return {
        "key_stats_sampling": sampling,
        "lfu_sampling": lfu_sampling,
        "hit_rate_unique": (c.stats.hits - hits0) / (c.stats.queries - queries0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sampling", default="1,8,16")
    ap.add_argument("--lfu-sampling", default="1")
    ap.add_argument("--lookups", type=int, default=400)
    ap.add_argument("--out", default=str(RESULTS_DIR / "hps_sampling_hit_rate.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = zipf_batches(args.lookups)
    rows = []
    for k in (int(x) for x in args.lfu_sampling.split(",")):
        for s in (int(x) for x in args.sampling.split(",")):
            rows.append(hit_rate(s, batches, k))
            print(rows[-1], flush=True)
    write_json(args.out, rows, bench="hps_sampling_hit_rate", lookups=args.lookups)


if __name__ == "__main__":
    main()
