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

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from embark.data.batch import Batch
from embark.sharding.model import ShardedDLRM
from embark.sharding.prefetch import InputPrefetcher

if TYPE_CHECKING:
    from embark.training.trainer import Trainer


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
