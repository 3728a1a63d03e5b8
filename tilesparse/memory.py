"""How much memory a condensed tile-wise (TW) weight takes, measured from its tensors.

:func:`layer_memory` reads the byte sizes of one layer's actual tensors (never a formula), and
:func:`model_memory` sums them over every linear layer of a model, so a user can say
"weights: 64.0 MiB dense → 16.3 MiB condensed".

What is counted, per layer (``K`` in-features, ``N`` out-features, ``itemsize`` of the
weight's dtype)::

    dense_bytes   K · N · itemsize                  the weight an nn.Linear would hold
    values_bytes  values.numel() · itemsize         the kept weights (dense per-tile blocks)
    index_bytes   col_idx, tile_ptr, row_idx,       int64 metadata; for a pruned but not yet
                  row_ptr, val_ptr                  condensed nn.Linear: its mask buffer
    cache_bytes   tensors a backend keeps in        derived data (packed blocks); 0 today
                  TWLayout.cache
    bias_bytes    bias.numel() · itemsize           the same dense or condensed, so kept out
                                                    of the fractions

Worked example: the layout drawn in :mod:`tilesparse.format` (K=4, N=6, G=2, 3 tiles, 10 kept
fp32 weights of 24). Its 23 int64 indices (4 col_idx + 7 row_idx + 3·4 pointers) take 184 bytes,
about twice the 96-byte dense weight: on a toy layer the indices dominate. For a real layer the
row indices cost one int64 per kept tile-row of ``G`` values, i.e. about ``2·(1−s)/G`` of the
dense fp32 weight (0.4% at G=128, s=0.75)::

      n=0 1 2 3 4 5
    k=0 x x . . x .
    k=1 . . . . x x
    k=2 x x . . . x
    k=3 x x . . . .

>>> import torch
>>> from tilesparse.format import condense
>>> mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1],
...                      [1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
>>> mem = layer_memory(condense(torch.ones(4, 6), mask, tile=2))
>>> (mem.dense_bytes, mem.values_bytes, mem.index_bytes, mem.bias_bytes)
(96, 40, 184, 0)
>>> round(mem.values_fraction, 3), round(mem.index_fraction, 3), round(mem.density, 3)
(0.417, 1.917, 0.417)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from tilesparse.format import TWLayout
from tilesparse.linear import TileSparseLinear

__all__ = ["LayerMemory", "ModelMemory", "layer_memory", "model_memory"]

MIB = 2**20  # bytes per MiB


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (a tensor, or mappings/sequences of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


@dataclass(frozen=True)
class LayerMemory:
    """Bytes of one linear layer, dense versus as stored (see the module docstring).

    Attributes:
        in_features: ``K``.
        out_features: ``N``.
        itemsize: bytes per weight element (4 for fp32, 2 for bf16/fp16).
        nnz: weight values stored.
        dense_bytes: ``K · N · itemsize``.
        values_bytes: bytes of the stored weight values.
        index_bytes: bytes of index metadata (or of the mask of a masked ``nn.Linear``).
        cache_bytes: bytes of backend-derived tensors held beside the layout.
        bias_bytes: bytes of the bias (0 without one).
    """

    in_features: int
    out_features: int
    itemsize: int
    nnz: int
    dense_bytes: int
    values_bytes: int
    index_bytes: int
    cache_bytes: int
    bias_bytes: int

    @property
    def density(self) -> float:
        """Stored values over ``K · N``."""
        return self.nnz / max(1, self.in_features * self.out_features)

    @property
    def weight_bytes(self) -> int:
        """Bytes the weight takes as stored: values + indices + backend cache (no bias)."""
        return self.values_bytes + self.index_bytes + self.cache_bytes

    @property
    def values_fraction(self) -> float:
        return self.values_bytes / max(1, self.dense_bytes)

    @property
    def index_fraction(self) -> float:
        return self.index_bytes / max(1, self.dense_bytes)

    @property
    def total_fraction(self) -> float:
        """:attr:`weight_bytes` over :attr:`dense_bytes`."""
        return self.weight_bytes / max(1, self.dense_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The fields and the derived fractions, for JSON."""
        return asdict(self) | {
            "density": self.density,
            "weight_bytes": self.weight_bytes,
            "values_fraction": self.values_fraction,
            "index_fraction": self.index_fraction,
            "total_fraction": self.total_fraction,
        }


def layer_memory(layer: TileSparseLinear | TWLayout | nn.Linear) -> LayerMemory:
    """Measure one layer from its tensors.

    Args:
        layer: a :class:`TileSparseLinear`, a bare :class:`TWLayout` (no bias), or a dense
            ``nn.Linear`` (stored values = the whole weight; when the pruner has put a mask
            parametrization on it, the kept-dense ``original`` is counted as values and the mask
            buffer as index bytes, since that is what it holds).

    Returns:
        the layer's :class:`LayerMemory`.

    Raises:
        ValueError: for any other type.
    """
    if isinstance(layer, TileSparseLinear):
        lay = layer.layout
        bias = 0 if layer.bias is None else _tensor_bytes(layer.bias)
        return _from_layout(lay, bias)
    if isinstance(layer, TWLayout):
        return _from_layout(layer, 0)
    if isinstance(layer, nn.Linear):
        if parametrize.is_parametrized(layer, "weight"):
            holder = cast(
                parametrize.ParametrizationList,
                cast(nn.ModuleDict, layer.parametrizations)["weight"],
            )
            weight = holder.original
            index = sum(_tensor_bytes(b) for p in holder for b in p.buffers())
        else:
            weight, index = layer.weight, 0
        item = weight.element_size()
        return LayerMemory(
            in_features=layer.in_features,
            out_features=layer.out_features,
            itemsize=item,
            nnz=weight.numel(),
            dense_bytes=layer.in_features * layer.out_features * item,
            values_bytes=_tensor_bytes(weight),
            index_bytes=index,
            cache_bytes=0,
            bias_bytes=0 if layer.bias is None else _tensor_bytes(layer.bias),
        )
    raise ValueError(
        f"layer_memory takes a TileSparseLinear, a TWLayout or an nn.Linear, got {type(layer).__name__}"
    )


