"""Embedding row formats: one definition of how a table row is stored, in bytes, for every
dtype the toolkit holds (a leaf: torch and numpy only; ``embark`` and ``export`` import it).

A table of ``N`` rows of ``D`` values in dtype ``t`` is an ``(N, row_bytes(t, D)) uint8``
tensor, rows back to back, no padding. The layouts are FBGEMM's
(``IntNBitTableBatchedEmbeddingBagsCodegen`` on CPU, ``row_alignment=1``,
``reverse_qparam=False``), so a table of ours is a valid FBGEMM weight buffer and back::

    dtype  bytes per row (D = 128)  row layout (byte offsets)
    fp32   4 D      (512)           [0, 4D)      D float32, little-endian
    fp16   2 D      (256)           [0, 2D)      D float16
    bf16   2 D      (256)           [0, 2D)      D bfloat16 (FBGEMM's inference TBE lacks it)
    int8   D + 4    (132)           [0, 2) scale float16 · [2, 4) bias float16 · [4, 4 + D) q
    int4   D/2 + 4  (68)            [0, 2) scale · [2, 4) bias · [4, 4 + D/2) two q per byte
    int2   D/4 + 4  (36)            [0, 2) scale · [2, 4) bias · [4, 4 + D/4) four q per byte

A quantized row's value ``j`` is ``scale * q_j + bias`` (float32 arithmetic), ``q_j`` an
unsigned integer of ``bits`` bits. ``q_j`` sits in byte ``4 + j // k`` (``k = 8 // bits``
values per byte), at bit ``(j % k) * bits``: the first value in the low bits. Worked example,
an int4 row of ``D = 4`` with scale 0.5 and bias -1 (values -1, -0.5, 0, 6.5 → q 0, 1, 2, 15)::

    byte   0     1     2     3     4            5
           00 38 00 bc ────────── 0x10 (q1=1, q0=0)  0xf2 (q3=15, q2=2)
           scale=0.5   bias=-1.0

FBGEMM on CUDA pads each row to 16 bytes (``row_alignment=16``); its standalone quantizer
(``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``) writes scale and bias at the *end* of the
row: :func:`scale_bias_to_front` turns those rows into ours.

Quantizing (:func:`quantize_rows`) takes each row's min and max: ``bias`` is the min rounded
*down* to float16 and ``scale`` is ``(max - bias) / (2**bits - 1)`` rounded *up* to float16
(1.0 for a constant row), so every value lies in ``[bias, bias + scale * (2**bits - 1)]`` and
``q = round((x - bias) / scale)`` is within ``scale / 2`` of it: the error bound holds by
construction. (FBGEMM's quantizer rounds both to nearest and clamps, which can move the row's
extremes by more than ``scale / 2``; its rows dequantize here exactly as there.)
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "SCALE_BIAS_BYTES",
    "RowDtype",
    "RowFormatError",
    "check_rows",
    "dequantize_rows",
    "quantize_rows",
    "read_row_file",
    "row_bytes",
    "scale_bias",
    "scale_bias_to_back",
    "scale_bias_to_front",
    "write_row_file",
]

#: Bytes of a quantized row's float16 scale and bias (FBGEMM's ``DEFAULT_SCALE_BIAS_SIZE_IN_BYTES``).
SCALE_BIAS_BYTES = 4

# Rows quantized at a time: bounds the float32 temporaries to ~32 MiB at D = 128.
_CHUNK_ROWS = 1 << 16


class RowDtype(StrEnum):
    """How one table's rows are stored (the module docstring draws each layout)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"

    @property
    def bits(self) -> int:
        """Bits per stored value."""
        return _BITS[self]

    @property
    def quantized(self) -> bool:
        """Whether rows carry a scale and bias (the integer dtypes)."""
        return self in (RowDtype.INT8, RowDtype.INT4, RowDtype.INT2)


