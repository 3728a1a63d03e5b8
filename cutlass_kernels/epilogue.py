"""The TW GEMM's epilogue: what the kernel applies to each output element before it rounds and
stores it, written as fp32 tensor arithmetic that the CPU emulation runs op for op.

Every built instance's epilogue (``csrc/tw_epilogue.h``, used by both main loops) computes, per
output element of a written row ``n = col_idx[...]``::

    no bias:    D[n, m] = act(alpha·acc[n, m] + beta·C[n, m])     C = the old D (read when beta != 0)
    with bias:  D[n, m] = act(acc[n, m] + bias[n])                (alpha = 1, beta = 0 required)

in fp32 (``acc`` the fp32 accumulator, ``bias`` the fp16/bf16 bias converted exactly), then
rounds once to the output dtype (round to nearest even). ``alpha·acc + beta·C`` is one fused
multiply-add in the kernel; the emulation's two roundings equal it when ``alpha = 1``, the only
value the package launches with. The activation is chosen per launch (an int in
``TwGemmArgs``, :data:`ACTIVATION_CODE`), so no instance is compiled twice.

Activations, as fp32 operations each rounded to nearest (``__fmul_rn``/``__fadd_rn``/
``__fdiv_rn`` in the kernel: no contraction into fma; the constants are the same fp32 values on
both sides, hex literals in the header). Bit-identical on the GPU and in :func:`apply_activation`:

* ``relu``: ``x < 0 ? 0 : x`` (NaN passes through, as ``torch.relu``).
* ``gelu`` (``nn.GELU()``, erf form): ``x · 0.5 · (1 + erf_r(x · 2^-1/2))``, ``erf_r`` the
  rational approximation of Eigen's ``generic_fast_erf_float`` (odd degree-13 numerator over
  even degree-8 denominator, argument clamped to [-4, 4]): |erf_r - erf| <= 4.2e-7, so
  |gelu - GELU| <= 1.4e-6 for every fp32 ``x`` (absolute; measured over [-10, 10] in steps of
  1e-5). Neither torch's CPU nor its CUDA GELU is correctly rounded either: after rounding to
  fp16, on |x| <= 3, 0.19 % of this formula's outputs differ from the float64 GELU's and 0.31 %
  of torch's CPU fp32 GELU's do (bf16: 0.03 % / 0.04 %).
* ``gelu_tanh`` (``nn.GELU(approximate="tanh")``): ``x · 0.5 · (1 + tanh_r(√(2/π)·(x +
  0.044715·x³)))``, ``tanh_r`` Eigen's ``generic_fast_tanh_float`` (clamped to ±7.9988):
  |tanh_r - tanh| <= 4.0e-7.
"""

from __future__ import annotations

from enum import StrEnum

import torch

__all__ = [
    "ACTIVATION_CODE",
    "Activation",
    "apply_activation",
    "apply_epilogue",
    "erf_fp32",
    "tanh_fp32",
]


class Activation(StrEnum):
    """The activation an epilogue applies (fp32, before rounding to the output dtype)."""

    NONE = "none"
    RELU = "relu"
    GELU = "gelu"  # erf form: nn.GELU()
    GELU_TANH = "gelu_tanh"  # nn.GELU(approximate="tanh")

    def __str__(self) -> str:
        return self.value


# The kernel's activation argument (``TwActivation`` in csrc/tw_args.h; a test reads the header).
ACTIVATION_CODE: dict[Activation, int] = {
    Activation.NONE: 0,
    Activation.RELU: 1,
    Activation.GELU: 2,
    Activation.GELU_TANH: 3,
}

