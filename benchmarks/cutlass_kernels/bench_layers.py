"""A pruned layer on CUDA against its dense layer, side by side: ``TileSparseLinear`` with
backend ``auto`` (what a user gets) and ``cutlass`` (the kernel through the row-major op) vs
``nn.Linear`` (cuBLAS), TW 75 %, on the shapes of ``gpu_check``.

    python -m benchmarks.cutlass_kernels.bench_layers [--out FILE] [--reps N]

Timed as ``gpu_check`` times (:class:`~benchmarks.cutlass_kernels.gpu_timing.Timer`): each
loop queued behind a GPU busy-wait, so ``us`` (cold median) is GPU time and ``host_us`` the
host's time per call; ``ratio_*`` = dense / contender (> 1: faster than dense).
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn

from benchmarks.cutlass_kernels.gpu_check import SHAPES
from benchmarks.cutlass_kernels.gpu_timing import Timer
from benchmarks.meta import RESULTS_DIR, write_json
from tilesparse.linear import TileSparseLinear

SPARSITY = 0.75


def _layer(K: int, N: int, dtype: torch.dtype) -> tuple[nn.Linear, TileSparseLinear]:
    """A dense layer and its TW 75 % version (half the columns, then half the rows per tile)."""
    gen = torch.Generator().manual_seed(0)
    dense = nn.Linear(K, N)
    mask = torch.zeros(K, N, dtype=torch.bool)
    cols = torch.randperm(N, generator=gen)[: N // 2].sort().values
    for t0 in range(0, cols.numel(), 128):
        rows = torch.randperm(K, generator=gen)[: K // 2]
        mask[rows.unsqueeze(1), cols[t0 : t0 + 128].unsqueeze(0)] = True
    tw = TileSparseLinear.from_dense(dense, mask_kn=mask, tile=128)
    return dense.to("cuda", dtype), tw.to("cuda", dtype)


class _Run:
    """One pruned layer called through a given backend (the module's attribute is set per call,
    so the interleaved contenders share one layer and its caches)."""

    def __init__(self, tw: TileSparseLinear, x: torch.Tensor, backend: str) -> None:
        self.tw, self.x, self.backend = tw, x, backend

    def __call__(self) -> torch.Tensor:
        self.tw.backend = self.backend
        return self.tw(self.x)


def _row(
    timer: Timer, name: str, M: int, K: int, N: int, dtype: torch.dtype, reps: int
) -> dict[str, object]:
    dense, tw = _layer(K, N, dtype)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    fns = {
        "dense": functools.partial(dense, x),
        "auto": _Run(tw, x, "auto"),
        "cutlass": _Run(tw, x, "cutlass"),
    }
    with torch.no_grad():
        timings = {k: timer.time(f, reps) for k, f in fns.items()}
        agree = float((_Run(tw, x, "auto")() - _Run(tw, x, "cutlass")()).abs().max())
    return {
        "shape": name,
        "M": M,
        "K": K,
        "N": N,
        "dtype": str(dtype).split(".")[-1],
        "us": {k: v.us for k, v in timings.items()},
        "host_us": {k: v.host_us for k, v in timings.items()},
        "ratio_auto": timings["dense"].us / timings["auto"].us,
        "ratio_cutlass": timings["dense"].us / timings["cutlass"].us,
        "auto_vs_cutlass_max_abs": agree,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS_DIR / "cutlass_layers.json"))
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_layers: no CUDA device")
        return 3
    timer = Timer("cuda")
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for name, M, K, N in SHAPES:
            row = _row(timer, name, M, K, N, dtype, args.reps)
            rows.append(row)
            us, host = row["us"], row["host_us"]
            assert isinstance(us, dict) and isinstance(host, dict)
            print(
                f"{name:>15} {row['dtype']:>8}  dense {us['dense']:7.1f} us (host "
                f"{host['dense']:5.1f})  auto {us['auto']:7.1f} us (host {host['auto']:5.1f}) "
                f"{row['ratio_auto']:.2f}x  cutlass {us['cutlass']:7.1f} us (host "
                f"{host['cutlass']:5.1f}) {row['ratio_cutlass']:.2f}x",
                flush=True,
            )
            torch.cuda.empty_cache()
    print(f"wrote {write_json(args.out, rows, sparsity=SPARSITY)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
