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
handful. Rows are rounded in chunks of :data:`CHUNK_VALUES`, so no temporary is table- or
batch-sized.
"""

from __future__ import annotations

import torch

from embark.training.config import TableRounding

#: values rounded per chunk (1 MiB of float32): temporaries stay cache-sized while the per-op
#: dispatch is spread over enough values (measured: 2^14 values a chunk costs 3.6x, 2^16 1.5x
#: the CPU time of 2^18 on 3.8 M values)
CHUNK_VALUES = 1 << 18

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


def draw_bits(
    numel: int, dtype: torch.dtype, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``(numel,)`` random integers whose :func:`rounding_bits` low bits are uniform: int16
    lanes of 64-bit draws for FP16 (4 values a draw, 15 random bits each), int32 lanes for
    BF16 (2 a draw, at least 31 bits), so the generator runs 4× / 2× fewer times than one draw
    per value.

    Args:
        generator: a CPU generator (``None``: the global one).
    """
    lane = torch.int16 if rounding_bits(dtype) <= 15 else torch.int32
    per_draw = 8 // lane.itemsize
    draws = torch.empty(-(-numel // per_draw), dtype=torch.int64)
    draws.random_(generator=generator)  # [0, 2^63): every lane but the top one full
    return draws.view(lane)[:numel]


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


def round_rows(
    values: torch.Tensor,
    dtype: torch.dtype,
    rounding: TableRounding,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``values`` (float32) rounded to ``dtype`` (``float16`` or ``bfloat16``).

    ``nearest``: round to nearest, ties to even (``values.to(dtype)``). ``stochastic``: the
    module docstring's rule (unbiased) with bits drawn from ``generator`` (:func:`draw_bits`,
    one draw per :data:`CHUNK_VALUES` values at a time, so the temporaries stay chunk-sized).

    Args:
        values: float32, any shape.
        generator: a CPU generator (``None``: the global RNG); a CUDA ``values`` gets its bits
            drawn on the CPU and moved.

    Returns:
        ``values``' shape, ``dtype``.
    """
    if rounding is TableRounding.NEAREST or values.numel() == 0:
        return values.to(dtype)
    flat = values.contiguous().reshape(-1)
    out = torch.empty(flat.shape, dtype=dtype, device=values.device)
    for start in range(0, flat.numel(), CHUNK_VALUES):
        part = flat[start : start + CHUNK_VALUES]
        bits = draw_bits(part.numel(), dtype, generator).to(values.device)
        out[start : start + part.numel()] = stochastic_round(part, dtype, bits)
    return out.view(values.shape)