# fp32 constants as exact hex (the same literals as csrc/tw_epilogue.h; a test compares them).
# erf_r: numerator coefficients of x^13 .. x^1 (Horner in x², times x), denominator x^8 .. x^0.
ERF_NUM = (
    "-0x1.2bbe16p-32",
    "0x1.dbffdcp-26",
    "-0x1.19fea2p-19",
    "-0x1.dd85a4p-15",
    "-0x1.8158c6p-11",
    "-0x1.8343ecp-9",
    "-0x1.07b7a8p-6",
)
ERF_DEN = (
    "-0x1.e8c19ap-17",
    "-0x1.bf7a52p-13",
    "-0x1.b9249cp-10",
    "-0x1.e337f0p-8",
    "-0x1.d36d4ep-7",
)
ERF_CLAMP = "0x1p+2"  # 4
TANH_NUM = (
    "-0x1.3e4b80p-52",
    "0x1.c266fcp-43",
    "-0x1.7a6ffep-34",
    "0x1.b80082p-25",
    "0x1.f28694p-17",
    "0x1.4e1bdap-11",
    "0x1.40b3b8p-8",
)
TANH_DEN = ("0x1.41a7b0p-20", "0x1.f12bacp-14", "0x1.29540ap-9", "0x1.40b3bap-8")
TANH_CLAMP = "0x1.ffec88p+2"  # 7.99881172...
SQRT1_2 = "0x1.6a09e6p-1"  # 2^-1/2
SQRT_2_OVER_PI = "0x1.988454p-1"  # √(2/π)
GELU_CUBIC = "0x1.6e4e26p-5"  # 0.044715


def _c(hex_value: str, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float.fromhex(hex_value), dtype=like.dtype, device=like.device)


def _horner(x2: torch.Tensor, coeffs: tuple[str, ...]) -> torch.Tensor:
    """``((c0·x2 + c1)·x2 + c2)…``, one rounding per multiply and per add."""
    p = _c(coeffs[0], x2).expand_as(x2)
    for c in coeffs[1:]:
        p = p * x2 + _c(c, x2)
    return p


def _clamp(x: torch.Tensor, bound: str) -> torch.Tensor:
    hi = _c(bound, x)
    return torch.where(x < -hi, -hi, torch.where(x > hi, hi, x))


def erf_fp32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's ``erf_r(x)`` (fp32 in, fp32 out; see the module docstring)."""
    x = _clamp(x, ERF_CLAMP)
    x2 = x * x
    return (x * _horner(x2, ERF_NUM)) / _horner(x2, ERF_DEN)


def tanh_fp32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's ``tanh_r(x)`` (fp32 in, fp32 out; see the module docstring)."""
    x = _clamp(x, TANH_CLAMP)
    x2 = x * x
    return (x * _horner(x2, TANH_NUM)) / _horner(x2, TANH_DEN)


def apply_activation(d: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``activation(d)`` as the kernel computes it, for fp32 ``d`` (a new tensor, or ``d``
    itself for ``NONE``). A float64 ``d`` (the emulation of fp64 launches) runs the same
    formulas in float64.

    Raises:
        ValueError: an unknown activation.
    """
    if activation is Activation.NONE:
        return d
    if activation is Activation.RELU:
        return torch.where(d < 0, torch.zeros((), dtype=d.dtype, device=d.device), d)
    half, one = _c("0x1p-1", d), _c("0x1p+0", d)
    if activation is Activation.GELU:
        return d * half * (one + erf_fp32(d * _c(SQRT1_2, d)))
    if activation is Activation.GELU_TANH:
        inner = (d + _c(GELU_CUBIC, d) * d * d * d) * _c(SQRT_2_OVER_PI, d)
        return d * half * (one + tanh_fp32(inner))
    raise ValueError(
        f"unknown activation {activation!r}; expected one of {[a.value for a in Activation]}"
    )


def apply_epilogue(
    d: torch.Tensor, bias_rows: torch.Tensor | None, activation: Activation
) -> torch.Tensor:
    """``activation(d + bias_rows[:, None])`` for ``d (rows, batch)`` in the accumulator's
    dtype; ``bias_rows (rows,)`` is converted to it (exact: fp16/bf16 → fp32)."""
    if bias_rows is not None:
        d = d + bias_rows.to(d.dtype).unsqueeze(1)
    return apply_activation(d, activation)
