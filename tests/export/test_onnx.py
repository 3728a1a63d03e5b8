"""ONNX export: onnxruntime's output equals the eager model, dense and TW-pruned."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import onnx
import pytest
import torch

import export.onnx as onnx_export
from embark.data.jagged import JaggedBatch
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from export.onnx import CondensedLinear, export_onnx, onnx_inputs, run_onnx
from tests.tolerances import tol
from tilesparse.linear import TileSparseLinear

# onnxruntime's kernels reorder fp32 sums: a tolerance, not equality
TOL = tol("onnx")


def _padded_to_jagged(model, inputs: dict[str, torch.Tensor]) -> JaggedBatch:
    names = [t.name for t in model.workload.tables]
    values, lengths = [], []
    for n in names:
        ids = inputs[f"ids_{n}"]
        for row in ids:
            kept = row[row >= 0]
            values.append(kept)
            lengths.append(kept.numel())
    return JaggedBatch(names, torch.cat(values), torch.tensor(lengths, dtype=torch.int32))


def _pruned_tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(get_workload("tiny"), seed=seed).eval()
    for parent, attr in ((model.top_mlp, "0"), (model.bottom_mlp, "2")):
        lin = getattr(parent, attr)
        k, n = lin.in_features, lin.out_features
        mask = torch.zeros(k, n, dtype=torch.bool)
        for c0 in range(0, n, 8):  # TW: tiles of 8 columns, each its own rows, some columns pruned
            if (c0 // 8) % 3 == 2:
                continue
            rows = torch.randperm(k)[: max(1, k // 2)]
            mask[rows.unsqueeze(1), torch.arange(c0, min(n, c0 + 8)).unsqueeze(0)] = True
        setattr(
            parent,
            attr,
            TileSparseLinear.from_dense(lin, mask_kn=mask, tile=8, backend="reference"),
        )
    return model


def _check_opset_and_model(graph: onnx.ModelProto) -> None:
    """The default ONNX domain is imported at opset 20 exactly (torch 2.13's default) and the
    checker's full check (with shape inference) passes."""
    assert [(o.domain, o.version) for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [
        ("", 20)
    ]
    onnx.checker.check_model(graph, full_check=True)


@pytest.fixture(scope="module")
def pruned():
    return _pruned_tiny()


def test_condensed_linear_equals_layer_exactly_on_integers() -> None:
    lin = torch.nn.Linear(37, 21)
    with torch.no_grad():
        lin.weight.copy_(torch.randint(-3, 4, lin.weight.shape).float())
        lin.bias.copy_(torch.randint(-3, 4, lin.bias.shape).float())
    mask = torch.rand(37, 21) > 0.6
    mask[:, 5] = False  # a pruned column
    layer = TileSparseLinear.from_dense(lin, mask_kn=mask, tile=4, backend="reference")
    x = torch.randint(-3, 4, (3, 37)).float()
    assert torch.equal(CondensedLinear(layer)(x), layer(x))
    assert torch.equal(CondensedLinear(layer)(x), lin(x) - x @ (lin.weight.T * ~mask))


def test_full_graph_matches_eager_model(tmp_path, pruned) -> None:
    path = export_onnx(pruned, tmp_path / "m.onnx", batch_size=8)
    graph = onnx.load(str(path))
    _check_opset_and_model(graph)
    ops = {n.op_type for n in graph.graph.node}
    assert "Loop" not in ops and ops <= {
        "Add",
        "Concat",
        "ConstantOfShape",
        "Expand",
        "Gather",
        "Gemm",
        "Less",
        "MatMul",
        "Mul",
        "ReduceSum",
        "Relu",
        "Reshape",
        "Shape",
        "Squeeze",
        "Unsqueeze",
        "Where",
        "Div",
        "Cast",
        "Clip",
        "Max",
        "Flatten",
        "Transpose",
        "Slice",
        "Identity",
    }
    for batch in (1, 13):  # a batch size other than the traced one: the batch dim is dynamic
        inputs = onnx_inputs(pruned, batch, seed=batch)
        want = pruned(inputs["dense"], _padded_to_jagged(pruned, inputs))
        torch.testing.assert_close(run_onnx(path, inputs), want.detach(), **TOL)


def test_dense_graph_matches_dense_forward(tmp_path, pruned) -> None:
    path = export_onnx(pruned, tmp_path / "d.onnx", include_embeddings=False)
    _check_opset_and_model(onnx.load(str(path)))
    inputs = onnx_inputs(pruned, 9, include_embeddings=False)
    want = pruned.dense_forward(inputs["dense"], inputs["pooled"]).detach()
    torch.testing.assert_close(run_onnx(path, inputs), want, **TOL)


def test_graph_metadata_and_bad_ids(tmp_path, pruned) -> None:
    """The graph records each table's rows/combiner; run_onnx refuses ids the graph would
    silently pool as padding (-5, rows) or fail on without naming the input (rows + 1)."""
    path = export_onnx(pruned, tmp_path / "m.onnx", batch_size=4)
    meta = {m.key: m.value for m in onnx.load(str(path)).metadata_props}
    tables = json.loads(meta["tilerec.serving"])["tables"]
    assert [(t["name"], t["rows"], t["combiner"]) for t in tables] == [
        (t.name, t.num_rows, t.combiner.value) for t in pruned.workload.tables
    ]
    inputs = onnx_inputs(pruned, 4, seed=1)
    rows = pruned.workload.tables[0].num_rows
    for bad in (-5, rows, rows + 1):
        ids = inputs["ids_t0"].clone()
        ids[2, 0] = bad
        with pytest.raises(ValueError, match=f"input 'ids_t0': id {bad} is outside table 't0'"):
            run_onnx(path, {**inputs, "ids_t0": ids})
    run_onnx(path, inputs)  # -1 padding and in-range ids are fine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_non_float32_model_is_refused_before_writing(tmp_path, pruned, dtype) -> None:
    """A bf16 model would export to a graph onnxruntime cannot load (its MatMul mixes bf16
    weights with the float32 inputs): it is refused naming the dtype, nothing is written, the model is untouched, and the float32 copy the message suggests exports fine."""
    low = copy.deepcopy(pruned).to(dtype)
    before = {k: v.clone() for k, v in low.state_dict().items() if isinstance(v, torch.Tensor)}
    out = tmp_path / "sub" / "low.onnx"
    with pytest.raises(
        ValueError, match=rf"needs a float32 model, but '.+' is {dtype}.*\.float\(\)"
    ):
        export_onnx(low, out, include_embeddings=False)
    assert not out.parent.exists()
    after = low.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    path = export_onnx(copy.deepcopy(low).float(), tmp_path / "f32.onnx", include_embeddings=False)
    inputs = onnx_inputs(pruned, 3, include_embeddings=False)
    want = low.float().dense_forward(inputs["dense"], inputs["pooled"]).detach()
    torch.testing.assert_close(run_onnx(path, inputs), want, **TOL)


def _mixed_dim_tiny(seed: int = 0):
    """The tiny DLRM with table t0 at dim 8, the others at 16 (t0 goes through a projection)."""
    w = get_workload("tiny")
    tables = (dataclasses.replace(w.tables[0], dim=8), *w.tables[1:])
    return build_model(dataclasses.replace(w, tables=tables), seed=seed).eval()


def test_dense_graph_of_mixed_dims_is_refused_before_writing(tmp_path) -> None:
    """The dense graph's one ``pooled (B, T, dim)`` input cannot hold tables of different dims:
    refused naming the dims, nothing written (not even the folder); the full graph, which takes
    ids, exports and runs."""
    model = _mixed_dim_tiny()
    out = tmp_path / "sub" / "d.onnx"
    with pytest.raises(ValueError) as err:
        export_onnx(model, out, include_embeddings=False)
    assert not out.parent.exists()
    assert re.search(r"one dim for every table.*dim 8: 't0'; dim 16: 't1', 't2'", str(err.value))
    path = export_onnx(model, tmp_path / "full.onnx", batch_size=4)
    inputs = onnx_inputs(model, 5, seed=2)
    want = model(inputs["dense"], _padded_to_jagged(model, inputs)).detach()
    torch.testing.assert_close(run_onnx(path, inputs), want, **TOL)


def test_failed_export_leaves_no_temporary_file(tmp_path, pruned, monkeypatch) -> None:
    """A failure after the graph was saved (here: stamping the metadata) removes the ``.tmp``
    file and keeps the graph already at ``path``."""
    path = tmp_path / "d.onnx"
    path.write_bytes(b"old graph")

    def fail(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(onnx_export, "_stamp_metadata", fail)
    with pytest.raises(OSError, match="disk full"):
        export_onnx(pruned, path, include_embeddings=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.onnx"]
    assert path.read_bytes() == b"old graph"


@pytest.mark.parametrize("opset", [17, 20.0, True])
def test_an_opset_below_18_or_not_an_int_is_refused_before_writing(tmp_path, pruned, opset) -> None:
    out = tmp_path / "sub" / "m.onnx"
    with pytest.raises(ValueError, match=rf"opset must be an integer >= 18, got {opset!r}"):
        export_onnx(pruned, out, opset=opset)
    assert not out.parent.exists()
