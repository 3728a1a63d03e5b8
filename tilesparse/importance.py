"""Importance scores of weights, and their aggregation into row-segment scores.

A score tracker sees the (masked) weights and, after each backward pass, their gradients; it
returns per layer a non-negative ``(K, N)`` float32 score in the ``W = linear.weight.T``
orientation, the input of :mod:`tilesparse.patterns`:

- :class:`MagnitudeScore`: ``|w|``;
- :class:`TaylorScore`: first-order Taylor ``Σ_t (g_t · w_t)²`` over the backward passes since
  the last mask update (at most ``max_steps`` of them; the paper sums ~100): the squared
  first-order change of the loss when ``w`` is zeroed;
- :class:`ActivationScore`: ``|w[k, n]| · ‖x_k‖₂ / rms(‖x‖)`` (Wanda, Sun et al. 2023) from
  the input norms a calibration measured (:mod:`tilesparse.calibrate`); the norms are taken
  relative to their RMS within the layer so that layers under one global threshold compete on
  their weights as with ``|w|``, the activations only re-ranking inside a layer;
- :class:`MovementScore`: ``-Σ_t g_t · w_t`` over the whole run, across mask updates (Sanh
  et al., 2020: weights moving away from zero score high), shifted by the minimum over all
  tracked layers so every score is >= 0 (the order of weights, within and across layers, is
  unchanged).

Row-segment aggregation: in tile ``t`` of kept columns ``cols_t``, row ``k``'s segment scores
the RMS ``‖S[k, cols_t]‖₂ / sqrt(|cols_t|)`` (so tiles of different widths compete fairly under
one threshold; for equal widths it ranks like the paper's ``‖·‖₂ / |cols_t|``) —
:func:`tilesparse.patterns.segment_scores`, re-exported here as :func:`segment_scores`.

>>> t = TaylorScore()
>>> w = {"fc": torch.tensor([[1., -2.], [3., 0.]])}      # (K=2, N=2)
>>> t.observe(w, {"fc": torch.tensor([[1., 1.], [0., 5.]])})
>>> t.observe(w, {"fc": torch.tensor([[1., 0.], [1., 1.]])})
>>> t.scores(w)["fc"]
tensor([[2., 4.],
        [9., 0.]])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from tilesparse.config import Importance
from tilesparse.patterns import segment_scores

__all__ = [
    "ScoreTracker",
    "MagnitudeScore",
    "TaylorScore",
    "MovementScore",
    "ActivationScore",
    "make_tracker",
    "segment_scores",
]

Tensors = Mapping[str, torch.Tensor]


class ScoreTracker(ABC):
    """Base class: scores from weights alone (``observe`` and ``reset`` are no-ops).

    Weights and gradients are ``(K, N)`` float tensors keyed by layer name.
    """

    needs_gradients = False
    # Whether the scores need a calibration's input statistics (tilesparse.calibrate)
    needs_calibration = False
    # Whether the pruner calls reset() after each mask update (scores since the last update);
    # False: the score accumulates over the whole run.
    reset_on_mask_update = True

    # observe/reset are deliberate no-op defaults: weight-only scores keep no state
    def observe(self, weights: Tensors, grads: Tensors) -> None:  # noqa: B027
        """Record one backward pass (called after ``loss.backward()``, before the step)."""

    def reset(self) -> None:  # noqa: B027
        """Forget what was observed (the pruner calls it after each mask update when
        ``reset_on_mask_update``)."""

    @abstractmethod
    def scores(self, weights: Tensors) -> dict[str, torch.Tensor]:
        """Per layer ``(K, N) float32`` non-negative scores."""

    def state(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(backward passes observed, per layer (K, N) float32 sums)``, what a resume needs;
        weight-only scores keep none."""
        return 0, {}

    def load_state(self, steps: int, sums: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state`.

        Raises:
            ValueError: for observations given to a score that keeps none.
        """
        if steps or sums:
            raise ValueError(
                f"{type(self).__name__} keeps no observations, got {steps} step(s) "
                f"and sums for {sorted(sums)}"
            )


class _SummedScore(ScoreTracker):
    """A score summed over backward passes: ``steps`` observed, ``_acc`` the per-layer sums."""

    def __init__(self) -> None:
        self.steps = 0
        self._acc: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.steps = 0
        self._acc = {}

    def state(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.steps, {
            k: v.detach().cpu().clone(memory_format=torch.contiguous_format)
            for k, v in self._acc.items()
        }

    def load_state(self, steps: int, sums: dict[str, torch.Tensor]) -> None:
        self.steps = steps
        self._acc = {k: v.detach().cpu().float().clone() for k, v in sums.items()}


def _check_observed(kind: str, weights: Tensors, sums: Tensors) -> None:
    """Raise ``RuntimeError`` naming the layers of ``weights`` that no observed backward pass
    gave a gradient (e.g. frozen with ``requires_grad_(False)``)."""
    missing = sorted(set(weights) - set(sums))
    if missing:
        raise RuntimeError(f"{kind} importance has no gradients for layer(s) {missing}")


class MagnitudeScore(ScoreTracker):
    """``|w|``."""

    def scores(self, weights: Tensors) -> dict[str, torch.Tensor]:
        return {k: w.detach().abs().float().cpu() for k, w in weights.items()}


class TaylorScore(_SummedScore):
    """``Σ (g · w)²`` over at most ``max_steps`` backward passes since the last reset.

    Raises (from :meth:`scores`):
        RuntimeError: when nothing was observed — a Taylor score needs gradients, so the first
            mask update must come after at least one backward pass — or a layer got no
            gradient in any observed backward pass (naming the layers).
    """

    needs_gradients = True

    def __init__(self, max_steps: int = 100) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        super().__init__()
        self.max_steps = max_steps

    def observe(self, weights: Tensors, grads: Tensors) -> None:
        if self.steps >= self.max_steps:
            return
        for k, g in grads.items():
            term = (g.detach().float() * weights[k].detach().float()).pow(2).cpu()
            self._acc[k] = self._acc[k] + term if k in self._acc else term
        self.steps += 1

    def scores(self, weights: Tensors) -> dict[str, torch.Tensor]:
        if self.steps == 0:
            raise RuntimeError(
                "Taylor importance has observed no backward pass yet: schedule the first mask "
                "update after at least one training step (e.g. OneShotSchedule(step=100)), or "
                "use importance='magnitude'"
            )
        _check_observed("Taylor", weights, self._acc)
        return {k: self._acc[k].clone() for k in weights}


class MovementScore(_SummedScore):
    """``-Σ g · w`` since the last :meth:`reset`, shifted to be >= 0 across all layers.

    Unlike Taylor, movement keeps accumulating across mask updates (the pruner never resets
    it): it measures where weights have been heading during fine-tuning.

    Raises (from :meth:`scores`):
        RuntimeError: when nothing was observed, or a layer got no gradient in any observed
            backward pass (naming the layers).
    """

    needs_gradients = True
    reset_on_mask_update = False

    def observe(self, weights: Tensors, grads: Tensors) -> None:
        for k, g in grads.items():
            term = -(g.detach().float() * weights[k].detach().float()).cpu()
            self._acc[k] = self._acc[k] + term if k in self._acc else term
        self.steps += 1

    def reset(self) -> None:
        """Movement accumulates over the whole run; the pruner does not call this between
        updates. Call it by hand to start afresh."""
        super().reset()

    def scores(self, weights: Tensors) -> dict[str, torch.Tensor]:
        if self.steps == 0:
            raise RuntimeError(
                "movement importance has observed no backward pass yet: schedule the first "
                "mask update after some training steps, or use importance='magnitude'"
            )
        _check_observed("movement", weights, self._acc)
        raw = {k: self._acc[k] for k in weights}
        low = min(float(v.min()) for v in raw.values() if v.numel())
        return {k: v - low for k, v in raw.items()}


class ActivationScore(ScoreTracker):
    """``|w[k, n]| · ‖x_k‖ / rms_k(‖x_k‖)``, from the per-layer input norms of a calibration.

    Raises (from :meth:`scores`):
        RuntimeError: for a layer whose input norms were never set (no calibration ran).
    """

    needs_calibration = True

    def __init__(self) -> None:
        self.input_norms: dict[str, torch.Tensor] = {}

    def set_input_norms(self, norms: Mapping[str, torch.Tensor]) -> None:
        """Per layer ``(K,)`` non-negative input norms ``‖x_k‖₂`` (replacing earlier ones)."""
        self.input_norms = {k: v.detach().float().cpu() for k, v in norms.items()}

    def scores(self, weights: Tensors) -> dict[str, torch.Tensor]:
        missing = sorted(set(weights) - set(self.input_norms))
        if missing:
            raise RuntimeError(
                f"activation importance has no calibration inputs for layer(s) {missing}: pass "
                f"calibration= to tilesparse.prune_ (or use importance='magnitude')"
            )
        out = {}
        for k, w in weights.items():
            norm = self.input_norms[k]
            if norm.numel() != w.shape[0]:
                raise RuntimeError(
                    f"activation importance: layer {k!r} has {w.shape[0]} inputs, its norms {norm.numel()}"
                )
            rms = float(norm.pow(2).mean().sqrt())
            rel = norm / rms if rms > 0 else torch.ones_like(norm)
            out[k] = w.detach().abs().float().cpu() * rel.unsqueeze(1)
        return out


def make_tracker(kind: Importance | str, taylor_steps: int = 100) -> ScoreTracker:
    """The tracker for an :class:`~tilesparse.config.Importance`."""
    kind = Importance(kind)
    if kind is Importance.MAGNITUDE:
        return MagnitudeScore()
    if kind is Importance.TAYLOR:
        return TaylorScore(taylor_steps)
    if kind is Importance.ACTIVATION:
        return ActivationScore()
    return MovementScore()
