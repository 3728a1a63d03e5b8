"""The mask a pruner puts on a layer: a ``torch.nn.utils.parametrize`` parametrization
computing ``layer.weight = original * mask``, so the forward pass sees zeros at pruned
positions and gradients reach the kept weights only (``original.grad = grad · mask``)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["WeightMask", "masked_weight"]


class WeightMask(nn.Module):
    """Parametrization ``weight = original * mask``; ``mask: (N, K) bool`` buffer, in
    ``nn.Linear.weight``'s orientation (the transpose of the ``(K, N)`` masks elsewhere)."""

    def __init__(
        self, out_features: int, in_features: int, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.register_buffer(
            "mask", torch.ones(out_features, in_features, dtype=torch.bool, device=device)
        )

    mask: torch.Tensor

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def masked_weight(m: nn.Module) -> tuple[torch.Tensor, WeightMask]:
    """``(original, mask module)`` of a layer whose ``weight``
    :meth:`~tilesparse.pruner.TileSparsePruner.prepare` parametrized
    (``m.parametrizations.weight``: ``original`` and one :class:`WeightMask`)."""
    holder = cast(
        parametrize.ParametrizationList, cast(nn.ModuleDict, m.parametrizations)["weight"]
    )
    return holder.original, cast(WeightMask, holder[0])
