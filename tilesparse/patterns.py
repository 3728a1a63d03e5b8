"""Sparsity patterns: pure functions from importance scores to boolean masks.

Every function takes scores in the ``K × N`` (in × out) orientation — ``W = linear.weight.T``
— non-negative and finite, and returns a ``(K, N) bool`` mask of the weights to KEEP. The
``*_masks`` variants take a list of layers and apply ONE threshold across all of them (so the
layers end up with different sparsities), with a per-layer floor ``min_density`` (fraction of
its weights a layer keeps at least); the single-layer functions are the one-layer case.

Budgets are counted in weights: a mask keeps ``round((1 - sparsity) · K · N)`` weights, minus at
most one selection unit (a column, a row segment, a block) that would overshoot.

Tile-wise (TW, Guo et al. SC20) in two steps, the budget split by ``column_share`` (0.5: the
paper's ``s' = 100 - sqrt(10000 - 100·s)`` for each step):

1. global column pruning: column ``n`` scores the RMS ``‖S[:, n]‖₂ / sqrt(K)``; the worst
   columns go whole, but every layer keeps at least its best column (when a layer's column
   budget is under one column, its sparsity then comes from the row step alone);
2. per-tile row pruning: the kept columns, in order, form tiles of ``G`` columns (the last may be
   narrower); in tile ``t`` the row segment ``S[k, cols_t]`` scores its RMS
   ``‖S[k, cols_t]‖₂ / sqrt(|cols_t|)`` and the worst segments go, under one threshold for all
   tiles. A tile may lose every row. Between tiles of one width this ranks segments as the
   paper's ``‖·‖₂ / |cols_t|`` does; across widths (a layer's narrower last tile, a layer
   narrower than ``G``) the RMS scores a segment of equal elements ``v`` as ``v`` whatever its
   width, where ``/ |cols_t|`` gave ``v / sqrt(|cols_t|)`` and kept narrow tiles first.

>>> S = torch.tensor([[9., 1, 8, 7, 2, 6],
...                   [8., 2, 1, 6, 1, 1],
...                   [1., 1, 9, 1, 3, 7],
...                   [7., 2, 8, 9, 1, 6]])
>>> print(render_mask(tw_mask(S, sparsity=0.5, tile=2)))
x . x x . x
x . x . . .
x . x . . .
x . x x . x

Columns 1 and 4 (the weakest) went whole; tiles are {0, 2} and {3, 5}; tile {0, 2} kept rows
0-3, tile {3, 5} rows 0 and 3 (:func:`tw_mask` works it in full). :func:`render_mask` draws
``x`` for kept, ``.`` for pruned, one line per k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tilesparse.config import Pattern, TileSparseConfig
from tilesparse.format import tile_groups

__all__ = [
    "split_budget",
    "select_units",
    "column_scores",
    "segment_scores",
    "tw_mask",
    "tw_masks",
    "tw_rows_mask",
    "tw_rows_masks",
    "tew_mask",
    "tew_masks",
    "ew_mask",
    "ew_masks",
    "ew_per_output_mask",
    "nm_mask",
    "bw_mask",
    "bw_masks",
    "masks_for_config",
    "render_mask",
    "is_tile_wise",
]


# -- checks and the budget ----------------------------------------------------------------
def _check_scores(scores: torch.Tensor, name: str = "scores") -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        desc = (
            f"{scores.dtype} {tuple(scores.shape)}"
            if isinstance(scores, torch.Tensor)
            else type(scores).__name__
        )
        raise ValueError(f"{name} must be a 2-D float (K, N) tensor, got {desc}")
    if scores.numel() and (not bool(torch.isfinite(scores).all()) or bool((scores < 0).any())):
        raise ValueError(
            f"{name} must be finite and >= 0 (importance scores), got min {float(scores.min())}"
        )


def _check_sparsity(sparsity: float) -> None:
    if not (isinstance(sparsity, int | float) and 0.0 <= sparsity < 1.0):
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")


def _check_tile(tile: int) -> None:
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"tile must be a positive integer, got {tile!r}")


def _check_density(min_density: float) -> None:
    if not 0.0 <= min_density <= 1.0:
        raise ValueError(f"min_density must be in [0, 1], got {min_density!r}")


def split_budget(sparsity: float, column_share: float = 0.5) -> tuple[float, float]:
    """Split a TW sparsity between column pruning and per-tile row pruning.

    The kept fractions multiply: ``(1 - s) = (1 - s_col) · (1 - s_row)`` with
    ``1 - s_col = (1 - s) ** column_share``. ``column_share = 0.5`` is the paper's even split,
    ``s' = 100 - sqrt(10000 - 100·s)`` in percent.

    >>> [round(x, 4) for x in split_budget(0.75)]
    [0.5, 0.5]
    >>> [round(x, 4) for x in split_budget(0.75, column_share=0.0)]
    [0.0, 0.75]

    Returns:
        ``(column_sparsity, row_sparsity)``.
    """
    _check_sparsity(sparsity)
    if not 0.0 <= column_share <= 1.0:
        raise ValueError(f"column_share must be in [0, 1], got {column_share!r}")
    keep_col = (1.0 - sparsity) ** column_share
    return 1.0 - keep_col, 1.0 - (1.0 - sparsity) / keep_col


def select_units(
    scores: Sequence[torch.Tensor],
    sizes: Sequence[torch.Tensor],
    keep: int,
    floors: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Keep the best units across groups under one budget: the threshold shared by all groups.

    Each group first keeps its best units until it holds ``floors[g]`` elements; the rest of
    the budget goes to the best remaining units of all groups, best first, while the total
    stays ``<= keep``. Ties go to the earlier group, then the lower index (stable).

    Args:
        scores: per group ``(U_g,)`` float unit scores.
        sizes: per group ``(U_g,)`` int64 elements per unit (> 0).
        keep: element budget.
        floors: per group elements kept at least (default 0).

    Returns:
        per group ``(U_g,) bool``, the kept units.
    """
    floors = [0] * len(scores) if floors is None else list(floors)
    kept = [torch.zeros(s.numel(), dtype=torch.bool) for s in scores]
    used = 0
    for g, (s, z) in enumerate(zip(scores, sizes)):
        if floors[g] <= 0 or s.numel() == 0:
            continue
        order = torch.sort(s, descending=True, stable=True).indices
        csum = torch.cumsum(z[order], 0)
        n_forced = (
            int(torch.searchsorted(csum, torch.tensor(floors[g], dtype=csum.dtype)).item()) + 1
        )
        n_forced = min(n_forced, s.numel())
        kept[g][order[:n_forced]] = True
        used += int(csum[n_forced - 1])
    remaining = keep - used
    if remaining <= 0:
        return kept
    cand_s, cand_z, cand_g, cand_i = [], [], [], []
    for g, (s, z) in enumerate(zip(scores, sizes)):
        free = torch.nonzero(~kept[g]).flatten()
        cand_s.append(s[free].double())
        cand_z.append(z[free].to(torch.int64))
        cand_g.append(torch.full_like(free, g))
        cand_i.append(free)
    all_s = torch.cat(cand_s)
    all_z, all_g, all_i = torch.cat(cand_z), torch.cat(cand_g), torch.cat(cand_i)
    order = torch.sort(all_s, descending=True, stable=True).indices
    all_z, all_g, all_i = all_z[order], all_g[order], all_i[order]
    # Best first while the budget holds; a unit too big for what is left is skipped and the
    # smaller ones after it may still fit (unit sizes take few values, so few rounds).
    while remaining > 0 and all_z.numel():
        fits = all_z <= remaining
        all_z, all_g, all_i = all_z[fits], all_g[fits], all_i[fits]
        if not all_z.numel():
            break
        csum = torch.cumsum(all_z, 0)
        n_take = int((csum <= remaining).sum())
        for g in range(len(scores)):
            sel = all_g[:n_take] == g
            kept[g][all_i[:n_take][sel]] = True
        remaining -= int(csum[n_take - 1])
        all_z, all_g, all_i = all_z[n_take:], all_g[n_take:], all_i[n_take:]
    return kept


