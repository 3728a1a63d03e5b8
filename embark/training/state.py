"""What a training run is besides its weights and optimizer state: :class:`TrainState`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """The step counter and data-stream identity of a run, kept through checkpoints.

    All randomness of a run is in the model's initial weights, the data stream and
    ``generator`` (for callbacks that need random numbers; the global RNG is never used). The
    data stream position equals ``step`` (one batch per step).

    Attributes:
        step: optimizer steps taken so far (= training batches consumed).
        batch_size: samples per step of the data stream (all processes together): the first
            training batch's size (a stream's later batches may be shorter, e.g. a file's
            last); ``None`` before the first step. A larger batch is refused
            (:meth:`admit`): the stream changed under a resumed run.
        data_stream: a JSON-able mapping of what fixes the data stream besides
            ``batch_size`` (set by the caller, e.g. ``SyntheticCTR.stream_config()``);
            ``None`` when unknown.
        generator: a ``torch.Generator`` (seeded by ``TrainConfig.seed``).
        history: evaluation records ``{"step", "auc", "logloss", ...}`` from ``Trainer.fit``.
    """

    step: int = 0
    batch_size: int | None = None
    data_stream: dict[str, Any] | None = None
    generator: torch.Generator = field(default_factory=torch.Generator)
    history: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def seeded(cls, seed: int) -> TrainState:
        """A fresh run's state: step 0, ``generator`` seeded by ``seed``."""
        return cls(generator=torch.Generator().manual_seed(seed))

    def admit(self, n: int, what: str = "a batch") -> None:
        """Check a training batch of ``n`` samples against the stream's :attr:`batch_size`
        (before the step changes anything).

        Args:
            n: the batch's samples (all processes together).
            what: what ``n`` counts, for the message (``"a batch"``, ``"a global batch"``).

        Raises:
            ValueError: naming both sizes, for a batch larger than :attr:`batch_size`.
        """
        if self.batch_size is not None and n > self.batch_size:
            raise ValueError(
                f"train_step: {what} of {n} samples, but this trainer's data stream has "
                f"{self.batch_size} per step (recorded at its first step or in its checkpoint); a "
                "resumed run must be fed the stream it was trained on"
            )

    def advance(self, n: int) -> None:
        """Count one step on a batch of ``n`` samples (the first one fixes :attr:`batch_size`)."""
        self.step += 1
        if self.batch_size is None:
            self.batch_size = n

    def copy(self) -> TrainState:
        """An independent copy (its own generator in the same state, its own history list)."""
        gen = torch.Generator()
        gen.set_state(self.generator.get_state())
        return TrainState(self.step, self.batch_size, self.data_stream, gen, list(self.history))
