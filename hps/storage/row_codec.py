"""How one table's rows are stored in a tier: ``dim`` values in a :class:`~hps.rowformat.RowDtype`,
``row_bytes`` bytes each (the layouts of :mod:`hps.rowformat`, FBGEMM's), with the numpy
encode / decode every tier uses at its float32 edge.

Rows move between tiers as these bytes (``lookup_rows`` / ``insert_rows`` of the backends, the
cache's ``storage``), never through float32, so a quantized row read from Redis, RocksDB, the
hash map or the cache is the same bytes. Float32 appears where a caller hands rows in
(``insert``: quantized here) or takes them out (``lookup``: dequantized here)::

    float32 (n, dim) ──encode──▶ (n, row_bytes) uint8 ──decode──▶ float32 (n, dim)
    INT8, dim = 4:   [0.0, 1.0, 2.0, 3.0]  →  scale 3/255 · bias 0 · q [0, 85, 170, 255]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hps.rowformat import RowDtype, dequantize_rows, quantize_rows, row_bytes

__all__ = ["RowCodec"]


@dataclass(frozen=True)
class RowCodec:
    """One table's stored rows: ``dim`` values as ``dtype``.

    Raises:
        ValueError: (:func:`hps.rowformat.row_bytes`) a dim the dtype cannot pack (INT4 and
            INT2 need a dim divisible by 2 and 4), naming ``what``.
    """

    dim: int
    dtype: RowDtype = RowDtype.FP32
    what: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", RowDtype(self.dtype))
        row_bytes(self.dtype, self.dim, self.what)  # checks the dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (512 / 256 / 132 / 68 at ``dim = 128``)."""
        return row_bytes(self.dtype, self.dim, self.what)

    def check_stored(self, rows: object, n: int, where: str) -> np.ndarray:
        """``rows`` as the ``(n, row_bytes) uint8`` array a tier stores as they are, or a
        ``ValueError`` naming ``where`` (the tier and table), the layout and what came."""
        rb = self.row_bytes
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.shape != (n, rb):
            got = (
                f"{rows.dtype} {rows.shape}"
                if isinstance(rows, np.ndarray)
                else type(rows).__name__
            )
            raise ValueError(
                f"{where}: {self.dtype.value} rows of dim {self.dim} must be ({n}, {rb}) uint8, "
                f"got {got}"
            )
        return rows

    def encode(self, values: np.ndarray) -> np.ndarray:
        """``values (n, dim) float32`` → ``(n, row_bytes) uint8`` (FP32: a view, no copy).

        Raises:
            hps.rowformat.RowFormatError: a row the dtype cannot hold (non-finite, or out of
                float16's range for a scale or bias), naming the table.
        """
        if self.dtype is RowDtype.FP32:
            return np.ascontiguousarray(values, dtype=np.float32).view(np.uint8)
        w = torch.from_numpy(np.ascontiguousarray(values, np.float32))
        q = quantize_rows(w, self.dtype, self.what)
        return q.numpy()

    def decode(self, rows: np.ndarray) -> np.ndarray:
        """``rows (n, row_bytes) uint8`` → ``(n, dim) float32`` (FP32: a view, no copy)."""
        if self.dtype is RowDtype.FP32:
            return np.ascontiguousarray(rows).view(np.float32)
        r = torch.from_numpy(np.ascontiguousarray(rows))
        return dequantize_rows(r, self.dtype, self.dim, self.what).numpy()
