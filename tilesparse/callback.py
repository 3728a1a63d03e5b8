"""The pruner as a trainer callback: the pruning schedule driven by the training loop.

Duck-typed to ``embark.training.trainer.Callback`` (``tilesparse`` does not import ``embark``):
a trainer calls ``on_after_backward`` after each backward pass and ``on_step_end`` after each
optimizer step; :class:`PruningCallback` turns them into
:meth:`~tilesparse.pruner.TileSparsePruner.observe` and
:meth:`~tilesparse.pruner.TileSparsePruner.step`, with the schedule's step taken from the
trainer's.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

__all__ = ["PruningCallback", "SchedulePruner"]

log = logging.getLogger(__name__)


class SchedulePruner(Protocol):
    """What the callback drives (:class:`~tilesparse.pruner.TileSparsePruner` is one)."""

    step_count: int

    def observe(self) -> None:
        """Feed the current gradients to the importance score."""
        ...

    def step(self) -> bool:
        """Advance the schedule by one step; whether the masks changed."""
        ...


class PruningCallback:
    """Trainer callback (duck-typed to ``embark.training.trainer.Callback``: ``tilesparse`` does not
    import ``embark``): ``on_after_backward`` → :meth:`TileSparsePruner.observe`,
    ``on_step_end`` → :meth:`TileSparsePruner.step`.

    The schedule follows the trainer: at the end of trainer step ``step`` the pruner is at
    schedule step ``step - step_offset``. When the pruner's ``step_count`` disagrees (a pruner
    prepared on a model resumed from a checkpoint), it is set from the trainer's step first,
    and the masks are recomputed from the current weights if the pruner's sparsity is not the
    schedule's at that step.

    ``step_offset=None`` (the default) takes it from the first step: the trainer steps taken
    minus the pruner's (0 for a fresh trainer and pruner, or a pruner restored with
    :meth:`TileSparsePruner.load_state_dict` beside its checkpoint). A fresh pruner on a
    trainer that already took steps is ambiguous — start the schedule now
    (``step_offset=trainer.step``, after dense training) or continue the schedule the
    checkpoint's masks were pruned along (``step_offset=0``) — and is an error naming both.

    Args:
        pruner: the prepared pruner.
        step_offset: the trainer step at which the schedule starts, or ``None`` (above).

    Raises:
        ValueError: for a negative ``step_offset``; from ``on_train_begin`` (before the first
            step this callback sees changes any weight or row), for a trainer step at or before
            ``step_offset``, or the ambiguous case above.
    """

    def __init__(self, pruner: SchedulePruner, step_offset: int | None = None) -> None:
        if step_offset is not None and (
            isinstance(step_offset, bool) or not isinstance(step_offset, int) or step_offset < 0
        ):
            raise ValueError(f"step_offset must be an integer >= 0 or None, got {step_offset!r}")
        self.pruner = pruner
        self.step_offset = step_offset

    def _offset_for(self, step: int) -> int:
        """``step_offset`` for trainer step ``step`` (the one in progress), checked."""
        if self.step_offset is None:
            done = self.pruner.step_count
            if done == 0 and step > 1:
                raise ValueError(
                    f"the trainer has taken {step - 1} steps and this pruner none: pass "
                    f"pruner.callback(step_offset={step - 1}) to start the pruning schedule now "
                    "(after dense training), or step_offset=0 to continue the schedule a "
                    "resumed checkpoint was pruned along (or restore the pruner's state_dict)"
                )
            self.step_offset = max(0, step - 1 - done)
        if step - self.step_offset < 1:
            raise ValueError(
                f"trainer step {step} is not after step_offset {self.step_offset}: the pruning "
                "schedule would start in the future"
            )
        return self.step_offset

    def on_train_begin(self, trainer: Any) -> None:
        # checked before the first step's backward, which already moves the embedding rows
        self._offset_for(trainer.step + 1)

    def on_after_backward(self, trainer: Any, step: int) -> None:
        self._offset_for(step)
        self.pruner.observe()

    def on_step_end(self, trainer: Any, step: int, loss: float) -> None:
        schedule_step = step - self._offset_for(step)
        if self.pruner.step_count != schedule_step - 1:
            log.info(
                "tilesparse: schedule synced from step %d to the trainer's %d",
                self.pruner.step_count,
                schedule_step - 1,
            )
            self.pruner.step_count = schedule_step - 1
        self.pruner.step()

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        return None
