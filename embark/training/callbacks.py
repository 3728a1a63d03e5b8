"""Hooks into :meth:`embark.training.trainer.Trainer.fit`: the :class:`Callback` protocol and
the view of the trainer its hooks get.

A callback is any object with the three hooks (and optionally ``on_train_begin``) (``tilesparse``'s pruning callback and ``hps``'s
update publisher are, without importing ``embark``); subclassing :class:`Callback` inherits
no-op defaults, so a subclass overrides only what it needs.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from embark.training.metrics import Monitor

log = logging.getLogger(__name__)


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

    def request_stop(self, reason: str) -> None:
        """End the running ``fit`` after this step (a hook's way to stop training)."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint folder at ``path`` (atomically replacing one there)."""
        ...


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


class EarlyStopping(Callback):
    """Stop ``fit`` when the watched validation metric has not improved for ``patience``
    evaluations in a row (evaluations run every ``TrainConfig.eval_every`` steps when ``fit``
    gets ``eval_batches``).

    Args:
        monitor: the metric, which way it improves, the smallest improvement that counts.
        patience: evaluations without improvement tolerated (>= 1).

    Attributes:
        best: the best value seen (``None`` before the first evaluation).
        best_step: the step of ``best``.
        waited: evaluations since ``best``.

    Raises:
        ValueError: for ``patience < 1``.
    """

    def __init__(self, monitor: Monitor | None = None, patience: int = 3) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping.patience must be an integer >= 1, got {patience!r}")
        self.monitor = monitor or Monitor()
        self.patience = patience
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0

    def on_eval(self, trainer: TrainerView, step: int, metrics: dict[str, float]) -> None:
        value = self.monitor.value(metrics)
        if self.monitor.improves(value, self.best):
            self.best, self.best_step, self.waited = value, step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.request_stop(
                f"early stopping at step {step}: {self.monitor.metric} did not improve on "
                f"{self.best} (step {self.best_step}) for {self.waited} evaluations"
            )


class KeepBest(Callback):
    """Checkpoints ``<folder>/best`` (the best evaluation so far by ``monitor``) and
    ``<folder>/last`` (the latest evaluation), each written atomically at an evaluation.

    ``best`` is replaced only by a strictly better evaluation (:meth:`Monitor.improves`),
    never by a worse one — also across a resumed run: an existing ``best`` checkpoint's value
    (the last record of its history, the evaluation it was saved at) is the one to beat.

    Args:
        folder: holds ``best`` and ``last`` (created).
        monitor: the metric watched.

    Attributes:
        best: the value of ``<folder>/best`` (``None`` before one exists).
    """

    def __init__(self, folder: str | os.PathLike[str], monitor: Monitor | None = None) -> None:
        self.folder = Path(folder)
        self.monitor = monitor or Monitor()
        self.best: float | None = self._saved_best()

    @property
    def best_path(self) -> Path:
        return self.folder / "best"

    @property
    def last_path(self) -> Path:
        return self.folder / "last"

    def _saved_best(self) -> float | None:
        """The monitored value of an existing ``best`` checkpoint (its ``state.json``'s last
        history record), else ``None``."""
        state = self.best_path / "state.json"
        if not state.is_file():
            return None
        history = json.loads(state.read_text()).get("history") or []
        return self.monitor.value(history[-1]) if history else None

    def on_eval(self, trainer: TrainerView, step: int, metrics: dict[str, float]) -> None:
        value = self.monitor.value(metrics)
        trainer.save_checkpoint(self.last_path)
        if self.monitor.improves(value, self.best):
            trainer.save_checkpoint(self.best_path)
            log.info("step %d: %s %.6f, the best so far: saved", step, self.monitor.metric, value)
            self.best = value
