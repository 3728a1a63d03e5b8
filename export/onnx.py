"""ONNX export of a (pruned) DLRM that onnxruntime runs with standard ops only.

Two graphs are offered:

* ``include_embeddings=True``: inputs ``dense (B, D) float32`` and one ``ids_<table> (B, H_t)
  int64`` per table (``-1`` pads a short bag); the embedding bags are ``Gather`` + ``ReduceSum``
  over a table with one extra zero row that the padding points at — no ONNX ``Loop``.
* ``include_embeddings=False``: the dense part alone, inputs ``dense (B, D)`` and ``pooled
  (B, T, dim)`` — what a server that looks embeddings up in the parameter server (``hps``) runs.

A :class:`~tilesparse.linear.TileSparseLinear` becomes, per tile ``t``, a row ``Gather`` of the
transposed input and one ``MatMul`` by the transposed block; the tile outputs are concatenated
(rows) with one zero row and a last ``Gather`` puts every output column in place (pruned
columns read the zero row)::

    x (B,K) ─Transpose─ xᵀ (K,B) ─Gather rows_0─ B_0ᵀ·(k_0,B) ─┐
                                 ─Gather rows_1─ B_1ᵀ·(k_1,B) ─┼─Concat(+ zero row)─Gather(col_map)─Transpose─ + bias ─▶ y (B,N)
                                 ─  ...                      ─┘
    col_map[n] = position of column n in the concatenation, or Nk (the zero row)

Why K-major: a kept K index is then a contiguous row of ``B`` values, so each ``Gather`` is a
row copy and each ``MatMul`` is wide (``B`` columns). Gathering columns of ``x (B, K)`` instead
made onnxruntime slower than the dense graph (DLRM-DCNv2 dense part at full width, TW 75 %,
batch 1024, 1 thread: 543 ms against 442 ms dense; K-major: 201 ms).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from embark.interop.torchrec_model import EBCModel, from_torchrec_dlrm
from embark.models.dlrm import DLRM
from embark.types import Combiner, TableConfig
from hps.artifact_format import SERVING_METADATA_KEY, ServingMetadata, TableMetadata
from tilesparse.linear import TileSparseLinear

log = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)

DEFAULT_OPSET = 20  # torch 2.13's ONNX_DEFAULT_OPSET (torch/onnx/_constants.py)
MIN_OPSET = 18  # torch's op library (torchlib) is written at 18; lower needs down-conversion

__all__ = [
    "CondensedLinear",
    "ExportableModel",
    "as_exportable",
    "check_exportable",
    "export_onnx",
    "model_tables",
    "onnx_inputs",
    "run_onnx",
]

ExportableModel = DLRM | EBCModel
"""What export takes: embark's :class:`DLRM`, or an :class:`~embark.interop.EBCModel` (a
TorchRec ``EmbeddingBagCollection`` and a dense module)."""


def as_exportable(
    model: nn.Module,
    caller: str = "export_onnx",
    hotness: int | Mapping[str, int] | None = None,
) -> ExportableModel:
    """``model`` as export takes it: a :class:`DLRM` or an :class:`EBCModel` as it is, TorchRec's
    own ``DLRM`` / ``DLRM_DCN`` (``torchrec.models.dlrm``) through
    :func:`embark.interop.from_torchrec_dlrm` (its modules shared) with ``hotness``, each
    table's maximum bag size, which TorchRec does not record (``{table: n}``, or inferred
    from data by :func:`embark.data.max_bag_sizes`).

    Raises:
        TypeError: naming the type, for any other module.
        ValueError: a TorchRec DLRM without ``hotness``, naming its tables; a mapping
            missing tables, naming them.
    """
    if isinstance(model, DLRM | EBCModel):
        return model
    if type(model).__module__.startswith("torchrec.") and hasattr(model, "sparse_arch"):
        if hotness is None:
            sparse_arch: Any = model.sparse_arch
            names = list(sparse_arch.embedding_bag_collection.embedding_bags)
            raise ValueError(
                f"{caller}: TorchRec's DLRM does not record its tables' maximum bag sizes; "
                f"pass hotness={{table: n}} for tables {names} (or one int for all; infer "
                "them from data with embark.data.max_bag_sizes(batches))"
            )
        return from_torchrec_dlrm(model, hotness)
    raise TypeError(
        f"{caller} takes embark's DLRM, an embark.interop.EBCModel (a TorchRec "
        f"EmbeddingBagCollection and a dense module) or TorchRec's DLRM, got a "
        f"{type(model).__module__}.{type(model).__name__}"
    )


def model_tables(model: ExportableModel) -> tuple[TableConfig, ...]:
    """The tables of ``model``, in the order of its pooled input."""
    return model.tables if isinstance(model, EBCModel) else model.workload.tables


def _dense_features(model: ExportableModel) -> int:
    return model.dense_features if isinstance(model, EBCModel) else model.workload.dense_features


class CondensedLinear(nn.Module):
    """A :class:`TileSparseLinear` as standard ops (see the module docstring).

    ``forward(x: (B, K)) -> (B, N)``, equal to the layer's reference forward.
    """

    col_map: torch.Tensor  # (N,) int64 buffer
    bias: torch.Tensor | None  # (N,) buffer

    def __init__(self, layer: TileSparseLinear) -> None:
        super().__init__()
        lay = layer.layout
        self.out_features = layer.out_features
        self.num_tiles = lay.num_tiles
        col_map = torch.full((layer.out_features,), lay.col_idx.numel(), dtype=torch.int64)
        col_map[lay.col_idx.cpu()] = torch.arange(lay.col_idx.numel())
        self.register_buffer("col_map", col_map)
        for t in range(lay.num_tiles):
            self.register_buffer(f"rows_{t}", lay.tile_rows(t).detach().clone())
            self.register_buffer(f"block_{t}_t", lay.block(t).detach().t().contiguous())
        bias = layer.bias.detach().clone() if layer.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xt = x.t()  # (K, B): a kept row index selects a contiguous row
        parts = []
        for t in range(self.num_tiles):
            rows = getattr(self, f"rows_{t}")
            block_t = getattr(self, f"block_{t}_t")  # (n_t, k_t)
            if rows.numel() == 0:
                parts.append(x.new_zeros(block_t.shape[0], x.shape[0]))
            else:
                parts.append(torch.matmul(block_t, xt.index_select(0, rows)))  # (n_t, B)
        parts.append(x.new_zeros(1, x.shape[0]))
        y = torch.cat(parts, dim=0).index_select(0, self.col_map).t()  # (B, N)
        if self.bias is not None:
            y = y + self.bias
        return y


def _condense_for_onnx(module: M) -> M:
    """A copy of ``module`` with every TileSparseLinear replaced by :class:`CondensedLinear`."""
    module = copy.deepcopy(module).cpu().eval()
    for name, child in list(module.named_modules()):
        for cname, grandchild in list(child.named_children()):
            if isinstance(grandchild, TileSparseLinear):
                setattr(child, cname, CondensedLinear(grandchild))
                log.debug("export: %s.%s condensed for ONNX", name, cname)
    return module


class _PaddedBags(nn.Module):
    """Embedding bags from padded ids: ``ids (B, H) int64`` with ``-1`` as padding → ``(B, dim)``."""

    weight: torch.Tensor  # (rows + 1, dim) buffer, the last row zeros (what padding reads)

    def __init__(self, bag: nn.Module, combiner: Combiner) -> None:
        super().__init__()
        if not isinstance(bag.weight, torch.Tensor):
            raise TypeError(f"an embedding bag's weight is a {type(bag.weight).__name__}")
        w = bag.weight.detach()
        self.register_buffer("weight", torch.cat([w, w.new_zeros(1, w.shape[1])]))
        self.num_rows = w.shape[0]
        self.mean = combiner == Combiner.MEAN

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids < 0
        idx = torch.where(pad, torch.full_like(ids, self.num_rows), ids)
        pooled = torch.nn.functional.embedding(idx, self.weight).sum(dim=1)
        if self.mean:
            count = (~pad).sum(dim=1, keepdim=True).clamp(min=1).to(pooled.dtype)
            pooled = pooled / count
        return pooled


class _FullGraph(nn.Module):
    def __init__(self, model: ExportableModel) -> None:
        super().__init__()
        self.model = model
        self.bags = nn.ModuleList(
            _PaddedBags(model.embeddings[t.name], t.combiner) for t in model_tables(model)
        )

    def forward(self, dense: torch.Tensor, *ids: torch.Tensor) -> torch.Tensor:
        pooled = [bag(i) for bag, i in zip(self.bags, ids)]
        return self.model.dense_forward(dense, pooled)


class _DenseGraph(nn.Module):
    def __init__(self, model: ExportableModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.model.dense_forward(dense, pooled)


def onnx_inputs(
    model: nn.Module, batch_size: int, include_embeddings: bool = True, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Example inputs for :func:`export_onnx`'s graph, keyed by ONNX input name.

    ``model`` as :func:`export_onnx` takes it (:func:`as_exportable`).
    ``dense (B, D) float32``; with embeddings ``ids_<table> (B, hotness_t) int64`` (random valid
    ids, the last sample's bags padded by one ``-1`` where hotness > 1); else ``pooled (B, T, dim)``.
    """
    gen = torch.Generator().manual_seed(seed)
    model = as_exportable(model, "onnx_inputs")
    tables = model_tables(model)
    out = {"dense": torch.rand(batch_size, _dense_features(model), generator=gen)}
    if include_embeddings:
        for t in tables:
            ids = torch.randint(0, t.num_rows, (batch_size, t.hotness), generator=gen)
            if t.hotness > 1:
                ids[-1, -1] = -1
            out[f"ids_{t.name}"] = ids
    else:
        dim = _pooled_dim(model, "onnx_inputs")
        out["pooled"] = torch.randn(batch_size, len(tables), dim, generator=gen)
    return out