def _floors(shapes: Sequence[tuple[int, int]], min_density: float) -> list[int]:
    return [math.ceil(min_density * k * n) for k, n in shapes]


def _budget(shapes: Sequence[tuple[int, int]], sparsity: float) -> int:
    return round((1.0 - sparsity) * sum(k * n for k, n in shapes))


# -- TW -------------------------------------------------------------------------------------
def column_scores(scores: torch.Tensor) -> torch.Tensor:
    """``(N,)`` float64: column ``n`` scores ``‖S[:, n]‖₂ / sqrt(K)``, the RMS of its scores.

    The RMS, not ``‖·‖₂ / K``: columns of layers with different ``K`` compete under one
    global threshold, and the RMS scores a column of equal elements ``v`` as ``v``, the score
    element-wise pruning would give each of them (``/ K`` would prune wide layers first)."""
    s = scores.double()
    return torch.linalg.vector_norm(s, dim=0) / math.sqrt(max(1, s.shape[0]))


def _tiles_of(cols: torch.Tensor, tile: int) -> list[torch.Tensor]:
    return [cols[i : i + tile] for i in range(0, cols.numel(), tile)]


def segment_scores(scores: torch.Tensor, tiles: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(K, T)`` float64: the row segment ``(k, t)`` scores ``‖S[k, cols_t]‖₂ / sqrt(|cols_t|)``,
    the RMS of its scores.

    The RMS, as in :func:`column_scores`: segments of tiles of different widths (a layer's
    narrower last tile, layers narrower than ``G``) compete under one threshold, and the RMS
    scores a segment of equal elements ``v`` as ``v`` whatever its width (``/ |cols_t|`` scored
    it ``v / sqrt(|cols_t|)``, keeping narrow tiles before wide ones of larger weights).

    >>> S = torch.tensor([[3., 4., 1.], [0., 0., 2.]])
    >>> segment_scores(S, [torch.tensor([0, 1]), torch.tensor([2])])  # 5/sqrt(2), 1/sqrt(1)
    tensor([[3.5355, 1.0000],
            [0.0000, 2.0000]], dtype=torch.float64)

    Args:
        scores: ``(K, N)``.
        tiles: the column indices of each tile, ``(G_t,) int64``, each non-empty.
    """
    s = scores.double()
    out = torch.zeros(s.shape[0], len(tiles), dtype=torch.float64)
    for t, cols in enumerate(tiles):
        out[:, t] = torch.linalg.vector_norm(s[:, cols], dim=1) / math.sqrt(cols.numel())
    return out


def tw_masks(
    scores: Sequence[torch.Tensor],
    sparsity: float,
    tile: int = 128,
    column_share: float = 0.5,
    min_density: float = 0.0,
) -> list[torch.Tensor]:
    """Tile-wise masks for several layers under one global threshold per step.

    Args:
        scores: per layer ``(K_l, N_l)`` float, non-negative.
        sparsity: overall target in [0, 1).
        tile: ``G`` (> 0); ``K`` and ``N`` need not be multiples of it.
        column_share: see :func:`split_budget`.
        min_density: per-layer floor on the kept fraction.

    Returns:
        per layer ``(K_l, N_l) bool``; within a layer, kept columns are tiled ``G`` at a time in
        ascending order and every column of a tile has the same row set. The column step never
        removes a layer's last column (so a 64×1 layer at 75 % keeps 16 of its 64 rows, not
        nothing); the row step may still empty a layer under the global threshold unless
        ``min_density`` keeps some of it.
    """
    for i, s in enumerate(scores):
        _check_scores(s, f"scores[{i}]")
    _check_sparsity(sparsity)
    _check_tile(tile)
    _check_density(min_density)
    shapes = [(int(s.shape[0]), int(s.shape[1])) for s in scores]
    col_sparsity, _ = split_budget(sparsity, column_share)
    floors = _floors(shapes, min_density)
    # step 1: columns, each a unit of K_l weights. A layer keeps at least its best column: on a
    # narrow layer (N_l = 1, or a column budget below K_l) the column step would otherwise take
    # every column and leave the row step nothing (13x1 at 75 % came out 100 % sparse); the
    # row step then prunes that column's rows down to the budget.
    col_keep = select_units(
        [column_scores(s) for s in scores],
        [torch.full((n,), k, dtype=torch.int64) for k, n in shapes],
        _budget(shapes, col_sparsity),
        [max(f, k) if k * n else f for f, (k, n) in zip(floors, shapes)],
    )
    # step 2: row segments of each tile of kept columns, each a unit of |cols_t| weights
    tiles = [_tiles_of(torch.nonzero(c).flatten(), tile) for c in col_keep]
    seg_scores, seg_sizes, seg_floors = [], [], []
    for s, ts, (k, _), f, ck in zip(scores, tiles, shapes, floors, col_keep):
        seg_scores.append(segment_scores(s, ts).flatten())
        widths = torch.tensor([c.numel() for c in ts], dtype=torch.int64)
        seg_sizes.append(widths.repeat(k))  # (K, T) row-major, matching .flatten()
        seg_floors.append(min(f, k * int(ck.sum())))
    seg_keep = select_units(seg_scores, seg_sizes, _budget(shapes, sparsity), seg_floors)
    masks = []
    for (k, n), ts, keep in zip(shapes, tiles, seg_keep):
        mask = torch.zeros(k, n, dtype=torch.bool)
        keep = keep.view(k, len(ts)) if ts else keep.view(k, 0)
        for t, cols in enumerate(ts):
            rows = torch.nonzero(keep[:, t]).flatten()
            mask[rows.unsqueeze(1), cols.unsqueeze(0)] = True
        masks.append(mask)
    return masks


def tw_mask(
    scores: torch.Tensor, sparsity: float, tile: int = 128, column_share: float = 0.5
) -> torch.Tensor:
    """Tile-wise mask of one layer (see the module docstring).

    Worked example, K=4, N=6, G=2, sparsity 0.5 (column step keeps
    ``round(0.7071·24) = 17`` weights → 4 columns; row step keeps 12 weights)::

        S =  9 1 8 7 2 6      column scores ‖S[:,n]‖₂/2: 7.0 1.6 7.2 6.5 1.9 5.5
             8 2 1 6 1 1      → columns 1 and 4 pruned; tiles {0,2}, {3,5}
             1 1 9 1 3 7      segment scores (tile {0,2} | tile {3,5}), RMS ‖·‖₂/sqrt(2):
             7 2 8 9 1 6      k0 8.5 | 6.5   k1 5.7 | 4.3   k2 6.4 | 5.0   k3 7.5 | 7.6
                              best six segments of 2 weights: k0|0 k3|1 k3|0 k0|1 k2|0 k1|0

    >>> S = torch.tensor([[9., 1, 8, 7, 2, 6], [8., 2, 1, 6, 1, 1],
    ...                   [1., 1, 9, 1, 3, 7], [7., 2, 8, 9, 1, 6]])
    >>> print(render_mask(tw_mask(S, 0.5, tile=2)))
    x . x x . x
    x . x . . .
    x . x . . .
    x . x x . x

    Returns:
        ``(K, N) bool``, the kept weights.
    """
    return tw_masks([scores], sparsity, tile, column_share)[0]


def tw_rows_masks(
    scores: Sequence[torch.Tensor], sparsity: float, tile: int = 128, min_density: float = 0.0
) -> list[torch.Tensor]:
    """TW with row pruning only: every column kept, tiles are ``G`` consecutive columns."""
    return tw_masks(scores, sparsity, tile, column_share=0.0, min_density=min_density)


def tw_rows_mask(scores: torch.Tensor, sparsity: float, tile: int = 128) -> torch.Tensor:
    """One layer of :func:`tw_rows_masks`.

    >>> S = torch.tensor([[9., 1, 8, 7], [1., 2, 1, 6], [1., 1, 9, 9]])
    >>> print(render_mask(tw_rows_mask(S, 0.5, tile=2)))
    x x x x
    . . . .
    . . x x
    """
    return tw_rows_masks([scores], sparsity, tile)[0]


def tew_masks(
    scores: Sequence[torch.Tensor],
    sparsity: float,
    tile: int = 128,
    delta: float = 0.05,
    column_share: float = 0.5,
    min_density: float = 0.0,
) -> list[torch.Tensor]:
    """TEW: TW at ``sparsity + delta``, then the best ``delta`` of all weights among the
    pruned ones restored as single elements (one threshold across layers)."""
    _check_sparsity(sparsity)
    if not 0.0 <= delta < 1.0 - sparsity:
        raise ValueError(f"delta must be in [0, 1 - sparsity = {1 - sparsity:g}), got {delta!r}")
    base = tw_masks(scores, sparsity + delta, tile, column_share, min_density)
    shapes = [(int(s.shape[0]), int(s.shape[1])) for s in scores]
    restore_budget = _budget(shapes, sparsity) - sum(int(m.sum()) for m in base)
    pruned = [torch.nonzero(~m.flatten()).flatten() for m in base]
    back = select_units(
        [s.flatten()[p].double() for s, p in zip(scores, pruned)],
        [torch.ones(p.numel(), dtype=torch.int64) for p in pruned],
        max(0, restore_budget),
    )
    out = []
    for m, p, b in zip(base, pruned, back):
        flat = m.flatten().clone()
        flat[p[b]] = True
        out.append(flat.view_as(m))
    return out


def tew_mask(
    scores: torch.Tensor,
    sparsity: float,
    tile: int = 128,
    delta: float = 0.05,
    column_share: float = 0.5,
) -> torch.Tensor:
    """One layer of :func:`tew_masks`.

    >>> S = torch.tensor([[9., 1, 8, 7], [1., 2, 1, 6], [1., 1, 9, 9]])
    >>> print(render_mask(tew_mask(S, 0.5, tile=2, delta=1/12, column_share=0.0)))
    x . x x
    . . . x
    . . x x

    TW at 7/12 kept the segments (0, {2,3}) and (2, {2,3}); then the best pruned single
    weights, 9 at (0, 0) and 6 at (1, 3), came back.
    """
    return tew_masks([scores], sparsity, tile, delta, column_share)[0]


# -- comparison patterns --------------------------------------------------------------------
def ew_masks(
    scores: Sequence[torch.Tensor], sparsity: float, min_density: float = 0.0
) -> list[torch.Tensor]:
    """Unstructured (element-wise) masks: the best weights across all layers."""
    for i, s in enumerate(scores):
        _check_scores(s, f"scores[{i}]")
    _check_sparsity(sparsity)
    _check_density(min_density)
    shapes = [(int(s.shape[0]), int(s.shape[1])) for s in scores]
    keep = select_units(
        [s.flatten().double() for s in scores],
        [torch.ones(s.numel(), dtype=torch.int64) for s in scores],
        _budget(shapes, sparsity),
        _floors(shapes, min_density),
    )
    return [k.view(s.shape) for k, s in zip(keep, scores)]


def ew_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """One layer of :func:`ew_masks`.

    >>> print(render_mask(ew_mask(torch.tensor([[4., 1], [2, 3]]), 0.5)))
    x .
    . x
    """
    return ew_masks([scores], sparsity)[0]


def ew_per_output_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Unstructured, compared within each output: every column ``n`` keeps its
    ``round(K·(1 - sparsity))`` best rows (ties to the lower ``k``). Wanda's comparison group
    (Sun et al. 2023): every output keeps the same share of its inputs, so no output loses
    all of them.

    >>> print(render_mask(ew_per_output_mask(torch.tensor([[4., 1], [2, 3]]), 0.5)))
    x .
    . x
    >>> print(render_mask(ew_per_output_mask(torch.tensor([[4., 3], [2, 1]]), 0.5)))
    x x
    . .
    """
    _check_scores(scores)
    _check_sparsity(sparsity)
    k = scores.shape[0]
    keep = round(k * (1.0 - sparsity))
    mask = torch.zeros(scores.shape, dtype=torch.bool)
    if keep == 0 or scores.numel() == 0:
        return mask
    best = scores.double().argsort(dim=0, descending=True, stable=True)[:keep]
    return mask.scatter_(0, best, True)


