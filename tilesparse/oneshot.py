"""One-shot pruning: :func:`prune_` prunes a model to its target now, with or without a
calibration (:mod:`tilesparse.calibrate`), and hands back the
:class:`~tilesparse.pruner.TileSparsePruner` holding the masks."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from tilesparse.calibrate import (
    Calibration,
    OutputCheck,
    as_runner,
    collect_inputs,
    held_out_outputs,
    input_norms,
    output_error,
)
from tilesparse.config import TileSparseConfig
from tilesparse.importance import ActivationScore
from tilesparse.pruner import FilterFn, TileSparsePruner
from tilesparse.refit import search_for

log = logging.getLogger(__name__)

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
    Automatic knobs (``None``) then mean:

    - sparsity: every layer at the target (a global threshold over scores of layers whose
      inputs differ in scale can empty one layer and spare another);
    - TW: two consecutive layers joined by an elementwise activation (an FFN, an MLP's hidden
      layer) are pruned as *neurons* — the first layer's output columns and the second's input
      rows together, the second's kept weights and bias refitted by least squares
      (:mod:`tilesparse.neurons`); other layers as below;
    - every other layer: its mask scored by ``activation`` (``|w|·‖x‖``) or ``magnitude``, for
      TW with the column share 0.5 or 0, whichever the held-out samples prefer;
    - EW: SparseGPT (:func:`tilesparse.sparsegpt`, damping 0.1), Wanda's per-output mask or
      the magnitude mask, the latter two not refitted, whichever the held-out samples prefer.

    Layer by layer in the order the calibration calls them — each layer's inputs gathered
    again through the earlier layers, already pruned — the kept weights are refitted by damped
    least squares to the dense layer's outputs on the fit samples (per tile on its own rows;
    per column for EW and N:M), the damping chosen on held-out samples, and a refit is kept
    only where it lowers the held-out output error (:mod:`tilesparse.refit`). Explicit knobs
    are kept as given (a global threshold fixes the masks; only the refit is then chosen).
    Last, the last pruned layer's outputs on the held-out samples are compared with the
    uncalibrated prune's: the calibrated prune is kept only when it is not worse there
    (``pruner.output_check``), so calibrating never does worse than not calibrating on data
    the fit did not see. ``pruner.reconstructions`` reports every layer's choice and errors
    (empty when the uncalibrated prune was kept).

    A layer whose weight tensor is another selected layer's (tied weights) is pruned once,
    through the first of them (``pruner.tied``), and not refitted.

    Args:
        model: any module holding ``nn.Linear`` layers.
        config: the pruning config; its importance must be computable without training
            (``magnitude``, or ``activation`` with a calibration, or automatic).
        filter_fn: ``(module, fqn) -> bool``; default: every ``nn.Linear``.
        calibration: ``fn(model)`` running representative inputs, or an iterable of argument
            tuples for ``model(*args)``; run in eval mode without gradients, several times
            (about once per pruned layer, plus three checks), the same inputs each time.
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
    biases = {f: m.bias.detach().clone() for f, m in layers.items() if m.bias is not None}
    last = order[-1]
    try:
        reference = held_out_outputs(model, last, layers[last], run)
        if isinstance(pruner.tracker, ActivationScore):
            pruner.tracker.set_input_norms({f: input_norms(st) for f, st in stats.items()})
        pruner.prepare(model)
        uncalibrated = pruner.masks_from(
            {f: w.T.abs().float().cpu() for f, w in dense.items()}, resolved.target_sparsity
        )
        search = search_for(config, pruner.config)
        if pruner.current_sparsity != resolved.target_sparsity:
            pruner.update_masks(resolved.target_sparsity)
        pruner.refit(order, dense, stats[order[0]], run, search, progress=progress)
        pruner.output_check = _check_outputs(
            pruner, last, reference, run, dense, biases, uncalibrated
        )
    except BaseException:
        _restore_dense(layers, dense, biases)
        pruner.model, pruner.layers = None, {}
        raise
    return pruner


@torch.no_grad()
def _check_outputs(
    pruner: TileSparsePruner,
    last: str,
    reference: torch.Tensor,
    run: Callable[[nn.Module], None],
    dense: dict[str, torch.Tensor],
    biases: dict[str, torch.Tensor],
    uncalibrated: dict[str, torch.Tensor],
) -> OutputCheck:
    """Compare the calibrated prune with the uncalibrated one on the held-out samples at the
    last pruned layer's outputs; keep whichever is closer to the dense model's."""
    assert pruner.model is not None
    model, layers = pruner.model, pruner.layers
    module = layers[last]
    calibrated_error = output_error(held_out_outputs(model, last, module, run), reference)
    kept = {
        f: (
            pruner.mask(f),
            m.weight.detach().clone(),
            None if m.bias is None else m.bias.detach().clone(),
        )
        for f, m in layers.items()
    }
    _set_state(
        pruner, {f: (mask, dense[f].T * mask, biases.get(f)) for f, mask in uncalibrated.items()}
    )
    uncalibrated_error = output_error(held_out_outputs(model, last, module, run), reference)
    keep = calibrated_error <= uncalibrated_error
    if keep:
        _set_state(pruner, {f: (mask, w.T, b) for f, (mask, w, b) in kept.items()})
    else:
        pruner.reconstructions = []
        log.warning(
            "tilesparse: the calibrated prune's held-out error at %r (%.4g) is above the "
            "uncalibrated prune's (%.4g): the uncalibrated prune is kept",
            last,
            calibrated_error,
            uncalibrated_error,
        )
    return OutputCheck(last, calibrated_error, uncalibrated_error, keep)


def _set_state(
    pruner: TileSparsePruner,
    state: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> None:
    """Per layer ``(mask_kn, weight_kn, bias)``: set its mask, kept weights and bias."""
    for f, (mask, w_kn, b) in state.items():
        pruner.store(f, mask, w_kn)
        bias = pruner.layers[f].bias
        if bias is not None and b is not None:
            bias.copy_(b)


def _or_unprepare(pruner: TileSparsePruner, sparsity: float) -> None:
    """``pruner.update_masks(sparsity)``; on failure (no weight changed yet) the masks come
    off again."""
    try:
        pruner.update_masks(sparsity)
    except BaseException:
        pruner.unprepare()
        raise


@torch.no_grad()
def _restore_dense(
    layers: dict[str, nn.Linear], dense: dict[str, torch.Tensor], biases: dict[str, torch.Tensor]
) -> None:
    """Undo a failed calibrated prune: parametrizations off, the dense weights and biases
    back."""
    for f, m in layers.items():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
        m.weight.copy_(dense[f])
        if m.bias is not None and f in biases:
            m.bias.copy_(biases[f])
