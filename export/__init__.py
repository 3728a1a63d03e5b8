"""export: a trained (and pruned) DLRM as files others run.

It takes embark's DLRM, an :class:`embark.interop.EBCModel` (a TorchRec
``EmbeddingBagCollection`` and a dense module) or TorchRec's own ``DLRM``
(:func:`as_exportable`).

- :func:`export_onnx`: ONNX of the model that onnxruntime runs with standard ops only
  (TileSparseLinear layers as condensed ``Gather`` + ``MatMul``, embedding bags as ``Gather`` +
  ``ReduceSum``; opset 20), checked against eager PyTorch by :func:`run_onnx`.
- :func:`write_serving_artifacts`: the folder the parameter server (``hps``) serves:
  ``ps.json`` + per-table sparse files + the dense graph, in the versioned serving-artifact
  format of :mod:`hps.artifact_format`.

    >>> from export import write_serving_artifacts
    >>> cfg = write_serving_artifacts(model, "out")     # doctest: +SKIP
    >>> # python -m hps.server --config out/ps.json
"""

from export.artifacts import write_serving_artifacts
from export.onnx import (
    CondensedLinear,
    ExportableModel,
    as_exportable,
    check_exportable,
    export_onnx,
    model_tables,
    onnx_inputs,
    run_onnx,
)

__all__ = [
    "CondensedLinear",
    "ExportableModel",
    "as_exportable",
    "check_exportable",
    "export_onnx",
    "model_tables",
    "onnx_inputs",
    "run_onnx",
    "write_serving_artifacts",
]