def nm_mask(scores: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """N:M mask along K: in every column, each group of ``m`` consecutive K entries keeps its
    best ``n`` (the layout of sparse tensor cores' 2:4, where K is the reduction axis). A last
    partial group of ``r < m`` entries keeps ``min(n, r)``.

    >>> S = torch.tensor([[1., 5], [4, 1], [3, 2], [2, 8], [9, 1]])
    >>> print(render_mask(nm_mask(S, 2, 4)))
    . x
    x .
    x .
    . x
    x x
    """
    _check_scores(scores)
    if isinstance(n, bool) or isinstance(m, bool) or not (1 <= n <= m):
        raise ValueError(f"N:M needs 1 <= n <= m, got n={n!r}, m={m!r}")
    k, cols = scores.shape
    pad = (-k) % m
    s = torch.cat([scores.double(), torch.full((pad, cols), -math.inf, dtype=torch.float64)])
    groups = s.view(-1, m, cols)
    order = torch.sort(groups, dim=1, descending=True, stable=True).indices
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, order[:, :n, :], True)
    return keep.view(-1, cols)[:k]


def _block_view(x: torch.Tensor, bk: int, bn: int) -> torch.Tensor:
    k, n = x.shape
    x = torch.nn.functional.pad(x, (0, (-n) % bn, 0, (-k) % bk))
    kb, nb = x.shape[0] // bk, x.shape[1] // bn
    return x.view(kb, bk, nb, bn)


