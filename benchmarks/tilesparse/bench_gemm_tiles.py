"""TW CPU GEMM against dense at MiniLM-L6's FFN shapes for small tile widths, rows-only masks
at 50 % (what tile-structured OBS, ``tilesparse.tile_obs``, produces) and neuron-pair masks
(``fc1``: whole output columns; ``fc2``: whole input rows), interleaved in one run.

    python -m benchmarks.tilesparse.bench_gemm_tiles --tokens 2048 --threads 1

Every row is ``Y (M, N) = X (M, K) · W (K, N)`` in float32: ``dense`` is ``torch.matmul``,
``tw`` is ``tilesparse.ops.tw_linear(x, layout, None, "cpu")`` (the compiled kernel) on the
condensed layout (``condense(w, mask, G)``); ``speedup = dense_ms / tw_ms`` (medians of
``--repeats`` interleaved rounds). Masks are random (seed 0): only their structure matters.
JSON to ``benchmarks/results/tilesparse_gemm_tiles.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.meta import RESULTS_DIR, write_json
from tilesparse.format import condense
from tilesparse.kernels import cpu_kernel_available
from tilesparse.ops import tw_linear

SHAPES = ((384, 1536), (1536, 384))  # MiniLM-L6 fc1, fc2 as (K, N)
TILES = (8, 16, 32, 64, 128)


def rows_only(k: int, n: int, tile: int, sparsity: float, gen: torch.Generator) -> torch.Tensor:
    """``(K, N) bool``: each tile of ``tile`` columns keeps its own random rows."""
    mask = torch.zeros(k, n, dtype=torch.bool)
    for c in range(0, n, tile):
        mask[torch.randperm(k, generator=gen)[: k - round(k * sparsity)], c : c + tile] = True
    return mask


def neurons(k: int, n: int, sparsity: float, gen: torch.Generator) -> torch.Tensor:
    """``(K, N) bool``: half the hidden units, as ``fc1`` (columns) or ``fc2`` (rows)."""
    mask = torch.zeros(k, n, dtype=torch.bool)
    if n > k:
        mask[:, torch.randperm(n, generator=gen)[: n - round(n * sparsity)]] = True
    else:
        mask[torch.randperm(k, generator=gen)[: k - round(k * sparsity)]] = True
    return mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="M, the token rows")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "tilesparse_gemm_tiles.json"))
    args = ap.parse_args()
    if not cpu_kernel_available():
        raise SystemExit(
            "the compiled tilesparse CPU kernel is missing: python -m tilesparse.build_ext"
        )
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k, n in SHAPES:
        x = torch.randn(args.tokens, k, generator=gen)
        w = torch.randn(k, n, generator=gen)
        layouts = {
            f"rows G={g}": condense(w, rows_only(k, n, g, args.sparsity, gen), g) for g in TILES
        }
        layouts["neurons G=128"] = condense(w, neurons(k, n, args.sparsity, gen), 128)
        times: dict[str, list[float]] = {c: [] for c in ["dense", *layouts]}
        for r in range(args.repeats + 3):  # 3 warm-up rounds
            for c in times:
                t0 = time.perf_counter()
                if c == "dense":
                    torch.matmul(x, w)
                else:
                    tw_linear(x, layouts[c], None, "cpu")
                if r >= 3:
                    times[c].append(time.perf_counter() - t0)
        med = {c: sorted(v)[len(v) // 2] * 1e3 for c, v in times.items()}
        for c in layouts:
            rows.append(
                {
                    "M": args.tokens,
                    "K": k,
                    "N": n,
                    "mask": c,
                    "tw_ms": med[c],
                    "dense_ms": med["dense"],
                    "speedup": med["dense"] / med[c],
                }
            )
            print(
                f"{args.tokens}x{k}x{n} {c:14s} {med[c]:8.2f} ms  dense {med['dense']:8.2f}  "
                f"speedup {med['dense'] / med[c]:.2f}",
                flush=True,
            )
    write_json(args.out, rows, load=os.getloadavg(), threads=args.threads, sparsity=args.sparsity)


if __name__ == "__main__":
    main()
