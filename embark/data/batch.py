"""The training batch every reader and generator yields: dense features, sparse ids, labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embark.data.jagged import JaggedBatch


@dataclass
class Batch:
    """One training batch.

    Attributes:
        dense: ``(B, D) float32`` dense features.
        sparse: the ids, one key per table.
        labels: ``(B,) float32`` clicks in {0, 1}.
    """

    dense: torch.Tensor
    sparse: JaggedBatch
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )
