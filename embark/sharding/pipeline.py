"""Pipelined sharded training, as TorchRec's ``TrainPipelineSparseDist``: batch ``i+1``'s input
distribution (the header exchange and the keys all-to-all) travels while batch ``i``'s dense
forward, backward, dense all-reduce and optimizer step run.

One step of :class:`SparseDistPipeline`, every rank in step (default process group)::

    step i:   wait keys(i)  ──▶ lookup(i), vectors all-to-all(i)       (embedding forward)
              start input(i+1): header(i+1) [small, synchronous: it carries the errors]
                                keys(i+1)   [async all-to-all, in flight from here ...]
              dense forward(i), loss, backward(i) (vector gradients, dense buckets),
              optimizer step(i)                                   [... to the next step]

The keys exchange reads ids only, never weights, so starting it before step ``i``'s
optimizer changes nothing: a pipelined run takes exactly the steps of an unpipelined one, bit
for bit (the same collectives with the same data, only issued earlier). Collectives keep one
order on every rank: batch ``i``'s vectors exchange is issued before batch ``i+1``'s keys,
which are issued before batch ``i``'s backward exchanges.

What is not overlapped: the vectors exchange of batch ``i+1`` needs the tables after step
``i``'s update, so it cannot start before step ``i`` ends without changing the numbers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from embark.data.batch import Batch
from embark.data.jagged import JaggedBatch
from embark.sharding.collection import ShardedEmbeddingCollection
from embark.sharding.input import DistributedInput, PendingInput

if TYPE_CHECKING:
    from embark.training.trainer import Trainer


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


class SparseDistPipeline:
    """Train a :class:`~embark.sharding.model.ShardedDLRM` with a
    :class:`~embark.training.trainer.Trainer`, each batch's input distribution overlapped with
    the previous step (module docstring). Equal, step by step, to
    ``[trainer.train_step(b) for b in batches]``.

    Args:
        trainer: a trainer of a ``ShardedDLRM`` (``trainer.model``).

    Raises:
        TypeError: when the trainer's model is not a ``ShardedDLRM``.
    """

    def __init__(self, trainer: Trainer) -> None:
        from embark.sharding.model import ShardedDLRM

        if not isinstance(trainer.model, ShardedDLRM):
            raise TypeError(
                "SparseDistPipeline needs a Trainer of a ShardedDLRM, got one of "
                f"{type(trainer.model).__name__}"
            )
        self.trainer = trainer
        self.model: ShardedDLRM = trainer.model
        self.prefetched = 0  # steps whose input distribution was started ahead

    def train(self, batches: Iterable[Batch]) -> Iterator[float]:
        """Train one step per local batch (every rank in step, the same number of batches);
        yields each step's global mean loss, as ``Trainer.train_step`` returns it.

        The model's prefetcher is removed when the iteration ends (also early: ``close()``)
        with no input distribution left pending only when every batch was trained.
        """
        device = self.trainer.device
        it = (b.to(device) for b in batches)
        cur = next(it, None)
        if cur is None:
            return
        pf = InputPrefetcher(self.model.embeddings)
        self.model.prefetcher = pf
        try:
            pf.start(cur.sparse)
            for nxt in it:
                pf.schedule(nxt.sparse)
                yield self.trainer.train_step(cur)
                cur = nxt
            yield self.trainer.train_step(cur)
        finally:
            self.prefetched += pf.taken
            self.model.prefetcher = None
