"""export: a trained (and pruned) DLRM as files others run.

- :func:`export_onnx`: ONNX of the model that onnxruntime runs with standard ops only
  (TileSparseLinear layers as condensed ``Gather`` + ``MatMul``, embedding bags as ``Gather`` +
  ``ReduceSum``), checked against eager PyTorch by :func:`run_onnx`.
- :func:`write_serving_artifacts`: the folder the parameter server (``hps``) serves:
  ``ps.json`` + per-table sparse files + the dense graph, in the versioned serving-artifact
  format of :mod:`hps.artifact_format`.

    >>> from export import write_serving_artifacts
    >>> cfg = write_serving_artifacts(model, "out")     # doctest: +SKIP
    >>> # python -m hps.server --config out/ps.json
"""

from export.artifacts import write_serving_artifacts
from export.onnx import CondensedLinear, check_exportable, export_onnx, onnx_inputs, run_onnx

__all__ = [
    "CondensedLinear",
    "check_exportable",
    "export_onnx",
    "onnx_inputs",
    "run_onnx",
    "write_serving_artifacts",
]
