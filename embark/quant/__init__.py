"""embark.quant: embedding tables stored in row formats (fp16, bf16, int8, int4, int2 row-wise;
FBGEMM's byte layouts, defined once in :mod:`hps.rowformat`) and a compression planner.

- :func:`quantize_embeddings_` with :class:`EmbeddingQuantConfig`: quantize a trained model's
  tables in place; each becomes a :class:`QuantizedEmbeddingBag` looked up through FBGEMM's
  fused lookup-and-dequantize on CPU, or the pure-torch reference.
- :func:`plan_compression`: each table's dtype from its measured sensitivity (the AUC change
  on held-out batches when that table alone is quantized) for a byte budget or a maximum AUC
  loss; :class:`CompressionPlan` reports it.
"""

from typing import TYPE_CHECKING

from embark.lazy import lazy_attributes

if TYPE_CHECKING:
    from embark.quant.config import EmbeddingQuantConfig
    from embark.quant.planner import (
        CompressionPlan,
        TableChoice,
        evaluate_auc,
        plan_compression,
    )
    from embark.quant.quantize import quantize_embeddings_, table_bytes, table_dtypes
    from embark.quant.sizes import ModelSize, model_size
    from embark.quant.tables import QuantizedEmbeddingBag
    from hps.rowformat import RowDtype, RowFormatError

_EXPORTS = {
    "EmbeddingQuantConfig": "embark.quant.config",
    "CompressionPlan": "embark.quant.planner",
    "TableChoice": "embark.quant.planner",
    "evaluate_auc": "embark.quant.planner",
    "plan_compression": "embark.quant.planner",
    "quantize_embeddings_": "embark.quant.quantize",
    "table_bytes": "embark.quant.quantize",
    "table_dtypes": "embark.quant.quantize",
    "ModelSize": "embark.quant.sizes",
    "model_size": "embark.quant.sizes",
    "QuantizedEmbeddingBag": "embark.quant.tables",
    "RowDtype": "hps.rowformat",
    "RowFormatError": "hps.rowformat",
}

__all__ = [
    "CompressionPlan",
    "EmbeddingQuantConfig",
    "ModelSize",
    "QuantizedEmbeddingBag",
    "RowDtype",
    "RowFormatError",
    "TableChoice",
    "evaluate_auc",
    "model_size",
    "plan_compression",
    "quantize_embeddings_",
    "table_bytes",
    "table_dtypes",
]

__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