_BITS = {
    RowDtype.FP32: 32,
    RowDtype.FP16: 16,
    RowDtype.BF16: 16,
    RowDtype.INT8: 8,
    RowDtype.INT4: 4,
    RowDtype.INT2: 2,
}
_FLOATS = {
    RowDtype.FP32: torch.float32,
    RowDtype.FP16: torch.float16,
    RowDtype.BF16: torch.bfloat16,
}
_QUANTIZED = (RowDtype.INT8, RowDtype.INT4, RowDtype.INT2)
_FP16_MAX = float(torch.finfo(torch.float16).max)


class RowFormatError(ValueError):
    """Rows that a dtype cannot hold, or stored bytes that are not rows of that dtype; the
    message names the table (and file) it was raised for."""


def _where(what: str) -> str:
    return f"{what}: " if what else ""


def row_bytes(dtype: RowDtype, dim: int, what: str = "") -> int:
    """Bytes of one ``dim``-wide row stored as ``dtype`` (512 / 256 / 256 / 132 / 68 / 36 at
    ``dim = 128`` for fp32 / fp16 / bf16 / int8 / int4 / int2).

    Args:
        what: names the table (and file) in an error.

    Raises:
        RowFormatError: when ``dim < 1``, or ``dim`` does not fill whole bytes of ``dtype``
            (int4 needs an even ``dim``, int2 a multiple of 4).
    """
    dtype = RowDtype(dtype)
    if dim < 1:
        raise RowFormatError(f"{_where(what)}row width must be >= 1, got {dim}")
    per_byte = 8 // dtype.bits if dtype.quantized else 1
    if dim % per_byte:
        raise RowFormatError(
            f"{_where(what)}{dtype.value} packs {per_byte} values per byte, so the row width "
            f"must be a multiple of {per_byte}; got {dim}"
        )
    if dtype.quantized:
        return dim // per_byte + SCALE_BIAS_BYTES
    return dim * dtype.bits // 8


def _round_fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``(n,) float32`` → ``(n,) float16`` rounded toward +inf (``up``) or -inf."""
    h = x.to(torch.float16)
    back = h.float()
    off = back < x if up else back > x
    if bool(off.any()):
        toward = torch.full_like(h[off], float("inf") if up else float("-inf"))
        h[off] = torch.nextafter(h[off], toward)
    return h


def _check_values(weight: torch.Tensor, dtype: RowDtype, what: str, first_row: int) -> None:
    """Every value finite and, for float16-based dtypes, within float16's range."""
    bad = ~torch.isfinite(weight)
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        raise RowFormatError(
            f"{_where(what)}row {first_row + r} holds {float(weight[r, c])} at column {c}; "
            f"{dtype.value} rows hold finite values only"
        )
    if weight.numel() == 0 or dtype not in (RowDtype.FP16, *_QUANTIZED):
        return
    # fp16 stores every value; an int row stores its min as a float16 bias (its span, as the
    # scale, is checked where it is computed)
    held = weight if dtype is RowDtype.FP16 else weight.amin(dim=1)
    peak = float(held.abs().max())
    if peak > _FP16_MAX:
        raise RowFormatError(
            f"{_where(what)}a {'value' if dtype is RowDtype.FP16 else 'row minimum'} of "
            f"magnitude {peak:g} does not fit {dtype.value} (float16 holds at most "
            f"{_FP16_MAX:g}); keep this table in a wider dtype"
        )


