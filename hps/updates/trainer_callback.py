"""The trainer's end of online updates: a training callback that publishes the embedding rows
each step changed.

It is duck-typed to the trainer's callback protocol (``on_train_begin``, ``on_after_backward``,
``on_step_end``, ``on_eval``) so that hps imports nothing of the trainer: any object with a
``model.embeddings`` ``ModuleDict`` of ``nn.EmbeddingBag`` / ``nn.Embedding`` (a DDP wrapper's
``module`` is looked through) can be followed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hps.updates.record import UpdateBatch
from hps.updates.transport import UpdatePublisher

__all__ = ["PublishUpdatesCallback"]


class PublishUpdatesCallback:
    """Trainer callback: after every ``every_n_steps`` optimizer steps it publishes the rows
    that changed, all tables in one batch.

    Changed rows are found by comparing each ``trainer.model.embeddings[<table>].weight``
    with a snapshot (exact for any optimizer; costs one copy of the tables).

    Args:
        publisher: transport.
        every_n_steps: publish cadence.
        tables: table names (default: every table of ``model.embeddings``).
        record_names: table → the name its rows are published under, for tables whose database
            name is not the table's own: where a server's models name a table alike with
            other rows, it keys each by model, ``<model>.<table>``
            (``PSConfig.db_table(model, table)``). Tables not in it keep their own name.

    Example: a trainer of model ``bar`` publishing to servers where models ``foo`` and ``bar``
    both name a table ``t0`` with other rows::

        PublishUpdatesCallback(publisher, record_names={"t0": "bar.t0"})
    """

    def __init__(
        self,
        publisher: UpdatePublisher,
        every_n_steps: int = 1,
        tables: list[str] | None = None,
        record_names: dict[str, str] | None = None,
    ) -> None:
        if every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be > 0, got {every_n_steps}")
        self.publisher = publisher
        self.every_n_steps = every_n_steps
        self.tables = tables
        self.record_names = dict(record_names or {})
        self._snap: dict[str, torch.Tensor] = {}
        self.published = 0  # batches
        self.last_offset: str | None = None

    @staticmethod
    def _embeddings(trainer: Any) -> Any:
        model = getattr(trainer, "model", trainer)
        model = getattr(model, "module", model)  # DDP
        if not hasattr(model, "embeddings"):
            raise ValueError("PublishUpdatesCallback: trainer.model has no 'embeddings' ModuleDict")
        return model.embeddings

    def on_train_begin(self, trainer: Any) -> None:
        self._snapshot(trainer)

    def _snapshot(self, trainer: Any) -> None:
        emb = self._embeddings(trainer)
        for name in self.tables or list(emb.keys()):
            self._snap[name] = emb[name].weight.detach().cpu().clone()

    def on_after_backward(self, trainer: Any, step: int) -> None:
        if not self._snap:
            self._snapshot(trainer)

    def on_step_end(self, trainer: Any, step: int, loss: float) -> None:
        if not self._snap:
            self._snapshot(trainer)  # first call: nothing to compare with yet
            return
        if (step + 1) % self.every_n_steps:
            return
        self.publish_changes(trainer)

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        pass

    def publish_changes(self, trainer: Any) -> int:
        """Publish the rows changed since the last successful publication; returns the rows
        published.

        Raises:
            Exception: whatever ``publisher.publish`` raises (e.g. ``ConnectionError``); the
                snapshot is then left as it was, so the next call publishes these rows again.
        """
        emb = self._embeddings(trainer)
        batch: UpdateBatch = {}
        taken: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []  # (snapshot, rows, values)
        for name, snap in self._snap.items():
            w = emb[name].weight.detach().cpu()
            rows = torch.nonzero((w != snap).any(1)).squeeze(1)
            if rows.numel():
                vals = w[rows]  # a copy: the trainer may change w before the snapshot is updated
                batch[self.record_names.get(name, name)] = (
                    rows.numpy().astype(np.int64),
                    vals.numpy().astype(np.float32),
                )
                taken.append((snap, rows, vals))
        if not batch:
            return 0
        # The snapshot moves only once the transport has the rows: when publish raises (the
        # Redis server went away), the rows still differ from it and the next call re-sends them.
        self.last_offset = self.publisher.publish(batch)
        for snap, rows, vals in taken:
            snap[rows] = vals
        self.published += 1
        return sum(k.size for k, _ in batch.values())
