"""``quantize_embeddings_``: store a trained DLRM's tables in row formats, in place.

    >>> from embark import build_model, get_workload
    >>> from embark.quant import EmbeddingQuantConfig, quantize_embeddings_
    >>> model = quantize_embeddings_(build_model(get_workload("tiny")), EmbeddingQuantConfig("int8"))
    >>> type(model.embeddings["t0"]).__name__, model.embeddings["t0"].dtype.value
    ('QuantizedEmbeddingBag', 'int8')

The quantized model is called as a float one is (``model(dense, sparse)``); its quantized
tables are not trainable (they hold no float parameter).
"""

from __future__ import annotations

import torch
from torch import nn

from embark.models.dlrm import DLRM
from embark.quant.config import EmbeddingQuantConfig
from embark.quant.tables import QuantizedEmbeddingBag
from embark.types import Combiner
from hps.rowformat import RowDtype, row_bytes

__all__ = ["quantize_embeddings_", "table_bytes", "table_dtypes"]


@torch.no_grad()
def quantize_embeddings_(model: DLRM, config: EmbeddingQuantConfig) -> DLRM:
    """Replace each of ``model``'s tables by a :class:`QuantizedEmbeddingBag` holding its rows
    in ``config.dtype_of(table)`` (``fp32``: the table is left as it is). In place; returns
    ``model``.

    Every table is checked and quantized before any is replaced, so a failure leaves the
    model untouched. A quantized table loses its fused update, if a trainer installed one
    (:meth:`~embark.models.tables.EmbeddingTables.replace_table`: nothing to update).

    Raises:
        ValueError: naming the table(s), when ``config.per_table`` names a table the model
            lacks, or a table is already quantized to another dtype.
        hps.rowformat.RowFormatError: naming the table, when its values cannot be held in
            its dtype (NaN, inf, beyond float16's range) or its width cannot be packed.
    """
    unknown = sorted(set(config.per_table) - set(model.table_names))
    if unknown:
        raise ValueError(
            f"EmbeddingQuantConfig.per_table names tables {unknown} that the model lacks "
            f"(its tables: {model.table_names})"
        )
    replaced: dict[str, QuantizedEmbeddingBag] = {}
    for name in model.table_names:
        dtype = config.dtype_of(name)
        module = model.embeddings[name]
        if isinstance(module, QuantizedEmbeddingBag):
            if module.dtype is not dtype:
                raise ValueError(
                    f"table {name!r} is already {module.dtype.value}; quantize the float model "
                    f"to get {dtype.value}"
                )
            continue
        if dtype is RowDtype.FP32 or not isinstance(module, nn.EmbeddingBag):
            continue
        combiner = Combiner.MEAN if module.mode == "mean" else Combiner.SUM
        replaced[name] = QuantizedEmbeddingBag.from_float(
            name, model.embeddings.float_weight(name), dtype, combiner, config.kernel
        )
    for name, table in replaced.items():
        model.embeddings.replace_table(name, table)
    return model


def table_dtypes(model: DLRM) -> dict[str, RowDtype]:
    """``{table: its row format}`` in workload order (a float table: its weight's dtype,
    FP32 unless trained in FP16/BF16)."""
    return model.embeddings.storage_dtypes()


def table_bytes(model: DLRM) -> dict[str, int]:
    """``{table: bytes of its stored rows}`` in workload order (FBGEMM's row sizes:
    ``num_rows * row_bytes(dtype, dim)``)."""
    out: dict[str, int] = {}
    for name in model.table_names:
        m = model.embeddings[name]
        if isinstance(m, QuantizedEmbeddingBag):
            out[name] = m.nbytes
        else:
            rows, dim = m.get_parameter("weight").shape
            out[name] = rows * row_bytes(model.embeddings.storage_dtype(name), dim)
    return out
