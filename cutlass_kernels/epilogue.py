"""The TW GEMM's epilogue functions: what is applied to each output element before it is
rounded and stored.

The built kernels' epilogue is ``D = alpha·acc + beta·C`` (``LinearCombination``). A K-major
chain of layers (``tilesparse.chain``) also fuses a per-output-row bias and an activation::

    D[n, m] = act(alpha·acc[n, m] + beta·C[n, m] + bias[n])      in fp32, rounded once

:func:`apply_epilogue` is that arithmetic, used by the CPU emulation
(:func:`cutlass_kernels.reference.emulate`). A GPU launch refuses a bias or an activation
until the kernel's epilogue computes them (:func:`cutlass_kernels.launch.tw_gemm_kmajor`).
"""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.nn.functional as F

__all__ = ["Activation", "apply_activation", "apply_epilogue"]


class Activation(StrEnum):
    """The activation an epilogue applies (fp32, before rounding to the output dtype)."""

    NONE = "none"
    RELU = "relu"
    GELU = "gelu"  # erf form: nn.GELU()
    GELU_TANH = "gelu_tanh"  # nn.GELU(approximate="tanh")

    def __str__(self) -> str:
        return self.value


def apply_activation(d: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``activation(d)`` (a new tensor, or ``d`` itself for ``NONE``)."""
    if activation is Activation.NONE:
        return d
    if activation is Activation.RELU:
        return torch.relu(d)
    if activation is Activation.GELU:
        return F.gelu(d)
    if activation is Activation.GELU_TANH:
        return F.gelu(d, approximate="tanh")
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
