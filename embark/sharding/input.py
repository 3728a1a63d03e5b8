"""The input distribution of :class:`~embark.sharding.collection.ShardedEmbeddingCollection`
(steps 1-2 of its forward): what a source routes to each shard, the header every rank sends
every rank, and the keys buffer decoded on arrival.

Header from one source to owner ``o`` (int64)::

    [status, table index, bad id, B, count per shard of owned[o] ...]
     status: OK | BAD_ID (table index, bad id) | MISSING_KEY (table index)

Keys segment for shard ``owned[o][k]``, in bytes (:func:`embark.sharding.comm.int_bytes`)::

    REDUCTION: [B int32 bag lengths of the shard's part of each bag | count int64 rows]
    UNIQUE:    [count int64 distinct rows]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from embark.sharding.comm import KEY_DTYPE, LENGTH_DTYPE, from_int_bytes
from embark.sharding.routing import ShardRef
from embark.types import Cluster

OK, BAD_ID, MISSING_KEY = 0, 1, 2
HEADER = 4  # status, table index, bad id, batch size


@dataclass
class Sent:
    """What a source remembers about one (destination shard) segment it sent."""

    ref: ShardRef
    count: int  # ids (REDUCTION) or distinct ids (UNIQUE) sent
    inverse: torch.Tensor | None = None  # UNIQUE: (n,) position of each id among the distinct
    samples: torch.Tensor | None = None  # UNIQUE: (n,) sample of each id


@dataclass
class Routed:
    """A local batch routed to its owners, before any exchange.

    Args:
        status, table, bad: the header's error fields (``OK, 0, 0`` for a good batch).
        batch_size: this rank's ``B`` (0 when the batch is bad).
        sent: ``sent[o][k]``: the segment for shard ``owned[o][k]``.
        segments: ``segments[o]``: the byte tensors for owner ``o``, in shard order.
        lengths: per table, ``(B,) int32`` full bag sizes (for ``mean``).
        dp_input: per DP table, ``(values (nnz,) int64, offsets (B,) int64)``.
    """

    status: int
    table: int
    bad: int
    batch_size: int
    sent: list[list[Sent]]
    segments: list[list[torch.Tensor]]
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    dp_input: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def header(self) -> torch.Tensor:
        """``(Σ_o HEADER + len(owned[o]),) int64`` the headers to every owner, concatenated."""
        return torch.tensor(
            [
                v
                for per_owner in self.sent
                for v in (self.status, self.table, self.bad, self.batch_size)
                + tuple(s.count for s in per_owner)
            ],
            dtype=torch.int64,
        )


@dataclass
class DistributedInput:
    """A local batch after the input distribution (steps 1-2), ready for lookup.

    Args:
        batch_size: this rank's ``B``.
        lengths: per table, ``(B,) int32`` full bag sizes (for ``mean``).
        dp_input: per DP table, ``(values (nnz,) int64, offsets (B,) int64)``.
        sent: ``sent[o][i]``: the segment sent for ``owned[o][i]``.
        batch_sizes: ``(world,)`` every source's ``B``.
        received: ``received[r][i]``: ``(lengths (B_r,) int64 or None, rows (n,) int64)``
            from source ``r`` for ``owned[rank][i]``.
    """

    batch_size: int
    lengths: dict[str, torch.Tensor]
    dp_input: dict[str, tuple[torch.Tensor, torch.Tensor]]
    sent: list[list[Sent]]
    batch_sizes: list[int]
    received: list[list[tuple[torch.Tensor | None, torch.Tensor]]]


class PendingInput:
    """An input distribution in flight (:meth:`ShardedEmbeddingCollection.start_input`)."""

    def __init__(self, finish: Callable[[], DistributedInput]) -> None:
        self._finish = finish
        self._done: DistributedInput | None = None

    def wait(self) -> DistributedInput:
        """Wait for the keys exchange and return the distributed input (idempotent)."""
        if self._done is None:
            self._done = self._finish()
        return self._done


def segment_bytes(
    mine: Sequence[ShardRef], batch_sizes: Sequence[int], counts: Sequence[Sequence[int]]
) -> list[list[int]]:
    """``[r][k]``: bytes of source ``r``'s segment for this rank's shard ``mine[k]``, from
    the headers' batch sizes and counts."""
    len_b, key_b = LENGTH_DTYPE.itemsize, KEY_DTYPE.itemsize
    return [
        [
            (batch_sizes[r] * len_b if ref.cluster is Cluster.REDUCTION else 0)
            + counts[r][k] * key_b
            for k, ref in enumerate(mine)
        ]
        for r in range(len(batch_sizes))
    ]


def decode_keys(
    got: torch.Tensor,
    mine: Sequence[ShardRef],
    batch_sizes: Sequence[int],
    recv_k: Sequence[int],
    seg_size: Sequence[Sequence[int]],
) -> list[list[tuple[torch.Tensor | None, torch.Tensor]]]:
    """``[r][k]``: ``(lengths (B_r,) int64 or None, rows int64)`` of the received keys buffer
    ``got`` (bytes from every source, in rank order)."""
    received: list[list[tuple[torch.Tensor | None, torch.Tensor]]] = []
    for r, chunk in enumerate(got.split(list(recv_k))):
        parts = chunk.split(list(seg_size[r]))
        row: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        for k, ref in enumerate(mine):
            if ref.cluster is Cluster.REDUCTION:
                b = batch_sizes[r] * LENGTH_DTYPE.itemsize
                lens = from_int_bytes(parts[k][:b], LENGTH_DTYPE).to(torch.int64)
                row.append((lens, from_int_bytes(parts[k][b:], KEY_DTYPE)))
            else:
                row.append((None, from_int_bytes(parts[k], KEY_DTYPE)))
        received.append(row)
    return received