def _quantize_chunk(w: torch.Tensor, bits: int, what: str, first_row: int) -> torch.Tensor:
    """``(n, D) float32`` → ``(n, D * bits / 8 + 4) uint8`` rows (the module's layout)."""
    n, d = w.shape
    levels = (1 << bits) - 1
    lo, hi = torch.aminmax(w, dim=1)
    bias = _round_fp16(lo, up=False)
    span = hi - bias.float()
    scale = _round_fp16(span / levels, up=True)
    scale[span == 0] = 1.0
    if not bool(torch.isfinite(scale).all()):
        r = int((~torch.isfinite(scale)).nonzero()[0])
        raise RowFormatError(
            f"{_where(what)}row {first_row + r} spans {float(span[r]):g}: its int{bits} scale "
            "overflows float16; keep this table in a wider dtype"
        )
    q = torch.round((w - bias.float()[:, None]) / scale.float()[:, None])
    q = q.clamp_(0, levels).to(torch.uint8)
    per_byte = 8 // bits
    if per_byte > 1:
        shifts = torch.arange(per_byte, dtype=torch.uint8) * bits
        q = (q.view(n, d // per_byte, per_byte) << shifts).sum(-1, dtype=torch.uint8)
    out = torch.empty(n, SCALE_BIAS_BYTES + q.shape[1], dtype=torch.uint8)
    out[:, 0:2] = scale.view(torch.uint8).view(n, 2)
    out[:, 2:4] = bias.view(torch.uint8).view(n, 2)
    out[:, 4:] = q
    return out


def quantize_rows(weight: torch.Tensor, dtype: RowDtype, what: str = "") -> torch.Tensor:
    """Store a table's rows as ``dtype``.

    Args:
        weight: ``(N, D) float32`` rows (any float dtype is read as float32).
        dtype: the row format.
        what: names the table (and file) in an error, e.g. ``"table 't3'"``.

    Returns:
        ``(N, row_bytes(dtype, D)) uint8``, contiguous (the module's layout).

    Raises:
        RowFormatError: for a row width ``dtype`` cannot pack, a NaN or infinite value, or a
            value (or a quantized row's span) beyond float16's range for fp16 / int dtypes.
    """
    dtype = RowDtype(dtype)
    if weight.dim() != 2:
        raise RowFormatError(f"{_where(what)}rows must be (N, D), got shape {tuple(weight.shape)}")
    n, d = weight.shape
    width = row_bytes(dtype, d, what)
    out = torch.empty(n, width, dtype=torch.uint8)
    for a in range(0, n, _CHUNK_ROWS):
        w = weight[a : a + _CHUNK_ROWS].detach().to("cpu", torch.float32)
        _check_values(w, dtype, what, a)
        if dtype.quantized:
            out[a : a + _CHUNK_ROWS] = _quantize_chunk(w, dtype.bits, what, a)
        else:
            out[a : a + _CHUNK_ROWS] = w.to(_FLOATS[dtype]).view(torch.uint8)
    return out


def check_rows(rows: torch.Tensor, dtype: RowDtype, dim: int, what: str = "") -> None:
    """Check that ``rows`` are well-formed ``dim``-wide rows of ``dtype``: a 2-d uint8 tensor of
    the right width whose scales and biases (quantized dtypes) are finite.

    Raises:
        RowFormatError: naming ``what``, the expected and found width, or the first row whose
            scale or bias is NaN or infinite.
    """
    dtype = RowDtype(dtype)
    width = row_bytes(dtype, dim, what)
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise RowFormatError(
            f"{_where(what)}rows must be a 2-d uint8 tensor, got {rows.dtype} {tuple(rows.shape)}"
        )
    if rows.shape[1] != width:
        raise RowFormatError(
            f"{_where(what)}{dtype.value} rows of width {dim} are {width} bytes, "
            f"got {rows.shape[1]}-byte rows"
        )
    if dtype.quantized and rows.shape[0]:
        scale, bias = scale_bias(rows)
        bad = ~(torch.isfinite(scale) & torch.isfinite(bias))
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            raise RowFormatError(
                f"{_where(what)}row {r} has scale {float(scale[r])} and bias {float(bias[r])}; "
                "both must be finite (the row is corrupted)"
            )


def scale_bias(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale (N,) float16, bias (N,) float16)`` of quantized ``rows`` (copies)."""
    sb = rows[:, :SCALE_BIAS_BYTES].contiguous().view(torch.float16)
    return sb[:, 0].clone(), sb[:, 1].clone()


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """``(n, D * bits / 8) uint8`` packed values → ``(n, D) uint8``."""
    per_byte = 8 // bits
    if per_byte == 1:
        return data
    shifts = torch.arange(per_byte, dtype=torch.uint8) * bits
    mask = (1 << bits) - 1
    return ((data.unsqueeze(-1) >> shifts) & mask).flatten(1)


def dequantize_rows(rows: torch.Tensor, dtype: RowDtype, dim: int, what: str = "") -> torch.Tensor:
    """Rows of ``dtype`` back to ``(N, dim) float32`` (``scale * q + bias`` for int dtypes).

    Args:
        rows: ``(N, row_bytes(dtype, dim)) uint8``, e.g. a gather of a table's rows.

    Raises:
        RowFormatError: as :func:`check_rows` (shape only; scales are not scanned here).
    """
    dtype = RowDtype(dtype)
    width = row_bytes(dtype, dim, what)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != width:
        raise RowFormatError(
            f"{_where(what)}expected ({width}-byte) {dtype.value} rows of width {dim} as a 2-d "
            f"uint8 tensor, got {rows.dtype} {tuple(rows.shape)}"
        )
    if not dtype.quantized:
        return rows.contiguous().view(_FLOATS[dtype]).float()
    sb = rows[:, :SCALE_BIAS_BYTES].contiguous().view(torch.float16).float()
    q = _unpack(rows[:, SCALE_BIAS_BYTES:], dtype.bits).float()
    return torch.addcmul(sb[:, 1:2], q, sb[:, 0:1])


def scale_bias_to_front(rows: torch.Tensor) -> torch.Tensor:
    """FBGEMM's standalone quantizer rows (``[q..., scale, bias]``) → ours (``[scale, bias,
    q...]``), a copy: ``(N, W) uint8`` → ``(N, W) uint8``."""
    return torch.cat([rows[:, -SCALE_BIAS_BYTES:], rows[:, :-SCALE_BIAS_BYTES]], dim=1)


def scale_bias_to_back(rows: torch.Tensor) -> torch.Tensor:
    """Ours → FBGEMM's standalone quantizer layout (inverse of :func:`scale_bias_to_front`)."""
    return torch.cat([rows[:, SCALE_BIAS_BYTES:], rows[:, :SCALE_BIAS_BYTES]], dim=1)


