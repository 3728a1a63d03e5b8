"""The serving half of the ``prune_dlrm`` story: export the pruned, condensed model and serve it.

``write_serving_artifacts`` writes the sparse files, the dense ONNX graph (TW layers as
condensed standard ops) and ``ps.json``; the parameter server loads them; the v2 server
(``hps.serving.http_server``) serves them on a free local port; ``tritonclient.http`` sends the eval
samples in requests of ``request_batch`` and the served scores are compared with the eager
model's: the largest logit difference and the AUC of both on the same samples, plus request
latency (median and p99) for the whole round trip (HTTP, lookups, onnxruntime).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embark import DLRM, Batch, JaggedBatch, auc
from export import write_serving_artifacts
from hps import HierarchicalParameterServer
from hps.serving import InferenceServer, ServerConfig

__all__ = ["padded_ids", "serve_check"]


def padded_ids(sparse: JaggedBatch, key: str, width: int) -> np.ndarray:
    """One key's bags as ``(B, width) int64`` rows padded with ``-1`` (the server's input).

    Raises:
        ValueError: a bag longer than ``width``.
    """
    values, lengths = sparse.values_for(key), sparse.lengths_for(key).to(torch.int64)
    b = lengths.numel()
    if b and int(lengths.max()) > width:
        raise ValueError(f"key {key!r}: a bag of {int(lengths.max())} ids exceeds width {width}")
    out = torch.full((b, width), -1, dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(values.numel()) - torch.repeat_interleave(starts, lengths)
    out[torch.repeat_interleave(torch.arange(b), lengths), pos] = values
    return out.numpy()


def serve_check(
    model: DLRM, out_dir: str | Path, batches: Sequence[Batch], request_batch: int = 256
) -> dict[str, Any]:
    """Export ``model``, serve it, score ``batches`` through the server and compare.

    Args:
        model: the (pruned, condensed) DLRM, in eval mode.
        out_dir: the artifact folder (replaced).
        batches: eval batches; each is sent as ``ceil(B / request_batch)`` requests.
        request_batch: samples per request (also the served ``max_batch_size``).

    Returns:
        ``artifacts``, ``requests``, ``samples``, ``max_abs_logit_diff``, ``served_auc``,
        ``eager_auc``, ``latency_ms_p50`` / ``p99``, ``export_s``, ``dense_onnx_bytes``.
    """
    import tritonclient.http as th

    t0 = time.perf_counter()
    model = model.eval()
    write_serving_artifacts(model, out_dir, max_batch_size=request_batch, overwrite=True)
    export_s = time.perf_counter() - t0
    tables = model.workload.tables
    ps = HierarchicalParameterServer.from_config(Path(out_dir) / "ps.json")
    served, eager, labels, lat = [], [], [], []
    try:
        with InferenceServer(ps, ServerConfig(port=0, workers=1)) as srv:
            client = th.InferenceServerClient(srv.address)
            for b in batches:
                with torch.no_grad():
                    eager.append(model(b.dense, b.sparse).numpy())
                labels.append(b.labels.numpy())
                ids = {t.name: padded_ids(b.sparse, t.name, t.hotness) for t in tables}
                dense = b.dense.numpy()
                for s in range(0, dense.shape[0], request_batch):
                    e = min(s + request_batch, dense.shape[0])
                    inputs = [_input("dense", dense[s:e], "FP32")]
                    inputs += [_input(f"ids_{n}", v[s:e], "INT64") for n, v in ids.items()]
                    r0 = time.perf_counter()
                    res = client.infer(model_name="dlrm", inputs=inputs)
                    lat.append(time.perf_counter() - r0)
                    served.append(res.as_numpy("logits"))
    finally:
        ps.close()
    got, want, y = np.concatenate(served), np.concatenate(eager), np.concatenate(labels)
    ms = sorted(x * 1e3 for x in lat)
    return {
        "artifacts": str(out_dir),
        "requests": len(lat),
        "request_batch": request_batch,
        "samples": int(got.size),
        "max_abs_logit_diff": float(np.abs(got - want).max()),
        "served_auc": auc(torch.from_numpy(got), torch.from_numpy(y)),
        "eager_auc": auc(torch.from_numpy(want), torch.from_numpy(y)),
        "latency_ms_p50": statistics.median(ms),
        "latency_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "export_s": export_s,
        "dense_onnx_bytes": (Path(out_dir) / "dense.onnx").stat().st_size,
    }


def _input(name: str, arr: np.ndarray, dtype: str) -> Any:
    import tritonclient.http as th

    x = th.InferInput(name, list(arr.shape), dtype)
    x.set_data_from_numpy(np.ascontiguousarray(arr))
    return x
