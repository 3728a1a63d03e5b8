"""The inference application: a DLRM servable (HPS lookups + onnxruntime) and the KServe v2
server (``python -m hps.server``)."""
