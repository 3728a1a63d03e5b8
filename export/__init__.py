"""export: ONNX of the (pruned) DLRM that onnxruntime runs, and the files the parameter server
serves (``ps.json`` + per-table sparse files).

Imported lazily: ``export.onnx`` needs onnx/onnxscript, ``export.artifacts`` needs ``hps``.
"""
