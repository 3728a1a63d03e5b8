"""The largest embedding value an online update may carry: rows whose values are finite but
would overflow the served model's float32 arithmetic are refused like non-finite ones.

**The bound.** A value ``v`` is accepted when ``|v| ≤ sqrt(FLT_MAX / dim)`` for its table's
row width ``dim``: then the dot product of two such rows — the interaction a DLRM computes
between pooled embeddings (``dot``) and the first thing a DCN layer's products meet — stays
finite even with every element at the bound (``dim × bound² = FLT_MAX``)::

    dim        16        64        128       256
    bound      4.6e18    2.3e18    1.6e18    1.2e18

Rows anywhere near the bound are far outside what training produces (trained embedding
values are O(1)); the bound only refuses values that cannot be served, such as a diverged
trainer's ``3e38``. Pooling several rows or deeper layers can still overflow below it; the
server refuses a non-finite score (HTTP 422 / gRPC ``INVALID_ARGUMENT``) for that remainder.
"""

from __future__ import annotations

import math

import numpy as np

from hps.updates.record import InvalidUpdateError

__all__ = ["FLOAT32_MAX", "check_row_bound", "row_value_bound"]

FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e38


def row_value_bound(dim: int) -> float:
    """The largest ``|value|`` accepted in a row of ``dim`` values: ``sqrt(FLOAT32_MAX / dim)``."""
    return math.sqrt(FLOAT32_MAX / max(dim, 1))


def check_row_bound(keys: np.ndarray, rows: np.ndarray, what: str) -> None:
    """Refuse rows holding a value beyond :func:`row_value_bound` of their width.

    Args:
        keys: ``(n,) int64``, the rows' keys (to name the first bad one).
        rows: ``(n, dim) float32``, finite.
        what: how the message names the update (e.g. ``"update for 't0':"``).

    Raises:
        InvalidUpdateError: naming the first bad key, its value, the bound and how many rows.
    """
    if rows.size == 0:
        return
    bound = row_value_bound(rows.shape[1])
    peak = np.abs(rows).max(axis=1)
    bad = np.flatnonzero(peak > bound)
    if bad.size:
        raise InvalidUpdateError(
            f"{what} the row of key {int(keys[bad[0]])} holds {float(peak[bad[0]]):.6g}, beyond "
            f"the bound {bound:.6g} (sqrt(FLT_MAX / dim), dim {rows.shape[1]}) past which the "
            f"model's float32 arithmetic overflows; {bad.size} such row(s)"
        )
