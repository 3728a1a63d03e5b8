"""Which layers a pruner prunes: the ``nn.Linear`` modules a filter selects, one per weight
tensor.

Layers can share one weight tensor (tied weights, e.g. an encoder and a decoder projection):
such a tensor is pruned once, with the mask of the first layer holding it in module order::

    model: a (Linear, weight W), b (Linear, weight W, tied to a), c (Linear, weight V)
    select_layers(model, default_filter) == ({"a": a, "c": c}, {"b": "a"})
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.nn.utils import parametrize

__all__ = ["FilterFn", "default_filter", "select_layers"]

FilterFn = Callable[[nn.Module, str], bool]


def default_filter(module: nn.Module, fqn: str) -> bool:
    """Every ``nn.Linear`` (subclasses included)."""
    return isinstance(module, nn.Linear)


def select_layers(
    model: nn.Module, filter_fn: FilterFn, overrides: Iterable[tuple[str, float]] = ()
) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """The layers of ``model`` to prune, and the selected layers tied to one of them.

    Args:
        model: the model whose ``nn.Linear`` modules are searched, in module order.
        filter_fn: ``(module, fqn) -> bool``, which of them to prune.
        overrides: ``(fqn, sparsity)`` pairs (``TileSparseConfig.overrides``); each must
            name a returned layer.

    Returns:
        ``(layers, tied)``: fqn → layer, one per weight tensor (the first in module order);
        every other selected layer sharing a tensor → the layer that owns it.

    Raises:
        ValueError: when no layer is selected, a selected layer is empty or already has a
            weight parametrization, or an override names a layer that is not returned.
    """
    found = {
        fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and filter_fn(m, fqn)
    }
    if not found:
        raise ValueError("no nn.Linear layer selected by filter_fn: nothing to prune")
    layers, tied = _untied(found)
    for fqn, m in found.items():
        if parametrize.is_parametrized(m, "weight"):
            raise ValueError(f"layer {fqn!r} already has a weight parametrization")
        if m.weight.numel() == 0:
            raise ValueError(
                f"layer {fqn!r} has an empty weight of shape {tuple(m.weight.shape)} (out x in "
                f"features): nothing to prune; leave it out with filter_fn"
            )
    unknown = sorted(set(dict(overrides)) - set(layers))
    if unknown:
        raise ValueError(
            f"overrides name layer(s) {unknown} that are not selected (or share another "
            f"selected layer's weight); selected: {sorted(layers)}"
        )
    return layers, tied


def _untied(found: dict[str, nn.Linear]) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """``(layers, tied)``: the selected layers with one layer per weight tensor (the first in
    module order), and every other layer sharing a tensor → the layer that owns it."""
    owner: dict[tuple[int, int, tuple[int, ...]], str] = {}
    layers: dict[str, nn.Linear] = {}
    tied: dict[str, str] = {}
    for fqn, m in found.items():
        w = m.weight
        key = (w.untyped_storage().data_ptr(), int(w.storage_offset()), tuple(w.shape))
        if w.numel() and key in owner:
            tied[fqn] = owner[key]
        else:
            owner[key] = fqn
            layers[fqn] = m
    return layers, tied
