"""Row-sparse embedding updates in pure torch: the gradient of a bag lookup reduced to the
distinct rows it touched, and the optimizers applied to those rows only.

This is the reference every fast kernel (FBGEMM's, :mod:`embark.training.fbgemm_tables`) is
tested against. For a batch of ``B`` bags over a ``(num_rows, dim)`` table::

    ids     (nnz,)   int64   the looked-up rows, bag after bag
    offsets (B,)     int64   start of each bag in ids (bag b = ids[offsets[b]:offsets[b+1]])
    grad    (B, dim) float32 dLoss/d(pooled bag)

    ids = [1, 1, 3 | | 5 1]      offsets = [0, 3, 3]      (bag 1 empty)
    rows      = [1, 3, 5]                                 distinct ids, sorted
    row_grads = [2 g0 + g2, g0, g2]                       (sum pooling; mean divides g_b by
                                                           bag b's length first)

Update of a touched row ``r`` with gradient ``g`` (``(dim,)``); rows not in ``rows`` are not
read or written, so the cost is ``O(nnz · dim)`` whatever ``num_rows`` is:

- ``adagrad``:         ``s[r] += g²``,          ``w[r] -= lr · g / (sqrt(s[r]) + eps)``
  (``s`` is ``(num_rows, dim)``; exactly ``torch.optim.Adagrad`` on the dense gradient, whose
  other rows are zero and would not move)
- ``rowwise_adagrad``: ``s[r] += mean(g²)``,    ``w[r] -= lr · g / (sqrt(s[r]) + eps)``
  (``s`` is ``(num_rows,)``; FBGEMM's and TorchRec's ``EXACT_ROWWISE_ADAGRAD``; for an
  FP16/BF16 table ``mean(g²)`` is summed in the compiled kernel's fixed order,
  :func:`row_mean_squares`, and square roots are correctly rounded, so the two paths agree
  bit for bit)
- ``sgd``:             ``w[r] -= lr · g``

An FP16 or BF16 table (``TrainConfig.table_dtype``) is updated in float32 (the touched rows
read as float32, the state float32) and the new rows rounded back to the storage dtype: to
nearest (what FBGEMM's CPU kernel does) or stochastically (unbiased: ``E[round(x)] = x``, what
FBGEMM's CUDA kernels do by default; :mod:`embark.training.rounding`, with the update's
counter-based bits). :mod:`embark.training.half_kernel` is the compiled fused form of the
stochastic update, tested against this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embark.training.config import EmbeddingOptimizerKind, TableRounding
from embark.training.rounding import counter_bits, stochastic_round

#: touched rows updated per chunk by an FP16/BF16 table's update (1 MiB of float32 at
#: dim 128): the float32 copies stay cache-sized
ROWS_PER_CHUNK = 2048

#: optimizer state of a table per update kind: state key -> whether it is per weight
#: (``(num_rows, dim)``) or per row (``(num_rows,)``). The keys name the state the same way
#: for a whole table and for any shard of it.
STATE_KEYS: dict[EmbeddingOptimizerKind, dict[str, bool]] = {
    EmbeddingOptimizerKind.ADAGRAD: {"sum": True},
    EmbeddingOptimizerKind.ROWWISE_ADAGRAD: {"row_sum": False},
    EmbeddingOptimizerKind.SGD: {},
}


@dataclass(frozen=True)
class RowOptimizer:
    """One table's row update (see the module docstring).

    Args:
        kind: the update.
        lr: learning rate.
        eps: Adagrad's denominator epsilon.
        initial_accumulator_value: Adagrad's starting sum.
    """

    kind: EmbeddingOptimizerKind
    lr: float
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def new_state(self, num_rows: int, dim: int) -> dict[str, torch.Tensor]:
        """Fresh state: ``{key: (num_rows, dim) or (num_rows,) float32}`` (:data:`STATE_KEYS`)."""
        out: dict[str, torch.Tensor] = {}
        for key, per_weight in STATE_KEYS[self.kind].items():
            shape = (num_rows, dim) if per_weight else (num_rows,)
            out[key] = torch.full(shape, float(self.initial_accumulator_value))
        return out

    @torch.no_grad()
    def apply_(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
        rounding: TableRounding = TableRounding.NEAREST,
        key: int = 0,
    ) -> None:
        """Update ``weight`` (``(num_rows, dim)``) and ``state`` in place at ``rows``.

        Args:
            rows: ``(U,) int64`` distinct row indices.
            grads: ``(U, dim)`` their gradients.
            rounding: how an FP16/BF16 ``weight``'s new rows are rounded (a float32 weight is
                written as computed).
            key: stochastic rounding's key, ``[0, 2^63)``: the bits of row ``r``, column
                ``c`` are :func:`~embark.training.rounding.counter_bits` ``(key, r, c)``.
        """
        if rows.numel() == 0:
            return
        if weight.dtype != torch.float32:
            self._apply_low_precision(weight, state, rows, grads, rounding, key)
            return
        grads = grads.to(weight.dtype)
        if self.kind is EmbeddingOptimizerKind.SGD:
            weight.index_add_(0, rows, grads, alpha=-self.lr)
            return
        std = self._adagrad_std(state, rows, grads, kernel_order=False)
        weight[rows] = weight[rows].addcdiv_(grads, std, value=-self.lr)

    def _adagrad_std(
        self,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
        kernel_order: bool,
    ) -> torch.Tensor:
        """Add the rows' squared gradients to their (row-wise) Adagrad state and return the
        step's divisor, ``sqrt(state) + eps`` (``(n, dim)``, or ``(n, 1)`` row-wise).

        ``kernel_order`` (FP16/BF16 tables): the compiled kernel's operations, bit for bit —
        row-wise ``mean(g²)`` by :func:`row_mean_squares`, square roots correctly rounded.
        Otherwise (float32 tables, which no compiled kernel of ours updates) torch's ``mean``
        and ``sqrt``, about 2x and 4x faster."""
        sqrt = _sqrt_f32 if kernel_order else torch.sqrt
        if self.kind is EmbeddingOptimizerKind.ADAGRAD:
            s = state["sum"]
            acc = s[rows].addcmul_(grads, grads)
            s[rows] = acc
            return sqrt(acc).add_(self.eps)
        s = state["row_sum"]
        acc = s[rows] + (row_mean_squares(grads) if kernel_order else grads.square().mean(dim=1))
        s[rows] = acc
        return sqrt(acc).add_(self.eps).unsqueeze(1)

    def _apply_low_precision(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
        rounding: TableRounding,
        key: int,
    ) -> None:
        """:meth:`apply_` of an FP16/BF16 weight: the rows updated in float32, then rounded
        (to nearest, or :func:`~embark.training.rounding.stochastic_round` with
        :func:`~embark.training.rounding.counter_bits`), :data:`ROWS_PER_CHUNK` rows at a time
        so no float32 copy of all touched rows is held."""
        grads = grads.float()
        std = (
            None
            if self.kind is EmbeddingOptimizerKind.SGD
            else self._adagrad_std(state, rows, grads, kernel_order=True)
        )
        # FBGEMM's CPU kernel (fbgemm-gpu-cpu 1.8, measured) rounds an SGD or exact Adagrad
        # step to float16 before adding it to the row
        half_step = (
            rounding is TableRounding.NEAREST
            and weight.dtype == torch.float16
            and self.kind is not EmbeddingOptimizerKind.ROWWISE_ADAGRAD
        )
        for start in range(0, rows.numel(), ROWS_PER_CHUNK):
            part = slice(start, start + ROWS_PER_CHUNK)
            at = rows[part]
            g = grads[part]
            delta = g.mul(-self.lr) if std is None else g.div(std[part]).mul_(-self.lr)
            if half_step:
                delta = delta.half().float()
            w = weight.index_select(0, at).float().add_(delta)
            weight.index_copy_(0, at, round_rows(w, weight.dtype, rounding, key, at))


def round_rows(
    values: torch.Tensor, dtype: torch.dtype, rounding: TableRounding, key: int, rows: torch.Tensor
) -> torch.Tensor:
    """The new rows ``values`` (``(n, dim)`` float32) of a table's ``rows`` (``(n,) int64``)
    rounded to the table's ``dtype`` (float16 / bfloat16): to nearest (``values.to(dtype)``),
    or :func:`~embark.training.rounding.stochastic_round` with the update's
    :func:`~embark.training.rounding.counter_bits` ``(key, rows, dim)``. On ``values``'
    device (the bits are computed on the CPU and moved there)."""
    if rounding is TableRounding.NEAREST:
        return values.to(dtype)
    bits = counter_bits(key, rows, values.shape[1]).to(values.device)
    return stochastic_round(values, dtype, bits)


def _sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """IEEE float32 square root of ``x`` (the compiled kernel's ``sqrt``): taken in float64 and
    rounded, which is the correctly rounded float32 result. torch's float32 ``sqrt`` on CPU
    is off by one unit in the last place for some inputs (measured, torch 2.13), so the two
    paths would differ."""
    return x.double().sqrt_().to(x.dtype)


#: lanes of :func:`row_mean_squares`' partial sums (the compiled kernel's: one AVX2 register)
SQUARE_LANES = 8


def row_mean_squares(grads: torch.Tensor) -> torch.Tensor:
    """``mean(g²)`` of each row of ``grads`` ``(n, dim)`` float32 → ``(n,)``, summed in the
    order the compiled kernel (``embark/csrc/half_rows.cpp``, ``sum_squares``) sums it, so
    both give the same float32 bits:

    1. the squares ``q = g · g``;
    2. 8 lanes, lane ``l`` the sum of ``q[8j + l]`` over the whole groups of 8, ``j`` rising;
    3. the lanes added pairwise: ``((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))``;
    4. the tail ``q[8 · (dim // 8):]`` added value by value, in order;
    5. divided by ``dim``.

    Every step is one elementwise float32 operation (torch's ``mean`` reduces in an order of
    its own, which differs in the last bits).
    """
    q = grads * grads
    dim = q.shape[1]
    whole = dim - dim % SQUARE_LANES
    lanes = q.new_zeros(q.shape[0], SQUARE_LANES)
    for j in range(0, whole, SQUARE_LANES):
        lanes.add_(q[:, j : j + SQUARE_LANES])
    p = lanes.unbind(1)
    total = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    for d in range(whole, dim):
        total.add_(q[:, d])
    return total.div_(dim)


def row_gradients(
    grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mean: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of a bag lookup, reduced to the distinct rows it touched.

    Args:
        grad: ``(B, dim)`` gradient of the pooled bags.
        ids: ``(nnz,)`` int64 (or int32) looked-up rows.
        offsets: ``(B,)`` start of each bag in ``ids``, ids' dtype.
        mean: bags were averaged (each id's gradient is its bag's divided by the bag length).

    Returns:
        ``(rows (U,) int64 sorted, row_grads (U, dim))``; ``U = 0`` for no ids.
    """
    batch, nnz = grad.shape[0], ids.numel()
    if nnz == 0:
        return ids.new_zeros(0, dtype=torch.int64), grad.new_zeros(0, grad.shape[1])
    ends = torch.cat([offsets[1:], offsets.new_tensor([nnz])])
    lengths = ends - offsets
    sample = torch.repeat_interleave(torch.arange(batch, device=ids.device), lengths)
    if mean:
        grad = grad / lengths.clamp(min=1).unsqueeze(1).to(grad.dtype)
    rows, inverse = torch.unique(ids.long(), return_inverse=True)
    row_grads = grad.new_zeros(rows.numel(), grad.shape[1]).index_add_(0, inverse, grad[sample])
    return rows, row_grads
