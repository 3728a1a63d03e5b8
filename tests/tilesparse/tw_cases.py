"""Layouts and inputs shared by the tilesparse kernel tests (test_ops*.py)."""

from __future__ import annotations

import torch

from tilesparse.format import TWLayout

# The dtypes every fast path is compared in against the reference, at
# tests.tolerances.tol("tw_gemm", dtype).
GEMM_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def tw_random_mask(
    K: int, N: int, G: int, keep_rows: float, gen: torch.Generator, drop_cols: float = 0.0
) -> torch.Tensor:
    """A TW mask: whole columns dropped, then each tile of G kept columns keeps its own rows."""
    mask = torch.zeros(K, N, dtype=torch.bool)
    cols = torch.nonzero(torch.rand(N, generator=gen) >= drop_cols).flatten()
    for t0 in range(0, cols.numel(), G):
        c = cols[t0 : t0 + G]
        rows = torch.rand(K, generator=gen) < keep_rows
        mask[rows.nonzero().flatten().unsqueeze(1), c.unsqueeze(0)] = True
    return mask


def int_tensor(shape, gen, lo=-3, hi=4, dtype=torch.float32):
    """Small integers as floats: every product and sum is exact, so results compare exactly."""
    return torch.randint(lo, hi, shape, generator=gen).to(dtype)


def layout_with_empty_tile(K: int, N: int, dtype=torch.float32) -> TWLayout:
    """Tiles {0..3} rows {1,3}; {4,5} no rows at all; {7} rows {0}. Column 6 pruned."""
    i64 = torch.int64
    vals = torch.arange(1, 2 * 4 + 1 + 1, dtype=dtype)  # 8 + 1 values
    return TWLayout(
        in_features=K,
        out_features=N,
        tile=4,
        col_idx=torch.tensor([0, 1, 2, 3, 4, 5, 7], dtype=i64),
        tile_ptr=torch.tensor([0, 4, 6, 7], dtype=i64),
        row_idx=torch.tensor([1, 3, 0], dtype=i64),
        row_ptr=torch.tensor([0, 2, 2, 3], dtype=i64),
        values=vals,
        val_ptr=torch.tensor([0, 8, 8, 9], dtype=i64),
    )
