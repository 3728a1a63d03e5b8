"""Condensed TW layouts built directly, for the kernel tests."""

from __future__ import annotations

import torch

from tilesparse.format import TWLayout, condense

I64 = torch.int64


def random_layout(
    K: int, N: int, G: int, col_p: float, row_p: float, empty_tile: bool, seed: int
) -> TWLayout:
    """A random TW layout built directly (so a tile may keep no rows), integer values."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.nonzero(torch.rand(N, generator=g) < col_p).flatten()
    col_idx, tile_ptr, row_idx, row_ptr, val_ptr, vals = [], [0], [], [0], [0], []
    for start in range(0, kept.numel(), G):
        cols = kept[start : start + G]
        rows = torch.nonzero(torch.rand(K, generator=g) < row_p).flatten()
        if empty_tile and start == 0:
            rows = rows[:0]
        col_idx += cols.tolist()
        tile_ptr.append(len(col_idx))
        row_idx += rows.tolist()
        row_ptr.append(len(row_idx))
        block = torch.randint(-4, 5, (rows.numel(), cols.numel()), generator=g).float()
        vals.append(block.flatten())
        val_ptr.append(val_ptr[-1] + block.numel())
    layout = TWLayout(
        K,
        N,
        G,
        torch.tensor(col_idx, dtype=I64),
        torch.tensor(tile_ptr, dtype=I64),
        torch.tensor(row_idx, dtype=I64),
        torch.tensor(row_ptr, dtype=I64),
        torch.cat(vals) if vals else torch.zeros(0),
        torch.tensor(val_ptr, dtype=I64),
    )
    layout.validate()
    return layout


def int_layout(K: int, N: int, G: int, seed: int) -> TWLayout:
    """A (K, N) layout with values in {-1, 0, 1}: ~70% of the columns kept, each tile of G
    keeping about half the rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-1, 2, (K, N), generator=g).float()
    cols = torch.rand(N, generator=g) < 0.7
    mask = torch.zeros(K, N, dtype=torch.bool)
    kept = torch.nonzero(cols).flatten()
    for start in range(0, kept.numel(), G):
        rows = torch.rand(K, generator=g) < 0.5
        tile_cols = kept[start : start + G]
        mask[torch.nonzero(rows).flatten().unsqueeze(1), tile_cols.unsqueeze(0)] = True
    return condense(w, mask, G)
