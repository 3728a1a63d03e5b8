"""Hooks into :meth:`embark.training.trainer.Trainer.fit`: the :class:`Callback` protocol and
the view of the trainer its hooks get.

A callback is any object with the three hooks (and optionally ``on_train_begin``) (``tilesparse``'s pruning callback and ``hps``'s
update publisher are, without importing ``embark``); subclassing :class:`Callback` inherits
no-op defaults, so a subclass overrides only what it needs.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class TrainerView(Protocol):
    """What a hook may read of the trainer (:class:`~embark.training.trainer.Trainer` is one)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def step(self) -> int: ...

    @property
    def generator(self) -> torch.Generator: ...

    @property
    def history(self) -> list[dict[str, float]]: ...


class Callback(Protocol):
    """Hooks into ``Trainer.fit`` / ``Trainer.train_step``; all default to no-ops.

    ``step`` is the 1-based number of the optimizer step in progress (``on_after_backward``)
    or just finished (``on_step_end``, ``on_eval``); both see the same number for one step.
    In a sharded run every rank calls every hook, with gradients already reduced.
    """

    def on_train_begin(self, trainer: TrainerView) -> None:
        """Before the first step this callback sees changes anything (optional: a callback
        without it is not called; e.g. a snapshot of the tables, whose touched rows change
        inside ``backward``, before ``on_after_backward``, or a check that must refuse the step
        before any row moves)."""
        return None

    def on_after_backward(self, trainer: TrainerView, step: int) -> None:
        """Dense gradients are present, ``optimizer.step()`` has not run yet (e.g. Taylor
        scores); the embedding tables' touched rows are already updated (fused in backward)."""
        return None

    def on_step_end(self, trainer: TrainerView, step: int, loss: float) -> None:
        """After the optimizer step (e.g. mask updates); ``loss`` is this batch's mean loss."""
        return None

    def on_eval(self, trainer: TrainerView, step: int, metrics: dict[str, float]) -> None:
        """After a periodic evaluation inside ``Trainer.fit``."""
        return None