def check_exportable(
    model: nn.Module, include_embeddings: bool = True, caller: str = "export_onnx"
) -> None:
    """Raise ``ValueError`` unless :func:`export_onnx` can export ``model``: every floating-point
    parameter and buffer float32, an unweighted EBC (the graph takes ids, not per-id weights),
    and (for the dense graph alone, ``include_embeddings=False``) one dim for every table.
    Writes nothing; ``caller`` names the function in the message.

    Raises:
        TypeError: for a model :func:`as_exportable` does not take.
    """
    model = as_exportable(model, caller)
    _check_float32(model, caller)
    if isinstance(model, EBCModel) and model.is_weighted:
        raise ValueError(
            f"{caller}: the EmbeddingBagCollection is weighted (is_weighted=True), but the "
            f"exported graph and the parameter server take ids only and pool unweighted; "
            f"export an unweighted EBC"
        )
    if not include_embeddings:
        _pooled_dim(model, caller)


def _pooled_dim(model: ExportableModel, caller: str) -> int:
    """The one table dim of the dense graph's ``pooled (B, T, dim)`` input, or ``ValueError``."""
    tables = model_tables(model)
    dims = {t.dim for t in tables}
    if len(dims) != 1:
        by_dim = "; ".join(
            f"dim {d}: " + ", ".join(repr(t.name) for t in tables if t.dim == d)
            for d in sorted(dims)
        )
        raise ValueError(
            f"{caller}: the dense graph's input 'pooled' (B, T, dim) needs one dim for every "
            f"table, but the tables' dims differ ({by_dim}); serving from the parameter server "
            f"runs that graph, so give every table the same dim (the full graph, "
            f"export_onnx(model, path, include_embeddings=True), takes ids and any dims)"
        )
    return dims.pop()


