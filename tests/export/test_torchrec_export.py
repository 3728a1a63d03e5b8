"""A TorchRec model (TorchRec's own DLRM: an EmbeddingBagCollection and its dense arches)
exported to ONNX and served by the v2 server, scoring like TorchRec's eager forward."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import tritonclient.http as th

from embark.interop import EBCModel, from_torchrec_dlrm
from export.artifacts import write_serving_artifacts
from export.onnx import export_onnx, run_onnx
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import InferenceServer, ServerConfig
from hps.storage.sparse_files import read_table
from tests.hps.serving.tiny_dlrm import triton_inputs
from tests.tolerances import tol

FEATURES = {"t0": "f0", "t1": "f1", "t2": "f2"}
HOTNESS = 3


@pytest.fixture(scope="module")
def torchrec_api():
    try:
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:
        return None
    return DLRM, EmbeddingBagConfig, PoolingType, EmbeddingBagCollection, KeyedJaggedTensor


@pytest.fixture(scope="module")
def tr_dlrm(torchrec_api):
    """TorchRec's DLRM: tables t0 (sum), t1 (mean), t2 (sum) of dim 8, dense 5 → 16 → 8."""
    if torchrec_api is None:
        return None
    dlrm_cls, cfg, pooling, ebc_cls, _ = torchrec_api
    torch.manual_seed(7)
    cfgs = [
        cfg(name="t0", num_embeddings=40, embedding_dim=8, feature_names=["f0"]),
        cfg(
            name="t1",
            num_embeddings=9,
            embedding_dim=8,
            feature_names=["f1"],
            pooling=pooling.MEAN,
        ),
        cfg(name="t2", num_embeddings=25, embedding_dim=8, feature_names=["f2"]),
    ]
    ebc = ebc_cls(tables=cfgs)
    model = dlrm_cls(
        embedding_bag_collection=ebc,
        dense_in_features=5,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    return model.eval()


@pytest.fixture
def model(tr_dlrm, require):
    require(tr_dlrm is not None, "torchrec")
    return tr_dlrm


def _request(model, batch: int, seed: int) -> dict[str, np.ndarray]:
    """``dense (B, 5)`` and ``ids_<t> (B, 3)`` with about a third of the slots ``-1``."""
    g = np.random.default_rng(seed)
    out = {"dense": g.random((batch, 5), dtype=np.float32)}
    for cfg in model.sparse_arch.embedding_bag_collection.embedding_bag_configs():
        ids = g.integers(0, cfg.num_embeddings, (batch, HOTNESS))
        ids[g.random(ids.shape) < 0.35] = -1
        out[f"ids_{cfg.name}"] = ids
    return out


@torch.no_grad()
def _torchrec_eager(model, kjt_cls, req: dict[str, np.ndarray]) -> np.ndarray:
    """TorchRec's own forward on the same bags (padding dropped) → ``(B,)`` logits."""
    values, lengths = [], []
    for table in FEATURES:
        ids = torch.from_numpy(req[f"ids_{table}"])
        values.append(ids[ids >= 0])
        lengths.append((ids >= 0).sum(dim=1))
    kjt = kjt_cls(
        keys=list(FEATURES.values()), values=torch.cat(values), lengths=torch.cat(lengths)
    )
    logits = model(torch.from_numpy(req["dense"]), kjt)
    return logits.squeeze(-1).numpy()


def test_full_graph_is_opset_20_and_scores_like_torchrec(model, torchrec_api, tmp_path) -> None:
    ebc_model = from_torchrec_dlrm(model, hotness=HOTNESS)
    path = export_onnx(ebc_model, tmp_path / "full.onnx", batch_size=4)
    graph = onnx.load(str(path))
    assert [(o.domain, o.version) for o in graph.opset_import if o.domain == ""] == [("", 20)]
    assert "Loop" not in {n.op_type for n in graph.graph.node}
    onnx.checker.check_model(graph, full_check=True)
    for batch in (1, 7):
        req = _request(model, batch, seed=batch)
        got = run_onnx(path, {k: torch.from_numpy(v) for k, v in req.items()}).numpy()
        np.testing.assert_allclose(got, _torchrec_eager(model, torchrec_api[4], req), **tol("onnx"))


def test_served_torchrec_dlrm_scores_like_torchrec(model, torchrec_api, tmp_path) -> None:
    """TorchRec's DLRM handed to write_serving_artifacts as it is with one maximum bag size
    for every table (TorchRec records none), served over HTTP, requested by tritonclient."""
    with pytest.raises(ValueError, match=r"pass hotness=\{table: n\} for tables \['t0', 't1'"):
        write_serving_artifacts(model, tmp_path / "art", model_name="trdlrm", max_batch_size=16)
    write_serving_artifacts(
        model, tmp_path / "art", model_name="trdlrm", max_batch_size=16, hotness=1
    )
    ebc = model.sparse_arch.embedding_bag_collection
    for name, bag in ebc.embedding_bags.items():
        keys, rows = read_table(tmp_path / "art" / "sparse" / name, dim=8)
        assert torch.equal(torch.from_numpy(rows.copy()), bag.weight.detach())
        assert keys.tolist() == list(range(bag.weight.shape[0]))
    ps = HierarchicalParameterServer.from_config(tmp_path / "art" / "ps.json")
    srv = InferenceServer(ps, ServerConfig(port=0, workers=2)).start()
    try:
        client = th.InferenceServerClient(srv.address)
        for seed in (1, 2):
            req = {
                k: v[:, :1] if k.startswith("ids_") else v
                for k, v in _request(model, 6, seed).items()
            }
            res = client.infer("trdlrm", triton_inputs(req))
            want = _torchrec_eager(model, torchrec_api[4], req)
            np.testing.assert_allclose(res.as_numpy("logits"), want, **tol("served"))
    finally:
        srv.stop()
        ps.close()


def test_weighted_ebc_and_other_modules_are_refused(torchrec_api, require, tmp_path) -> None:
    require(torchrec_api is not None, "torchrec")
    _, cfg, _, ebc_cls, _ = torchrec_api
    ebc = ebc_cls(
        tables=[cfg(name="w", num_embeddings=4, embedding_dim=2, feature_names=["fw"])],
        is_weighted=True,
    )
    dense = torch.nn.Linear(2, 1)

    class Head(torch.nn.Module):
        def forward(self, x: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
            return dense(x + pooled[0])

    weighted = EBCModel(ebc, Head(), dense_features=2)
    out = tmp_path / "sub" / "w.onnx"
    with pytest.raises(ValueError, match=r"EmbeddingBagCollection is weighted.*ids only"):
        export_onnx(weighted, out)
    assert not out.parent.exists()
    with pytest.raises(
        TypeError, match=r"takes embark's DLRM.*got a torch.nn.modules.linear.Linear"
    ):
        export_onnx(dense, out)
