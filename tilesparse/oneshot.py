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

    With ``calibration`` (see :mod:`tilesparse.calibrate`): the selected layers' input Gram
    matrices are gathered with hooks on the dense model; ``importance="activation"`` scores
    ``|w|·‖x‖`` from them (``magnitude`` keeps its mask); then, layer by layer in the order the
    calibration calls them, each layer's inputs are gathered again — through the earlier
    layers, already pruned and reconstructed — and its kept weights are refitted by damped
    least squares to the dense layer's outputs (per tile on its own rows; per column for EW and
    N:M). The masks are those chosen before reconstruction. ``pruner.reconstructions`` holds
    each layer's relative output error before and after.

    Args:
        model: any module holding ``nn.Linear`` layers.
        config: the pruning config; its importance must be computable without training
            (``magnitude``, or ``activation`` with a calibration).
        filter_fn: ``(module, fqn) -> bool``; default: every ``nn.Linear``.
        calibration: ``fn(model)`` running representative inputs, or an iterable of argument
            tuples for ``model(*args)``; run in eval mode without gradients, several times
            (once, plus once per layer after the first).
        progress: a tqdm bar over the reconstructed layers (on stderr).

    Returns:
        the pruner (masks attached; call ``.compress()`` for ``TileSparseLinear`` layers).

    Raises:
        ValueError: as :meth:`TileSparsePruner.prepare`, for an importance needing gradients,
            or ``activation`` without a calibration.
        tilesparse.calibrate.CalibrationError: (a ``ValueError``) when the calibration raises, runs no pruned layer
            or feeds one a non-finite input, naming the layer; the model is unchanged then.
    """
    pruner = TileSparsePruner(config, filter_fn)
    if pruner.tracker.needs_gradients:
        raise ValueError(
            f"prune_ prunes now, without training, but importance={config.importance.value!r} "
            "needs gradients; use TileSparsePruner with a schedule, or importance='magnitude'"
        )
    if calibration is None:
        if pruner.tracker.needs_calibration:
            raise ValueError(
                "importance='activation' scores weights by their inputs: pass calibration= "
                "(a callable fn(model) or an iterable of argument tuples)"
            )
        pruner.prepare(model)
        if pruner.current_sparsity != config.target_sparsity:
            pruner.update_masks(config.target_sparsity)
        return pruner
    layers = pruner.select(model)
    run = as_runner(calibration)
    stats, order = collect_inputs(model, layers, run)
    dense = {f: m.weight.detach().clone() for f, m in layers.items()}
    try:
        if isinstance(pruner.tracker, ActivationScore):
            pruner.tracker.set_input_norms({f: input_norms(st) for f, st in stats.items()})
        pruner.prepare(model)
        if pruner.current_sparsity != config.target_sparsity:
            pruner.update_masks(config.target_sparsity)
        pruner.reconstruct(order, dense, stats[order[0]], run, progress=progress)
    except BaseException:
        _restore_dense(layers, dense)
        pruner.model, pruner.layers = None, {}
        raise
    return pruner


@torch.no_grad()
def _restore_dense(layers: dict[str, nn.Linear], dense: dict[str, torch.Tensor]) -> None:
    """Undo a failed calibrated prune: parametrizations off, the dense weights back."""
    for f, m in layers.items():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
        m.weight.copy_(dense[f])