def export_onnx(
    model: nn.Module,
    path: str | Path,
    include_embeddings: bool = True,
    batch_size: int = 64,
    opset: int = DEFAULT_OPSET,
) -> Path:
    """Export ``model`` (dense or pruned with TileSparseLinear layers) to ONNX.

    Args:
        model: embark's :class:`DLRM`, an :class:`~embark.interop.EBCModel` or TorchRec's
            ``DLRM`` (see :func:`as_exportable`); it is copied, not changed.
        path: the ``.onnx`` file to write (folders created; written atomically).
        include_embeddings: include the tables (see the module docstring) or export the dense
            part alone.
        batch_size: batch of the example inputs; the exported batch dimension is dynamic.
        opset: ONNX opset of the default domain, 18 or newer (20, torch 2.13's default;
            the graph's ops exist unchanged from 18 on, and the exporter's own op library is
            written at 18 and converted up).

    Returns:
        ``path``.

    Raises:
        ValueError: for a model with a floating-point parameter or buffer that is not float32
            (a bf16 / fp16 model would export to a graph onnxruntime refuses to load, its
            inputs being float32), or, with ``include_embeddings=False``, tables of different
            dims (see :func:`check_exportable`), or an ``opset`` below 18; nothing is written
            then. A failure while
            exporting leaves neither ``path`` (an existing one is kept) nor a temporary file.
    """
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < MIN_OPSET:
        raise ValueError(f"export_onnx: opset must be an integer >= {MIN_OPSET}, got {opset!r}")
    model = as_exportable(model)
    check_exportable(model, include_embeddings)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    condensed = _condense_for_onnx(model)
    graph: nn.Module = _FullGraph(condensed) if include_embeddings else _DenseGraph(condensed)
    inputs = onnx_inputs(model, batch_size, include_embeddings)
    batch = torch.export.Dim("batch", min=1)
    dynamic_shapes: Sequence[object]
    if include_embeddings:
        # forward(dense, *ids): torch.export sees (dense, ids_tuple)
        dynamic_shapes = ({0: batch}, tuple({0: batch} for _ in model_tables(model)))
    else:
        dynamic_shapes = ({0: batch}, {0: batch})
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        program = torch.onnx.export(
            graph.eval(),
            tuple(inputs.values()),
            input_names=list(inputs),
            output_names=["logits"],
            dynamic_shapes=tuple(dynamic_shapes),
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
        if program is None:  # only without dynamo=True
            raise RuntimeError("torch.onnx.export returned no ONNX program")
        program.save(str(tmp))
        _stamp_metadata(tmp, model)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _check_float32(model: nn.Module, caller: str = "export_onnx") -> None:
    """Refuse a model with a non-float32 floating-point tensor (the graph's inputs are float32)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    bad = [
        (name, t.dtype) for name, t in tensors if t.is_floating_point() and t.dtype != torch.float32
    ]
    if bad:
        name, dtype = bad[0]
        more = f" (and {len(bad) - 1} more tensors are not float32 either)" if len(bad) > 1 else ""
        raise ValueError(
            f"{caller} needs a float32 model, but {name!r} is {dtype}{more}; the graph's inputs "
            f"are float32 and onnxruntime cannot mix dtypes. Convert it first: "
            f"{caller}(copy.deepcopy(model).float(), ...), or model.float() in place"
        )


def _stamp_metadata(path: Path, model: ExportableModel) -> None:
    """Record in the graph's ``metadata_props`` what the ops do not say
    (:class:`hps.artifact_format.ServingMetadata`: the format version, each table's rows,
    combiner and hotness, and the dense width), read by :func:`run_onnx` to check ids and by
    the v2 server for the pooling."""
    import onnx

    proto = onnx.load(str(path))
    meta = ServingMetadata(
        tables=tuple(
            TableMetadata(t.name, t.num_rows, t.combiner.value, t.hotness)
            for t in model_tables(model)
        ),
        dense_features=_dense_features(model),
    )
    kept = [(m.key, m.value) for m in proto.metadata_props if m.key != SERVING_METADATA_KEY]
    del proto.metadata_props[:]
    for k, v in [*kept, (SERVING_METADATA_KEY, meta.to_json())]:
        e = proto.metadata_props.add()
        e.key, e.value = k, v
    onnx.save(proto, str(path))


def check_ids(path: str | Path, inputs: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the input unless every ``ids_<table>`` holds -1 (padding) or a
    row in ``[0, rows)``: the graph itself cannot (``Gather`` would treat ``rows`` and any
    negative id as padding, and fail without naming the input above that).

    Raises:
        FormatVersionError: the graph's serving metadata is of another version.
    """
    import onnx

    props = onnx.load(str(path), load_external_data=False).metadata_props
    meta = {m.key: m.value for m in props}
    if SERVING_METADATA_KEY not in meta:
        return  # a graph we did not stamp: nothing to check against
    for t in ServingMetadata.from_json(meta[SERVING_METADATA_KEY], str(path)).tables:
        ids = inputs.get(f"ids_{t.name}")
        if ids is None or ids.numel() == 0:
            continue
        bad = (ids < -1) | (ids >= t.rows)
        if bool(bad.any()):
            v = int(ids[bad][0])
            raise ValueError(
                f"input 'ids_{t.name}': id {v} is outside table {t.name!r} "
                f"(rows 0..{t.rows - 1}; -1 pads a short bag)"
            )


def run_onnx(path: str | Path, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run the exported graph with onnxruntime (CPU) → ``(B,) float32`` logits.

    Raises:
        ValueError: an ``ids_<table>`` input with an id other than -1 or a row of the table.
    """
    import onnxruntime as ort

    check_ids(path, inputs)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {k: v.numpy() for k, v in inputs.items()}
    (logits,) = sess.run(["logits"], feeds)
    return torch.from_numpy(logits)