def write_row_file(path: str | os.PathLike[str], rows: torch.Tensor) -> Path:
    """Write ``rows`` (``(N, W) uint8``) to ``path`` as raw bytes, row after row, published
    whole: written to a hidden sibling, then renamed over ``path``."""
    path = Path(path)
    staged = path.with_name(f".{path.name}.tmp")
    rows.contiguous().numpy().tofile(staged)
    staged.replace(path)
    return path


def read_row_file(
    path: str | os.PathLike[str], dtype: RowDtype, dim: int, table: str
) -> torch.Tensor:
    """Read a file of ``dim``-wide ``dtype`` rows written by :func:`write_row_file`.

    Returns:
        ``(N, row_bytes(dtype, dim)) uint8`` (a copy in memory), checked by
        :func:`check_rows`.

    Raises:
        RowFormatError: naming ``table`` and ``path``, when the file's length is not a whole
            number of rows, or a row's scale or bias is NaN or infinite.
    """
    path = Path(path)
    what = f"table {table!r} ({path})"
    width = row_bytes(dtype, dim, what)
    size = path.stat().st_size
    if size % width:
        raise RowFormatError(
            f"{what}: {size} bytes is not a whole number of {width}-byte {RowDtype(dtype).value} "
            f"rows of width {dim} (the file is truncated, or of another dtype or width)"
        )
    rows = torch.from_numpy(np.fromfile(path, dtype=np.uint8).reshape(size // width, width))
    check_rows(rows, dtype, dim, what)
    return rows
