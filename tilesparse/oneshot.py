"""One-shot pruning: :func:`prune_` prunes a model to its target now, with or without a
calibration (:mod:`tilesparse.calibrate`), and hands back the
:class:`~tilesparse.pruner.TileSparsePruner` holding the masks."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from tilesparse.calibrate import Calibration, as_runner, collect_inputs, input_norms
from tilesparse.config import TileSparseConfig
from tilesparse.importance import ActivationScore
from tilesparse.pruner import FilterFn, TileSparsePruner
from tilesparse.refit import search_for

__all__ = ["prune_"]


def prune_(
    model: nn.Module,
    config: TileSparseConfig,
    filter_fn: FilterFn | None = None,
    calibration: Calibration | None = None,
    *,
    progress: bool = False,
) -> TileSparsePruner:
    """Prune ``model`` in place to ``config``'s target sparsity now (the schedule is not
    followed; use :class:`TileSparsePruner` to fine-tune along one).

    Without ``calibration``: the config's masks (automatic knobs: magnitude scores, one global
    threshold, the paper's column split).

    With ``calibration`` (see :mod:`tilesparse.calibrate`): the selected layers' inputs are
    gathered with hooks, every :data:`~tilesparse.calibrate.HOLD_OUT`-th sample held out.
    Automatic knobs (``None``) then mean: each layer pruned to the target sparsity, its mask
    scored by ``activation`` (``|w|·‖x‖``) or ``magnitude``, and for TW its column share 0.5
    or 0, whichever the held-out samples prefer. Layer by layer in the order the calibration
    calls them — each layer's inputs gathered again through the earlier layers, already
    pruned — the kept weights are refitted by damped least squares to the dense layer's
    outputs on the fit samples (per tile on its own rows; per column for EW and N:M), the
    damping chosen on held-out samples, and the refit is kept only where it lowers the
    held-out output error (:mod:`tilesparse.refit`). Explicit knobs are kept as given (a
    global threshold fixes the masks; only the refit is then chosen).
    ``pruner.reconstructions`` reports every layer's choice and errors.

    A layer whose weight tensor is another selected layer's (tied weights) is pruned once,
    through the first of them (``pruner.tied``), and not refitted.

    Args:
        model: any module holding ``nn.Linear`` layers.
        config: the pruning config; its importance must be computable without training
            (``magnitude``, or ``activation`` with a calibration, or automatic).
        filter_fn: ``(module, fqn) -> bool``; default: every ``nn.Linear``.
        calibration: ``fn(model)`` running representative inputs, or an iterable of argument
            tuples for ``model(*args)``; run in eval mode without gradients, several times
            (once, plus once per layer after the first).
        progress: a tqdm bar over the calibrated layers (on stderr).

    Returns:
        the pruner (masks attached; call ``.compress()`` for ``TileSparseLinear`` layers).

    Raises:
        ValueError: as :meth:`TileSparsePruner.prepare`, for an importance needing gradients,
            ``activation`` without a calibration, or a weight whose importance scores are
            not finite (naming the layer). The model is then exactly as it was.
        tilesparse.calibrate.CalibrationError: (a ``ValueError``) when the calibration raises,
            runs no pruned layer or feeds one a non-finite input, naming the layer; the model
            is unchanged then.
    """
    resolved = config.resolved(calibrated=calibration is not None)
    pruner = TileSparsePruner(resolved, filter_fn)
    if pruner.tracker.needs_gradients:
        raise ValueError(
            f"prune_ prunes now, without training, but importance="
            f"{resolved.importance_kind.value!r} needs gradients; use TileSparsePruner with a "
            "schedule, or importance='magnitude'"
        )
    if calibration is None:
        if pruner.tracker.needs_calibration:
            raise ValueError(
                "importance='activation' scores weights by their inputs: pass calibration= "
                "(a callable fn(model) or an iterable of argument tuples)"
            )
        pruner.prepare(model)  # takes its masks off again when it fails
        if pruner.current_sparsity != resolved.target_sparsity:
            _or_unprepare(pruner, resolved.target_sparsity)
        return pruner
    layers = pruner.select(model)
    run = as_runner(calibration)
    stats, order = collect_inputs(model, layers, run)
    dense = {f: m.weight.detach().clone() for f, m in layers.items()}
    try:
        if isinstance(pruner.tracker, ActivationScore):
            pruner.tracker.set_input_norms({f: input_norms(st) for f, st in stats.items()})
        pruner.prepare(model)
        if pruner.current_sparsity != resolved.target_sparsity:
            pruner.update_masks(resolved.target_sparsity)
        search = search_for(config, pruner.config)
        pruner.refit(order, dense, stats[order[0]], run, search, progress=progress)
    except BaseException:
        _restore_dense(layers, dense)
        pruner.model, pruner.layers = None, {}
        raise
    return pruner


def _or_unprepare(pruner: TileSparsePruner, sparsity: float) -> None:
    """``pruner.update_masks(sparsity)``; on failure (no weight changed yet) the masks come
    off again."""
    try:
        pruner.update_masks(sparsity)
    except BaseException:
        pruner.unprepare()
        raise


@torch.no_grad()
def _restore_dense(layers: dict[str, nn.Linear], dense: dict[str, torch.Tensor]) -> None:
    """Undo a failed calibrated prune: parametrizations off, the dense weights back."""
    for f, m in layers.items():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
        m.weight.copy_(dense[f])