def _from_layout(lay: TWLayout, bias_bytes: int) -> LayerMemory:
    item = lay.values.element_size()
    return LayerMemory(
        in_features=lay.in_features,
        out_features=lay.out_features,
        itemsize=item,
        nnz=lay.values.numel(),
        dense_bytes=lay.in_features * lay.out_features * item,
        values_bytes=_tensor_bytes(lay.values),
        index_bytes=_tensor_bytes(
            [lay.col_idx, lay.tile_ptr, lay.row_idx, lay.row_ptr, lay.val_ptr]
        ),
        cache_bytes=_tensor_bytes(lay.cache),
        bias_bytes=bias_bytes,
    )


@dataclass(frozen=True)
class ModelMemory:
    """Memory of every linear layer of a model (see :func:`model_memory`).

    Attributes:
        layers: ``(fqn, LayerMemory)`` per ``nn.Linear`` / ``TileSparseLinear``, in
            ``named_modules`` order.
        other_bytes: bytes of every other parameter and buffer of the model (embeddings,
            norms, attention in-projections), counted once each.
    """

    layers: tuple[tuple[str, LayerMemory], ...]
    other_bytes: int

    def _sum(self, name: str) -> int:
        return sum(getattr(m, name) for _, m in self.layers)

    @property
    def sparse_layers(self) -> tuple[str, ...]:
        """Names of the layers stored condensed (or masked)."""
        return tuple(
            f for f, m in self.layers if m.index_bytes or m.nnz != m.in_features * m.out_features
        )

    @property
    def dense_bytes(self) -> int:
        """Every linear weight as dense ``K × N`` (no bias)."""
        return self._sum("dense_bytes")

    @property
    def weight_bytes(self) -> int:
        """Every linear weight as stored: condensed values + indices, or dense (no bias)."""
        return self._sum("weight_bytes")

    @property
    def index_bytes(self) -> int:
        return self._sum("index_bytes")

    @property
    def bias_bytes(self) -> int:
        return self._sum("bias_bytes")

    @property
    def total_fraction(self) -> float:
        """:attr:`weight_bytes` over :attr:`dense_bytes`."""
        return self.weight_bytes / max(1, self.dense_bytes)

    def summary(self) -> str:
        """One line: ``weights: 64.0 MiB dense → 16.3 MiB condensed (25.4%, indices 0.4%) ...``."""
        return (
            f"weights: {self.dense_bytes / MIB:.1f} MiB dense → {self.weight_bytes / MIB:.1f} MiB "
            f"condensed ({100 * self.total_fraction:.1f}%, indices "
            f"{100 * self.index_bytes / max(1, self.dense_bytes):.1f}%) over {len(self.layers)} "
            f"linear layers ({len(self.sparse_layers)} sparse); biases {self.bias_bytes / MIB:.2f} "
            f"MiB; other parameters and buffers {self.other_bytes / MIB:.1f} MiB"
        )

    def to_dict(self) -> dict[str, Any]:
        """Totals and per-layer rows, for JSON."""
        return {
            "dense_bytes": self.dense_bytes,
            "weight_bytes": self.weight_bytes,
            "index_bytes": self.index_bytes,
            "bias_bytes": self.bias_bytes,
            "other_bytes": self.other_bytes,
            "total_fraction": self.total_fraction,
            "layers": {f: m.to_dict() for f, m in self.layers},
        }


def model_memory(model: nn.Module) -> ModelMemory:
    """Measure every ``nn.Linear`` (subclasses included) and :class:`TileSparseLinear` of
    ``model`` with :func:`layer_memory`, and the bytes of everything else it holds.

    Returns:
        the :class:`ModelMemory`; ``print(model_memory(m).summary())`` for one line.

    Raises:
        ValueError: when ``model`` is not an ``nn.Module`` or holds no linear layer.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model_memory takes an nn.Module, got {type(model).__name__}")
    layers = tuple(
        (fqn, layer_memory(m))
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear | TileSparseLinear)
    )
    if not layers:
        raise ValueError(
            f"model_memory: {type(model).__name__} holds no nn.Linear or TileSparseLinear layer"
        )
    counted: set[int] = set()
    for fqn, _ in layers:
        m = model.get_submodule(fqn)
        counted.update(id(t) for t in m.parameters())
        counted.update(id(t) for t in m.buffers())
    other = 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in counted:
            counted.add(id(t))
            other += _tensor_bytes(t)
    return ModelMemory(layers=layers, other_bytes=other)
