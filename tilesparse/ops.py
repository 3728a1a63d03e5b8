"""Execution of the condensed TW format. (Placeholder until the CPU-speed work lands: every
call goes to the reference.)"""

from __future__ import annotations

import torch

from tilesparse.format import TWLayout, reference_matmul


def tw_linear(x: torch.Tensor, layout: TWLayout, bias: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``Y = X · W + b`` for a condensed TW weight. ``x: (..., K)`` → ``(..., N)``."""
    return reference_matmul(x, layout, bias)
