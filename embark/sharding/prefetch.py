"""The next batch's input distribution started ahead of time (:class:`InputPrefetcher`), which
the sharded model consumes and :class:`~embark.sharding.pipeline.SparseDistPipeline` drives."""

from __future__ import annotations

from collections import deque

from embark.data.jagged import JaggedBatch
from embark.sharding.collection import ShardedEmbeddingCollection
from embark.sharding.input import DistributedInput, PendingInput


class InputPrefetcher:
    """Input distributions started ahead of the forward that consumes them, in order.

    :meth:`schedule` names the batch whose input distribution starts right after the next
    embedding forward (:meth:`after_forward`, called by the model); :meth:`take` hands a
    forward the distributed input of its batch when it was started ahead.
    """

    def __init__(self, embeddings: ShardedEmbeddingCollection) -> None:
        self.embeddings = embeddings
        self._started: deque[tuple[JaggedBatch, PendingInput]] = deque()
        self._scheduled: JaggedBatch | None = None
        self.taken = 0  # forwards that used an input started ahead

    def start(self, sparse: JaggedBatch) -> None:
        """Start ``sparse``'s input distribution now (a collective: every rank, in step)."""
        self._started.append((sparse, self.embeddings.start_input(sparse)))

    def schedule(self, sparse: JaggedBatch) -> None:
        """Start ``sparse``'s input distribution right after the next embedding forward.

        Raises:
            ValueError: when another batch is already scheduled.
        """
        if self._scheduled is not None:
            raise ValueError("InputPrefetcher.schedule: a batch is already scheduled")
        self._scheduled = sparse

    def take(self, sparse: JaggedBatch) -> DistributedInput | None:
        """The distributed input of ``sparse`` (the same object :meth:`start` was given) when
        it is the oldest one started, else ``None`` when none is pending.

        Raises:
            ValueError: when inputs are pending for other batches (the forward would issue
                collectives out of the order every other rank follows).
        """
        if not self._started:
            return None
        head, pending = self._started[0]
        if head is not sparse:
            raise ValueError(
                "a forward got a batch other than the one whose input distribution was "
                f"started ahead ({len(self._started)} pending): feed the pipeline's batches "
                "in order"
            )
        self._started.popleft()
        self.taken += 1
        return pending.wait()

    def after_forward(self) -> None:
        """Start the scheduled batch's input distribution (called after an embedding
        forward's vectors exchange)."""
        if self._scheduled is not None:
            sparse, self._scheduled = self._scheduled, None
            self.start(sparse)

    @property
    def pending(self) -> int:
        """Input distributions started and not yet taken."""
        return len(self._started)
