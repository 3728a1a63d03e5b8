"""The training batch every reader and generator yields (dense features, sparse ids, labels),
and its per-rank slices for data-parallel training.

A global batch of ``B`` samples is cut into ``world`` contiguous slices whose sizes differ by
at most one (:func:`local_range`); rank ``r`` trains on :func:`local_batch` ``(batch, r,
world)``. For ``B = 10`` on 4 ranks::

    samples   0 1 | 2 3 4 | 5 6 | 7 8 9
    rank        0 |   1   |  2  |   3
"""

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


def local_range(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s contiguous slice of a global batch: sizes differ
    by at most one (``batch_size = 10, world 4`` → ``[0:2], [2:5], [5:7], [7:10]``)."""
    return batch_size * rank // world_size, batch_size * (rank + 1) // world_size


def slice_batch(batch: Batch, start: int, end: int) -> Batch:
    """Samples ``start:end`` of ``batch`` (dense rows, labels and every key's bags).

    Raises:
        ValueError: when ``0 <= start <= end <= batch.batch_size`` does not hold.
    """
    b = batch.batch_size
    if not 0 <= start <= end <= b:
        raise ValueError(f"slice {start}:{end} is outside a batch of {b} samples")
    sp = batch.sparse
    per_key = {}
    for k in sp.keys:
        values, lengths = sp.values_for(k), sp.lengths_for(k)
        off = sp.bag_offsets(k)
        lo = int(off[start]) if start < b else values.numel()
        hi = int(off[end]) if end < b else values.numel()
        per_key[k] = (values[lo:hi], lengths[start:end])
    return Batch(batch.dense[start:end], JaggedBatch.from_per_key(per_key), batch.labels[start:end])


def local_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's slice of a global batch (:func:`local_range`)."""
    return slice_batch(batch, *local_range(batch.batch_size, rank, world_size))
