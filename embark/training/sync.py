"""How the processes of one training run agree on a step: the :class:`GradientSync` a
:class:`~embark.training.trainer.Trainer` is given.

One process (:class:`LocalSync`): the loss is the batch's mean, nothing to reduce. A sharded
model (``embark.sharding.model.ShardedDLRM``) brings its own: each rank's loss is its share of
the global loss (a sum over its samples divided by the GLOBAL batch size), and after
``backward`` the replicated gradients (dense part, data-parallel tables) are summed over the
ranks, so every parameter holds the gradient of the global mean loss.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from embark.data.batch import Batch


class GradientSync(Protocol):
    """The collective parts of a training step (every process calls each, in step).

    Attributes:
        batch_scope: what the batch size :meth:`loss` returns counts, for messages
            (``"a batch"``: this process's; ``"a global batch"``: all processes').
    """

    batch_scope: str

    def loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Forward this process's ``batch`` (on the model's device) and return ``(loss to
        backpropagate, samples of the step over all processes)``.

        Raises:
            ValueError: for a batch the model cannot take (on every process).
        """
        ...

    def global_loss(self, loss: torch.Tensor) -> float:
        """Before ``backward``: the global mean loss (the same on every process)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``; a sync may start its reductions from inside it (e.g. the
        gradients of the last layers while the first layers' are computed)."""
        ...

    def reduce(self, loss: torch.Tensor) -> float:
        """After :meth:`backward`: make every gradient the global loss's; return the global
        mean loss."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(n_r,)`` on each process → their concatenation in rank order, on every process."""
        ...


@runtime_checkable
class SupportsGradientSync(Protocol):
    """A model that brings its own :class:`GradientSync` (e.g. a sharded model)."""

    def gradient_sync(self) -> GradientSync: ...


class LocalSync:
    """One process: binary cross-entropy averaged over the batch; no collective.

    Args:
        model: ``forward(dense, sparse) -> (B,)`` logits.
    """

    batch_scope = "a batch"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        logits = self.model(batch.dense, batch.sparse)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), batch.batch_size

    def global_loss(self, loss: torch.Tensor) -> float:
        return float(loss.detach())

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce(self, loss: torch.Tensor) -> float:
        return float(loss.detach())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


def sync_for(model: nn.Module) -> GradientSync:
    """The model's own :class:`GradientSync` (:class:`SupportsGradientSync`), else
    :class:`LocalSync`."""
    if isinstance(model, SupportsGradientSync):
        return model.gradient_sync()
    return LocalSync(model)
