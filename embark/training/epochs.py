"""Epochs over a finite data set: its samples reshuffled for each epoch, deterministically.

:meth:`embark.training.trainer.Trainer.fit_epochs` takes ``epoch -> batches``; for a data set
that fits in memory as a list of batches, :func:`reshuffled` is that function::

    batches = list(source)                                   # N samples in batches of B
    trainer.fit_epochs(lambda e: reshuffled(batches, e), epochs=5)

Epoch ``e`` draws one permutation of all ``N`` samples from a generator seeded by
``(seed, e)`` and cuts it into batches of the first batch's size (the last one shorter when
``B`` does not divide ``N``): the same epoch is the same batches on every run and rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embark.data.batch import Batch, slice_batch
from embark.data.jagged import JaggedBatch

#: mixes the epoch into the seed (a prime: seeds (s, e) and (s', e') collide only for far-apart
#: seeds)
_EPOCH_STRIDE = 1_000_003


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """One batch of every sample of ``batches``, in order (the same keys in each).

    Raises:
        ValueError: for no batches, or batches of different keys.
    """
    if not batches:
        raise ValueError("concat_batches: no batches")
    keys = batches[0].sparse.keys
    for i, b in enumerate(batches):
        if b.sparse.keys != keys:
            raise ValueError(f"batch {i} has keys {b.sparse.keys}, batch 0 has {keys}")
    per_key = {
        k: (
            torch.cat([b.sparse.values_for(k) for b in batches]),
            torch.cat([b.sparse.lengths_for(k) for b in batches]),
        )
        for k in keys
    }
    return Batch(
        torch.cat([b.dense for b in batches]),
        JaggedBatch.from_per_key(per_key),
        torch.cat([b.labels for b in batches]),
    )


def permute_batch(batch: Batch, order: torch.Tensor) -> Batch:
    """The samples of ``batch`` in the order ``order`` (``(B,) int64``, a permutation)."""
    per_key = {}
    for k in batch.sparse.keys:
        values, lengths = batch.sparse.values_for(k), batch.sparse.lengths_for(k)
        starts = batch.sparse.bag_offsets(k)[order]
        new_lengths = lengths[order]
        new_starts = torch.cumsum(new_lengths, 0) - new_lengths
        # value j of new bag i sits at starts[i] + (j - new_starts[i])
        shift = torch.repeat_interleave(starts - new_starts, new_lengths)
        index = torch.arange(int(new_lengths.sum()), dtype=torch.int64) + shift
        per_key[k] = (values[index], new_lengths)
    return Batch(batch.dense[order], JaggedBatch.from_per_key(per_key), batch.labels[order])


def reshuffled(batches: Sequence[Batch], epoch: int, seed: int = 0) -> list[Batch]:
    """Epoch ``epoch``'s batches: every sample of ``batches`` in a permutation drawn from
    ``(seed, epoch)``, cut into batches of ``batches[0]``'s size.

    Raises:
        ValueError: for no batches or a negative epoch.
    """
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    whole = concat_batches(batches)
    gen = torch.Generator().manual_seed(seed * _EPOCH_STRIDE + epoch)
    order = torch.randperm(whole.batch_size, generator=gen)
    shuffled = permute_batch(whole, order)
    size = batches[0].batch_size
    return [
        slice_batch(shuffled, lo, min(lo + size, whole.batch_size))
        for lo in range(0, whole.batch_size, size)
    ]
