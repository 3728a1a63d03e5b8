"""The condensed tile-wise (TW) weight format: the one contract between the pruner
(`tilesparse.linear`), the CPU kernels (`tilesparse.kernels.cpu`) and the CUTLASS kernels
(`cutlass_kernels.reference`, which reads these tensors without importing this module).

A linear layer computes ``Y = X · W`` with ``W`` of shape ``K × N`` (in-features ×
out-features; ``nn.Linear.weight`` is ``W.T``). After TW pruning some output columns are gone
entirely, and the kept columns are grouped into *tiles* of at most ``G`` consecutive kept
columns that share one set of kept K rows. Each tile is a small dense GEMM::

    Y[:, cols_t] = X[:, rows_t] · B_t          B_t = W[rows_t][:, cols_t]   (R_t × G_t)

Worked example, K=4, N=6, G=2 (``x`` = kept, ``.`` = pruned)::

            n=0 1 2 3 4 5
      k=0     x x . . x .       kept columns 0 1 4 5 (2 and 3 pruned whole)
      k=1     . . . . x x       tile 0: cols {0,1}, both with rows {0,2,3}
      k=2     x x . . . x       tile 1: col  {4},   rows {0,1}
      k=3     x x . . . .       tile 2: col  {5},   rows {1,2} (row set differs from col 4)

    col_idx  = [0, 1, 4, 5]                  (Nk,)  int64, ascending
    tile_ptr = [0, 2, 3, 4]                  (T+1,) int64: tile t = col_idx[tile_ptr[t]:tile_ptr[t+1]]
    row_idx  = [0, 2, 3,  0, 1,  1, 2]       (R,)   int64, ascending within a tile
    row_ptr  = [0, 3, 5, 7]                  (T+1,) int64: tile t rows = row_idx[row_ptr[t]:row_ptr[t+1]]
    val_ptr  = [0, 6, 8, 10]                 (T+1,) int64: block t = values[val_ptr[t]:val_ptr[t+1]]
    values   = [W00 W01 W20 W21 W30 W31 | W04 W14 | W15 W25]   block t row-major, shape (R_t, G_t)

A pruner that tiles exactly (every tile ``G`` wide, one row set each) gives tiles of width
``G`` except the last; :func:`condense` accepts any mask and finds the tiles greedily
(consecutive kept columns with an identical row set, at most ``G`` per tile), so a tile that
lost every row simply disappears and its columns are zero in ``Y``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TWLayout", "condense", "reference_matmul", "tile_groups"]


@dataclass
class TWLayout:
    """A condensed TW weight (see the module docstring for a drawn example).

    Attributes:
        in_features: ``K``.
        out_features: ``N``.
        tile: ``G``, the widest a tile may be (an integer >= 1).
        col_idx: ``(Nk,) int64`` kept output columns, ascending.
        tile_ptr: ``(T+1,) int64`` offsets into ``col_idx``.
        row_idx: ``(R,) int64`` kept input rows of every tile, ascending within a tile.
        row_ptr: ``(T+1,) int64`` offsets into ``row_idx``.
        values: ``(V,)`` the blocks, flattened; block ``t`` is ``(R_t, G_t)`` row-major.
        val_ptr: ``(T+1,) int64`` offsets into ``values``; ``val_ptr[t+1]-val_ptr[t] = R_t·G_t``.
        cache: backend-private derived data (not part of the format).
    """

    in_features: int
    out_features: int
    tile: int
    col_idx: torch.Tensor
    tile_ptr: torch.Tensor
    row_idx: torch.Tensor
    row_ptr: torch.Tensor
    values: torch.Tensor
    val_ptr: torch.Tensor
    # Derived data a backend may keep beside the layout, keyed by backend name. Never part of
    # the format, and nothing here clears it: an in-place edit of the tensors leaves it stale,
    # so whoever edits them clears it (TileSparseLinear builds a new layout, with an empty
    # cache, after .to()/load_state_dict/set_layout). The CUDA backend keeps its packed weights
    # elsewhere, keyed on the tensors' identity and version (tilesparse.kernels.cuda).
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tiles(self) -> int:
        return int(self.tile_ptr.numel()) - 1

    def block(self, t: int) -> torch.Tensor:
        """Tile ``t``'s dense block, ``(R_t, G_t)``, a view into ``values``."""
        r = int(self.row_ptr[t + 1] - self.row_ptr[t])
        g = int(self.tile_ptr[t + 1] - self.tile_ptr[t])
        return self.values[int(self.val_ptr[t]) : int(self.val_ptr[t + 1])].view(r, g)

    def tile_cols(self, t: int) -> torch.Tensor:
        return self.col_idx[int(self.tile_ptr[t]) : int(self.tile_ptr[t + 1])]

    def tile_rows(self, t: int) -> torch.Tensor:
        return self.row_idx[int(self.row_ptr[t]) : int(self.row_ptr[t + 1])]

    @property
    def nnz(self) -> int:
        """Stored weight values (``V``)."""
        return int(self.values.numel())

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.in_features * self.out_features)

    def index_bytes(self) -> int:
        """Bytes of index metadata (everything but ``values``)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.col_idx, self.tile_ptr, self.row_idx, self.row_ptr, self.val_ptr)
        )

    def to_dense(self) -> torch.Tensor:
        """The ``(K, N)`` weight with pruned entries zero; exact inverse of :func:`condense`
        on the kept entries."""
        w = torch.zeros(self.in_features, self.out_features, dtype=self.values.dtype)
        for t in range(self.num_tiles):
            rows, cols = self.tile_rows(t), self.tile_cols(t)
            if rows.numel() and cols.numel():
                w[rows.unsqueeze(1), cols.unsqueeze(0)] = self.block(t)
        return w

    def mask(self) -> torch.Tensor:
        """The ``(K, N) bool`` mask of stored entries."""
        m = torch.zeros(self.in_features, self.out_features, dtype=torch.bool)
        for t in range(self.num_tiles):
            rows, cols = self.tile_rows(t), self.tile_cols(t)
            m[rows.unsqueeze(1), cols.unsqueeze(0)] = True
        return m

    def validate(self) -> None:
        """Check every invariant of the format (vectorised: a few tensor ops, whatever ``T``).

        Raises:
            ValueError: naming the broken invariant and the offending value.
        """
        K, N = self.in_features, self.out_features
        if isinstance(self.tile, bool) or not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"TWLayout.tile must be an integer >= 1, got {self.tile!r}")
        for name in ("col_idx", "tile_ptr", "row_idx", "row_ptr", "val_ptr"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(
                    f"TWLayout.{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}"
                )
        if self.values.dim() != 1:
            raise ValueError(f"TWLayout.values must be 1-D, got shape {tuple(self.values.shape)}")
        T = self.num_tiles
        if T < 0 or self.row_ptr.numel() != T + 1 or self.val_ptr.numel() != T + 1:
            raise ValueError(
                f"TWLayout: tile_ptr, row_ptr, val_ptr must all have T+1 >= 1 entries, got "
                f"{self.tile_ptr.numel()}, {self.row_ptr.numel()}, {self.val_ptr.numel()}"
            )
        if self.col_idx.numel() and (int(self.col_idx.min()) < 0 or int(self.col_idx.max()) >= N):
            raise ValueError(f"TWLayout.col_idx out of range [0, {N})")
        bad = _first_not_ascending(self.col_idx)
        if bad is not None:
            raise ValueError(
                f"TWLayout.col_idx must be strictly ascending, but col_idx[{bad + 1}]="
                f"{int(self.col_idx[bad + 1])} follows col_idx[{bad}]={int(self.col_idx[bad])}"
            )
        if self.row_idx.numel() and (int(self.row_idx.min()) < 0 or int(self.row_idx.max()) >= K):
            raise ValueError(f"TWLayout.row_idx out of range [0, {K})")
        for name in ("tile_ptr", "row_ptr", "val_ptr"):
            problem = _pointer_problem(name, getattr(self, name))
            if problem:
                raise ValueError(f"TWLayout.{problem}")
        if (
            int(self.tile_ptr[-1]) != self.col_idx.numel()
            or int(self.row_ptr[-1]) != self.row_idx.numel()
        ):
            raise ValueError("TWLayout: tile_ptr/row_ptr must end at len(col_idx)/len(row_idx)")
        if int(self.val_ptr[-1]) != self.values.numel():
            raise ValueError("TWLayout: val_ptr must end at len(values)")
        widths = self.tile_ptr[1:] - self.tile_ptr[:-1]
        heights = self.row_ptr[1:] - self.row_ptr[:-1]
        if bool((widths > self.tile).any()) or bool((widths <= 0).any()):
            raise ValueError(f"TWLayout: every tile must hold 1..{self.tile} columns")
        if not torch.equal(self.val_ptr[1:] - self.val_ptr[:-1], widths * heights):
            raise ValueError(
                "TWLayout: block sizes (val_ptr) must equal rows × columns of each tile"
            )
        t = _first_tile_with_unsorted_rows(self.row_idx, self.row_ptr)
        if t is not None:
            raise ValueError(
                f"TWLayout: tile {t} rows must be strictly ascending, got {self.tile_rows(t).tolist()}"
            )


def _pointer_problem(name: str, ptr: torch.Tensor) -> str | None:
    """What is wrong with an offsets array (``tile_ptr``/``row_ptr``/``val_ptr``, ``(T+1,)
    int64``, ``T+1 >= 1``): ``None`` when it starts at 0 and never decreases, else a message
    naming ``name`` and the first bad entry."""
    if int(ptr[0]) != 0:
        return f"{name} must start at 0, got {name}[0]={int(ptr[0])}"
    drops = torch.nonzero(ptr[1:] < ptr[:-1])
    if drops.numel():
        i = int(drops[0])
        return f"{name} must never decrease, got {name}[{i + 1}]={int(ptr[i + 1])} < {name}[{i}]={int(ptr[i])}"
    return None


def _first_not_ascending(v: torch.Tensor) -> int | None:
    """The first ``i`` with ``v[i+1] <= v[i]`` of a ``(n,)`` tensor, or ``None`` when it is
    strictly ascending."""
    bad = torch.nonzero(v[1:] <= v[:-1])
    return int(bad[0]) if bad.numel() else None


def _first_tile_with_unsorted_rows(row_idx: torch.Tensor, row_ptr: torch.Tensor) -> int | None:
    """The first tile whose rows are not strictly ascending, or ``None``.

    Args:
        row_idx: ``(R,) int64``.
        row_ptr: ``(T+1,) int64``, valid (starts at 0, never decreases, ends at ``R``).
    """
    R = row_idx.numel()
    if R < 2:
        return None
    up = row_idx[1:] > row_idx[:-1]  # (R-1,): pair (j, j+1)
    starts = row_ptr[1:-1]
    up[starts[(starts > 0) & (starts < R)] - 1] = True  # a pair across two tiles may go down
    bad = torch.nonzero(~up)
    if not bad.numel():
        return None
    return int(torch.searchsorted(row_ptr, bad[0] + 1, right=True)) - 1


def tile_groups(mask_kn: torch.Tensor, tile: int) -> list[tuple[list[int], torch.Tensor]]:
    """Group the kept columns of a ``(K, N) bool`` mask into tiles.

    Returns:
        a list of ``(cols, rows)``: ``cols`` at most ``tile`` consecutive kept columns whose
        row sets are identical, ``rows`` that set as a ``(R,) int64`` tensor.
    """
    if mask_kn.dim() != 2 or mask_kn.dtype != torch.bool:
        raise ValueError(
            f"mask must be a 2-D bool tensor, got {mask_kn.dtype} {tuple(mask_kn.shape)}"
        )
    if tile <= 0:
        raise ValueError(f"tile must be > 0, got {tile}")
    kept = torch.nonzero(mask_kn.any(dim=0)).flatten().tolist()
    groups: list[tuple[list[int], torch.Tensor]] = []
    cur: list[int] = []  # the open tile's columns; cur_col their shared row set
    cur_col = torch.zeros(0, dtype=torch.bool)
    for c in kept:
        col = mask_kn[:, c]
        if cur and len(cur) < tile and torch.equal(col, cur_col):
            cur.append(c)
            continue
        if cur:
            groups.append((cur, torch.nonzero(cur_col).flatten()))
        cur, cur_col = [c], col
    if cur:
        groups.append((cur, torch.nonzero(cur_col).flatten()))
    return groups


def condense(weight_kn: torch.Tensor, mask_kn: torch.Tensor, tile: int) -> TWLayout:
    """Condense a masked ``(K, N)`` weight into a :class:`TWLayout`.

    Args:
        weight_kn: ``(K, N)`` float weight (``nn.Linear.weight.T``).
        mask_kn: ``(K, N) bool``; entries kept. Any mask is accepted; a TW-structured one
            gives few wide tiles.
        tile: ``G``, the widest a tile may be (> 0).

    Returns:
        the layout; ``layout.to_dense()`` equals ``weight_kn * mask_kn`` exactly.

    Raises:
        ValueError: for mismatched shapes, a non-bool mask or ``tile <= 0``.
    """
    if weight_kn.dim() != 2 or weight_kn.shape != mask_kn.shape:
        raise ValueError(
            f"weight and mask must be 2-D of one shape, got {tuple(weight_kn.shape)} and {tuple(mask_kn.shape)}"
        )
    K, N = weight_kn.shape
    w = weight_kn.detach().cpu()
    groups = tile_groups(mask_kn.cpu(), tile)
    col_idx: list[int] = []
    tile_ptr, row_ptr, val_ptr = [0], [0], [0]
    rows_all: list[torch.Tensor] = []
    blocks: list[torch.Tensor] = []
    for cols, rows in groups:
        col_idx.extend(cols)
        tile_ptr.append(len(col_idx))
        rows_all.append(rows)
        row_ptr.append(row_ptr[-1] + rows.numel())
        block = w[rows.unsqueeze(1), torch.tensor(cols).unsqueeze(0)].contiguous()
        blocks.append(block.flatten())
        val_ptr.append(val_ptr[-1] + block.numel())
    i64 = torch.int64
    layout = TWLayout(
        in_features=K,
        out_features=N,
        tile=tile,
        col_idx=torch.tensor(col_idx, dtype=i64),
        tile_ptr=torch.tensor(tile_ptr, dtype=i64),
        row_idx=torch.cat(rows_all).to(i64) if rows_all else torch.zeros(0, dtype=i64),
        row_ptr=torch.tensor(row_ptr, dtype=i64),
        values=torch.cat(blocks) if blocks else torch.zeros(0, dtype=w.dtype),
        val_ptr=torch.tensor(val_ptr, dtype=i64),
    )
    return layout


def reference_matmul(
    x: torch.Tensor, layout: TWLayout, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``Y = X · W`` from the condensed layout, tile by tile, in pure torch: the reference that
    every fast path is tested against.

    Args:
        x: ``(..., K)`` activations.
        layout: the condensed weight.
        bias: optional ``(N,)``.

    Returns:
        ``(..., N)`` in ``x.dtype``; pruned columns are zero (plus bias).
    """
    if x.shape[-1] != layout.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {layout.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), layout.in_features)
    y = x2.new_zeros(x2.shape[0], layout.out_features)
    vals = layout.values.to(device=x.device, dtype=x.dtype)
    for t in range(layout.num_tiles):
        rows = layout.tile_rows(t).to(x.device)
        cols = layout.tile_cols(t).to(x.device)
        r, g = rows.numel(), cols.numel()
        if r == 0:
            continue
        block = vals[int(layout.val_ptr[t]) : int(layout.val_ptr[t + 1])].view(r, g)
        y[:, cols] = x2[:, rows] @ block
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, layout.out_features)
