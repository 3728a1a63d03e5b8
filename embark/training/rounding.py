"""Rounding float32 rows to an FP16 or BF16 table: to nearest, or stochastically from given
random bits — a float64 reference and the fast path used in training, equal bit for bit.

Stochastic rounding of a float32 ``x`` to a ``dtype`` with ``m`` mantissa bits: with ``ulp``
the dtype's spacing at ``|x|`` (its subnormal spacing below its smallest normal), ``lo`` the
representable magnitude at or below ``|x|`` and ``f = (|x| - lo) / ulp`` in ``[0, 1)``, one
random integer ``r`` of ``k`` bits per value (``k = 23 - m``: 13 for FP16, 16 for BF16)
decides::

    |result| = lo + ulp   if  round(f · 2^k) + r >= 2^k     (probability round(f · 2^k) / 2^k)
             = lo         otherwise;  the sign is x's

For every ``x`` in the dtype's normal range ``f · 2^k`` is an integer (the ``k`` low mantissa
bits of ``x`` that the dtype drops), so ``E[result] = x`` exactly; for an FP16 subnormal the
probability is ``f`` rounded to ``k`` bits (ties to even). A finite ``x`` never rounds to
``±inf``: a result beyond the dtype's largest finite value (FP16: 65504, so any ``|x| >
65504``, whose round-up is 65536) saturates to ``±max``, as FBGEMM's CUDA stochastic rounding
does (it converts ``x`` plus the random bits with ``__float2half_rz``, round toward zero, which
never overflows). ``±inf`` and NaN stay as they are. Rounding to nearest is ``x.to(dtype)``
(FBGEMM's CPU kernel's round-to-nearest-even), where ``|x| >= 65520`` is ``±inf`` as IEEE
rounding defines it.

Worked example (FP16, ``k = 13``): ``x = 1 + 0.25 · 2^-10`` has low bits ``0x0800`` (2048 of
8192), so it rounds up to ``1 + 2^-10`` for the 2048 values of ``r >= 8192 - 2048`` and down
to ``1`` otherwise — probability 1/4.

The fast path (:func:`stochastic_round`) is that rule on the float32 bit pattern: add ``r`` to
the magnitude bits and clear the ``k`` low bits (a carry is the round-up; a carry into the
exponent is the next binade), then convert exactly. Values outside the dtype's normal range
(FP16 subnormals, ``inf``, NaN) take the reference (:func:`stochastic_round_reference`) on that
handful.

The random bits of a table update are counter-based (:func:`counter_bits`): value ``(row,
col)`` of an update with key ``K`` (one 63-bit draw per update from the table's seeded
generator) takes bits of SplitMix64 words of ``(K, row, col // 4)``. So the bits are a function
of the key and the value's place alone — the compiled fused backward
(:mod:`embark.training.half_kernel`) and the pure-torch reference draw the same ones, whatever
the thread count, chunking or the order rows are visited in.
"""

from __future__ import annotations

import numpy as np
import torch

#: dtype -> (random bits per value k, mantissa bits, smallest normal exponent)
_SPEC: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float16: (13, 10, -14),
    torch.bfloat16: (16, 7, -126),
}


def _spec(dtype: torch.dtype) -> tuple[int, int, int]:
    try:
        return _SPEC[dtype]
    except KeyError:
        raise ValueError(f"stochastic rounding is to float16 or bfloat16, got {dtype}") from None


def rounding_bits(dtype: torch.dtype) -> int:
    """``k``: the random bits one value's stochastic rounding to ``dtype`` uses (13 FP16, 16
    BF16)."""
    return _spec(dtype)[0]