def bw_masks(
    scores: Sequence[torch.Tensor],
    sparsity: float,
    block: tuple[int, int] = (32, 32),
    min_density: float = 0.0,
) -> list[torch.Tensor]:
    """Block-wise masks: ``bk × bn`` blocks (edge blocks clipped) score the RMS of their
    scores, ``‖S_block‖₂ / sqrt(size)``, and are kept or pruned whole, one threshold across
    layers."""
    for i, s in enumerate(scores):
        _check_scores(s, f"scores[{i}]")
    _check_sparsity(sparsity)
    _check_density(min_density)
    bk, bn = block
    if bk <= 0 or bn <= 0:
        raise ValueError(f"block must be positive (bk, bn), got {block!r}")
    shapes = [(int(s.shape[0]), int(s.shape[1])) for s in scores]
    b_scores, b_sizes = [], []
    for s in scores:
        sq = _block_view(s.double() ** 2, bk, bn).sum(dim=(1, 3))
        size = _block_view(torch.ones_like(s, dtype=torch.float64), bk, bn).sum(dim=(1, 3))
        b_scores.append((sq.sqrt() / size.sqrt()).flatten())
        b_sizes.append(size.flatten().to(torch.int64))
    keep = select_units(b_scores, b_sizes, _budget(shapes, sparsity), _floors(shapes, min_density))
    out = []
    for (k, n), kb in zip(shapes, keep):
        nb = -(-n // bn)
        grid = kb.view(-1, nb)
        out.append(grid.repeat_interleave(bk, 0).repeat_interleave(bn, 1)[:k, :n].contiguous())
    return out


def bw_mask(
    scores: torch.Tensor, sparsity: float, block: tuple[int, int] = (32, 32)
) -> torch.Tensor:
    """One layer of :func:`bw_masks`.

    >>> S = torch.tensor([[9., 9, 1], [9, 9, 1], [1, 1, 8]])
    >>> print(render_mask(bw_mask(S, 0.5, block=(2, 2))))
    x x .
    x x .
    . . .
    """
    return bw_masks([scores], sparsity, block)[0]


# -- dispatch and helpers -------------------------------------------------------------------
def masks_for_config(
    config: TileSparseConfig,
    scores: Sequence[torch.Tensor],
    sparsity: float,
    min_density: float | None = None,
) -> list[torch.Tensor]:
    """The masks ``config.pattern`` gives the layers ``scores`` at ``sparsity`` under one
    threshold (``nm`` ignores ``sparsity`` except that 0 keeps everything).

    Args:
        config: the pattern and its settings.
        scores: per layer ``(K_l, N_l)`` float, non-negative.
        sparsity: target over all the layers, in [0, 1).
        min_density: per-layer floor on the kept fraction; ``None`` (default):
            ``config.min_layer_density`` when two or more layers share the threshold, 0 for a
            single layer (pruned alone, it reaches ``sparsity``: a floor would only cap it).

    Returns:
        per layer ``(K_l, N_l) bool``, the kept weights.
    """
    if min_density is None:
        floor = config.min_layer_density if len(scores) > 1 else 0.0
    else:
        floor = min_density
    p = config.pattern
    if sparsity == 0.0:
        return [torch.ones(s.shape, dtype=torch.bool) for s in scores]
    if p is Pattern.TW:
        return tw_masks(scores, sparsity, config.tile_width, config.share, floor)
    if p is Pattern.TW_ROWS:
        return tw_rows_masks(scores, sparsity, config.tile_width, floor)
    if p is Pattern.TEW:
        delta = min(config.tew_delta, sparsity)  # early stages: never restore more than pruned
        return tew_masks(scores, sparsity, config.tile_width, delta, config.share, floor)
    if p is Pattern.EW:
        return ew_masks(scores, sparsity, floor)
    if p is Pattern.NM:
        return [nm_mask(s, config.n, config.m) for s in scores]
    if p is Pattern.BW:
        return bw_masks(scores, sparsity, config.block, floor)
    raise ValueError(f"unknown pattern {p!r}")


def is_tile_wise(mask_kn: torch.Tensor, tile: int) -> bool:
    """Whether a ``(K, N) bool`` mask has the structure :func:`tw_masks` makes: its kept
    columns, in order, ``tile`` at a time, share one row set per tile (tiles that lost every
    row having dropped out). Checked with the greedy grouping of
    :func:`tilesparse.format.tile_groups`: every tile but the last must be ``tile`` wide."""
    widths = [len(cols) for cols, _ in tile_groups(mask_kn, tile)]
    return all(w == tile for w in widths[:-1])


def render_mask(mask_kn: torch.Tensor) -> str:
    """Draw a ``(K, N) bool`` mask: one line per k, ``x`` kept, ``.`` pruned."""
    return "\n".join(" ".join("x" if v else "." for v in row) for row in mask_kn.tolist())
