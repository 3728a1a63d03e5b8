"""Bytes per embedding-cache slot for each row dtype and key width, and the lookup speed of
this tree against another checkout, runs interleaved (issue 28: ≤ 1.1 × FBGEMM's row). The
bytes are a full cache's for three key sets: ids in ``[0, 2**32)``, int64 ids of 16 high
words, 64-bit hashes.

    PYTHONPATH=. python -m benchmarks.hps.bench_cache_slot                     # bytes only
    PYTHONPATH=. python -m benchmarks.hps.bench_cache_slot --baseline DIR [--rounds 2] [--quick]

``--baseline DIR``: a checkout of the commit to compare with (e.g. ``git archive <sha> | tar -x
-C DIR``). ``benchmarks.hps.bench_lookup --only single,tables`` then runs as a subprocess in
DIR and in this tree, alternately (baseline, this tree, baseline, …), each with its own
``PYTHONPATH``; each run's ratios (ours vs ``index_select`` / ``embedding_bag`` / FBGEMM's TBE)
and the load average before it are kept. Writes ``benchmarks/results/hps_cache_slot.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.meta import RESULTS_DIR, write_json
from hps.rowformat import RowDtype, row_bytes
from hps.storage.cache import EmbeddingCache

log = logging.getLogger("bench_cache_slot")

DIM = 128
DTYPES = (RowDtype.FP32, RowDtype.FP16, RowDtype.INT8, RowDtype.INT4)
RATIOS = (
    "hps_vs_index_select",
    "hps_vs_fbgemm_fp32",
    "hps_vs_fbgemm_int8",
    "hps_vs_fbgemm_int4",
    "hps_rows_vs_index_select",
    "hps_pooled_vs_embedding_bag",
    "hps_pooled_vs_fbgemm_fp32",
)


#: key sets a full cache is filled with: ids in [0, 2**32) (one high word); 8 tables' ids
#: offset by ``table << 40``, some negative (16 high words: a nibble per slot); 64-bit hashes
KEY_SETS = ("one_word", "16_words", "hashed")


def _keys(kind: str, n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64)
    if kind == "one_word":
        return i * 40_000
    if kind == "16_words":
        return ((i % 8) << 40) + i // 8 - n // 32
    g = torch.Generator().manual_seed(0)
    return torch.randint(-(2**62), 2**62, (n,), generator=g).unique()


def bench_slot_bytes() -> list[dict[str, Any]]:
    """Exact bytes per slot (``EmbeddingCache.nbytes`` / capacity, the high words included)
    of a full cache at dim 128, for each key set."""
    out = []
    for dt in DTYPES:
        for kind in KEY_SETS:
            c = EmbeddingCache(4096, DIM, ways=64, row_format=dt)
            k = _keys(kind, c.capacity)
            c.insert(k, torch.zeros(0, DIM), rows=torch.zeros(k.numel(), c.row_bytes).byte())
            rb = row_bytes(dt, DIM)
            per_slot = c.nbytes() / c.capacity
            held = (
                "int64"
                if c.slot_keys.keys.dtype == torch.int64
                else f"int32+{c.slot_keys.high_words.numel()}"
            )
            out.append(
                {
                    "section": "slot_bytes",
                    "dtype": dt.value,
                    "keys": kind,
                    "held_as": held,
                    "cached": len(c),
                    "fbgemm_row_bytes": rb,
                    "slot_bytes": per_slot,
                    "metadata_bytes": per_slot - rb,
                    "vs_fbgemm_row": per_slot / rb,
                }
            )
            log.info("%s", out[-1])
    return out


def _load() -> float:
    return os.getloadavg()[0]


def _one_run(tree: Path, quick: bool, repeats: int) -> dict[str, Any]:
    """bench_lookup's single and tables sections in ``tree``; its ratios and timings."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "benchmarks.hps.bench_lookup", "--only", "single,tables"]
        cmd += ["--repeats", str(repeats)] + (["--quick"] if quick else [])
        bench = tree / "benchmarks" / "hps" / "bench_lookup.py"
        if "--out" in bench.read_text():
            out = Path(d) / "lookup.json"
            cmd += ["--out", str(out)]
        else:  # an older checkout (a scratch copy): its own results file
            name = "hps_lookup_quick.json" if quick else "hps_lookup.json"
            out = tree / "benchmarks" / "results" / name
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
        rows = json.loads(out.read_text())["rows"]
    got: dict[str, Any] = {}
    for r in rows:
        for k, v in r.items():
            if k in RATIOS or k.startswith("cpu1_hps") or k.endswith("_ms"):
                got[k] = v
    return got


def bench_before_after(baseline: Path, rounds: int, quick: bool, repeats: int) -> list[dict]:
    here = Path(__file__).resolve().parents[2]
    out = []
    for r in range(rounds):
        for label, tree in (("baseline", baseline), ("this_tree", here)):
            load = _load()
            row = {"section": "lookup", "round": r, "tree": label, "load_1min": load}
            row.update(_one_run(tree, quick, repeats))
            out.append(row)
            log.info("%s", {k: v for k, v in row.items() if k in RATIOS or k == "tree"})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="checkout to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="bench_lookup --quick")
    ap.add_argument("--out", default="hps_cache_slot.json", help="file under benchmarks/results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = bench_slot_bytes()
    if args.baseline is not None:
        rows += bench_before_after(args.baseline, args.rounds, args.quick, args.repeats)
    out = RESULTS_DIR / args.out
    write_json(out, rows, load_1min_end=_load())
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