#: SplitMix64's increment (the golden ratio · 2^64) and its finalizer's multipliers
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def counter_bits(key: int, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """The rounding bits of an update with ``key`` at ``rows``: ``(U, dim) int32`` in
    ``[0, 2^16)``, whose :func:`rounding_bits` low bits are ``r``.

    Value ``(row, col)`` is the 16-bit lane ``col % 4`` (lowest first) of
    ``mix64(h + (col // 4 + 1) · G)`` with ``h = mix64(key ^ mix64(row + G))`` (``mix64``:
    SplitMix64's finalizer, ``G = 0x9E3779B97F4A7C15``, arithmetic mod 2^64): each row a
    SplitMix64 stream seeded by a hash of the key and the row. ``embark/csrc/half_rows.cpp``
    computes the same bits.

    Args:
        key: ``[0, 2^63)``.
        rows: ``(U,) int64`` row indices (any order, repeats allowed; ``U`` may be 0).
        dim: values per row.

    Returns:
        ``(U, dim) int32`` on the CPU, whatever ``rows``' device.
    """
    if not 0 <= key < 2**63:
        raise ValueError(f"rounding key must be in [0, 2^63), got {key}")
    r = rows.detach().cpu().numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _mix64(np.uint64(key) ^ _mix64(r + _GOLDEN))
        words = np.arange(1, (dim + 3) // 4 + 1, dtype=np.uint64) * _GOLDEN
        w = _mix64(h[:, None] + words[None, :])  # (U, words)
    # (U, 4 · words) lanes, lowest first; reshaped by count, so U = 0 gives (0, dim)
    lanes = w.astype("<u8").view("<u2").reshape(r.shape[0], 4 * w.shape[1])[:, :dim]
    return torch.from_numpy(lanes.astype(np.int32))


def stochastic_round_reference(
    values: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor
) -> torch.Tensor:
    """The module docstring's rule, computed in float64 from its definition (a finite
    value's result saturating at ``±torch.finfo(dtype).max``).

    Args:
        values: float32, any shape.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        bits: integers of ``values.numel()`` elements (any integer dtype); their ``k`` low
            bits are ``r`` (:func:`rounding_bits`).

    Returns:
        ``values``' shape, ``dtype``.
    """
    k, mant, emin = _spec(dtype)
    x = values.double()
    mag = x.abs()
    _, e = torch.frexp(mag)  # mag = m · 2^e, m in [0.5, 1): the binade's exponent is e - 1
    ulp = torch.ldexp(torch.ones_like(mag), (e - 1).clamp_(min=emin) - mant)
    q = mag / ulp
    lo = q.floor()
    frac = torch.round((q - lo) * 2.0**k)
    r = bits.reshape(values.shape).long().bitwise_and(2**k - 1)
    up = (frac + r) >= 2**k
    fmax = torch.finfo(dtype).max
    out = torch.copysign(((lo + up) * ulp).clamp_(max=fmax), x).to(dtype)
    return torch.where(x.isfinite(), out, values.to(dtype))


def stochastic_round(values: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """:func:`stochastic_round_reference`'s result, bit for bit, on the float32 bit pattern.

    Args:
        values: float32, contiguous, any shape.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        bits: integers of ``values.numel()`` elements (int16 or wider), ``r`` in their low
            bits; an int32 ``bits`` is overwritten.

    Returns:
        ``values``' shape, ``dtype``.
    """
    k, _, emin = _spec(dtype)
    flat = values.reshape(-1)
    # int32 + int32: a mixed int32 + int16 add takes torch's slow promoting path (~10x)
    r = bits.reshape(-1).to(torch.int32).bitwise_and_(2**k - 1)
    summed = torch.add(flat.view(torch.int32), r)
    # saturate before converting: a round-up past the dtype's max (or a carry into float32's
    # inf pattern) is ±max, never ±inf (module docstring); inf/NaN inputs are redone below
    fmax = torch.finfo(dtype).max
    rounded = summed.bitwise_and_(-(2**k)).view(torch.float32).clamp_(-fmax, fmax)
    out = rounded.to(dtype)
    # the dtype's normal range is |x| in [2^emin, inf): magnitude bits in [lo, 0x7F800000);
    # the others (FP16 subnormals, inf, NaN) take the reference. One unsigned range test:
    # (m - lo) as unsigned >= width, done signed by flipping the top bit of both sides
    lo = (emin + 127) << 23 if emin > -126 else 0
    width = 0x7F800000 - lo
    shifted = flat.view(torch.int32).bitwise_and(0x7FFFFFFF).sub_(lo).bitwise_xor_(-(2**31))
    special = shifted.ge(width - 2**31)
    idx = special.nonzero().squeeze(1)
    if idx.numel():
        out[idx] = stochastic_round_reference(flat[idx], dtype, r[idx])
    return out.view(values.shape)


def draw_key(generator: torch.Generator | None = None) -> int:
    """One update's rounding key for :func:`counter_bits`: 63 random bits from ``generator``
    (a CPU generator; ``None``: the global one)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))
