"""What :meth:`embark.training.trainer.Trainer.fit` returns: :class:`FitReport`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class FitReport:
    """One :meth:`~embark.training.trainer.Trainer.fit` (or ``fit_epochs``) call.

    Attributes:
        steps: optimizer steps this call ran (fewer than asked when a callback stopped it).
        samples: training samples of those steps (this process's).
        seconds: time inside the training steps (evaluation and checkpoints left out).
        loss_sum: the sum of the steps' mean losses.
        epochs: whole epochs this call finished (``fit_epochs``; 0 for ``fit``).
        stop_reason: why a callback stopped the call early
            (:meth:`~embark.training.trainer.Trainer.request_stop`); ``None``: it ran to the end.
        evaluations: the periodic evaluations of this call, in order (records as
            :meth:`~embark.training.trainer.Trainer.evaluate` returns them).
    """

    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    loss_sum: float = 0.0
    epochs: int = 0
    stop_reason: str | None = None
    evaluations: list[dict[str, float]] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """The mean of the steps' losses (``nan`` for no step)."""
        return self.loss_sum / self.steps if self.steps else math.nan

    @property
    def samples_per_s(self) -> float:
        """Training throughput of this call (0 when no time was measured)."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def stopped_early(self) -> bool:
        """Whether a callback stopped the call before its last step."""
        return self.stop_reason is not None
