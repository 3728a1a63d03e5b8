"""Evaluation metrics: ROC AUC (ties counted as half, like the Mann-Whitney U statistic) and
binary log loss; :class:`Monitor`, a metric watched for early stopping and keep-best
checkpoints."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

ArrayLike = torch.Tensor | np.ndarray | Sequence[float]

_PROB_EPS = 1e-7  # clamp for log(p) on probabilities, as sklearn's float32 default


def _as_1d(x: ArrayLike, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        a = a.reshape(-1)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what} contains NaN or inf")
    return a


def _labels(labels: ArrayLike, n: int) -> np.ndarray:
    y = _as_1d(labels, "labels")
    if y.shape[0] != n:
        raise ValueError(f"scores has {n} entries but labels has {y.shape[0]}")
    bad = ~np.isin(y, (0.0, 1.0))
    if bad.any():
        raise ValueError(
            f"labels must be 0 or 1, got {float(y[bad][0])} at index {int(np.argmax(bad))}"
        )
    return y


def auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random
    negative, a tie counting 1/2.

    Args:
        scores: ``(N,)`` any real scores (logits or probabilities; only their order matters).
        labels: ``(N,)`` values in {0, 1}.

    Raises:
        ValueError: on length mismatch, non-binary labels, NaN scores, or when only one class
            is present (AUC is undefined).
    """
    s = _as_1d(scores, "scores")
    y = _labels(labels, s.shape[0])
    pos = int(y.sum())
    neg = y.shape[0] - pos
    if pos == 0 or neg == 0:
        raise ValueError(f"AUC needs both classes, got {pos} positives and {neg} negatives")
    # Mid-ranks: sort, then give every member of a run of equal scores the mean of its ranks.
    order = np.argsort(s, kind="stable")
    s_sorted = s[order]
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    ends = np.r_[starts[1:], s_sorted.shape[0]]
    mid = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty_like(s)
    ranks[order] = np.repeat(mid, ends - starts)
    u = ranks[y == 1].sum() - pos * (pos + 1) / 2.0
    return float(u / (pos * neg))


def log_loss(
    probs_or_logits: ArrayLike, labels: ArrayLike, *, from_logits: bool | None = None
) -> float:
    """Mean binary cross-entropy in nats.

    Args:
        probs_or_logits: ``(N,)`` probabilities in [0, 1] or logits.
        labels: ``(N,)`` values in {0, 1}.
        from_logits: ``True`` for logits, ``False`` for probabilities; ``None`` (default)
            treats the input as probabilities when every value lies in [0, 1], else as logits.
            Pass it explicitly when logits might all fall in [0, 1].

    Raises:
        ValueError: on length mismatch, non-binary labels, NaN, or probabilities outside [0, 1]
            with ``from_logits=False``.
    """
    x = _as_1d(probs_or_logits, "probs_or_logits")
    y = _labels(labels, x.shape[0])
    if x.shape[0] == 0:
        raise ValueError("log_loss of an empty set")
    in_unit = bool(np.all((x >= 0.0) & (x <= 1.0)))
    if from_logits is None:
        from_logits = not in_unit
    if from_logits:
        # log(1 + e^-|x|) form: stable for large |x|.
        loss = np.maximum(x, 0.0) - x * y + np.log1p(np.exp(-np.abs(x)))
    else:
        if not in_unit:
            raise ValueError("probabilities must lie in [0, 1]; pass from_logits=True for logits")
        p = np.clip(x, _PROB_EPS, 1.0 - _PROB_EPS)
        loss = -(y * np.log(p) + (1.0 - y) * np.log1p(-p))
    return float(loss.mean())


class MetricMode(StrEnum):
    """Which way a monitored metric improves: ``max`` (AUC) or ``min`` (log loss)."""

    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class Monitor:
    """A validation metric to watch (early stopping, keep-best checkpoints).

    Args:
        metric: the key of :meth:`~embark.training.trainer.Trainer.evaluate`'s record
            (``"auc"``, ``"logloss"``).
        mode: which way it improves.
        min_delta: an improvement smaller than this (>= 0) does not count.

    Raises:
        ValueError: for a negative or non-finite ``min_delta``, or an unknown mode.
    """

    metric: str = "auc"
    mode: MetricMode = MetricMode.MAX
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", MetricMode(self.mode))
        except ValueError:
            raise ValueError(
                f"Monitor.mode must be one of {[m.value for m in MetricMode]}, got {self.mode!r}"
            ) from None
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise ValueError(
                f"Monitor.min_delta must be a finite number >= 0, got {self.min_delta!r}"
            )

    def value(self, metrics: Mapping[str, float]) -> float:
        """The watched metric of an evaluation record.

        Raises:
            KeyError: naming the metric and the record's keys, when it is missing.
        """
        if self.metric not in metrics:
            raise KeyError(
                f"monitored metric {self.metric!r} is not in the evaluation; it has {sorted(metrics)}"
            )
        return float(metrics[self.metric])

    def improves(self, value: float, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` by more than ``min_delta`` (any finite value beats
        ``None``; a NaN never improves)."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        if self.mode is MetricMode.MAX:
            return value > best + self.min_delta
        return value < best - self.min_delta
