"""quantize_embeddings_ / QuantizedEmbeddingBag: the quantized model computes the float model
over its dequantized tables; FBGEMM's fused lookup equals the reference; errors name tables."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.quant import (
    EmbeddingQuantConfig,
    QuantizedEmbeddingBag,
    RowDtype,
    RowFormatError,
    model_size,
    quantize_embeddings_,
    table_bytes,
    table_dtypes,
)
from embark.quant.tables import fbgemm_inference_available
from embark.training.config import EmbeddingKernel
from embark.types import Combiner
from tests.conftest import IN_CI


def _need_fbgemm() -> None:
    if not fbgemm_inference_available():
        if IN_CI:
            pytest.fail("fbgemm_gpu does not import (CI needs it)")
        pytest.skip("fbgemm_gpu not installed")


@pytest.fixture(scope="module")
def tiny():
    w = get_workload("tiny")
    return build_model(w, seed=0), list(SyntheticCTR(w, batch_size=64).batches(2, split="eval"))


def test_config_validates_and_round_trips():
    cfg = EmbeddingQuantConfig("int4", {"t0": "fp16"}, "reference")
    assert cfg.dtype is RowDtype.INT4 and cfg.per_table["t0"] is RowDtype.FP16
    assert cfg.kernel is EmbeddingKernel.REFERENCE and cfg.dtype_of("t1") is RowDtype.INT4
    assert EmbeddingQuantConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match=r"per_table\['t0'\] must be one of .*got 'int3'"):
        EmbeddingQuantConfig("int8", {"t0": "int3"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        EmbeddingQuantConfig("float8")
    with pytest.raises(ValueError, match="kernel must be one of"):
        EmbeddingQuantConfig(kernel="cuda")
    with pytest.raises(ValueError, match=r"unknown fields \['bits'\]"):
        EmbeddingQuantConfig.from_dict({"bits": 8})
    with pytest.raises(TypeError):
        cfg.per_table["t1"] = RowDtype.INT8  # type: ignore[index]


@pytest.mark.parametrize("dtype", [d for d in RowDtype if d is not RowDtype.FP32])
def test_quantized_model_is_the_float_model_over_dequantized_tables(tiny, dtype):
    model, batches = tiny
    q = quantize_embeddings_(copy.deepcopy(model), EmbeddingQuantConfig(dtype, kernel="reference"))
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name in model.table_names:
            table = q.embeddings[name]
            assert isinstance(table, QuantizedEmbeddingBag) and table.dtype is dtype
            ref.embeddings[name].weight.copy_(table.dequantize())
        for b in batches:
            torch.testing.assert_close(
                q(b.dense, b.sparse), ref(b.dense, b.sparse), rtol=1e-6, atol=1e-6
            )
    rows = {n: model.embeddings[n].weight.shape for n in model.table_names}
    width = {
        RowDtype.FP16: 32,
        RowDtype.BF16: 32,
        RowDtype.INT8: 20,
        RowDtype.INT4: 12,
        RowDtype.INT2: 8,
    }
    assert table_bytes(q) == {n: r * width[dtype] for n, (r, _) in rows.items()}
    assert model_size(q).dense == model_size(model).dense


@pytest.mark.parametrize(
    "dtype", [RowDtype.FP32, RowDtype.FP16, RowDtype.INT8, RowDtype.INT4, RowDtype.INT2]
)
@pytest.mark.parametrize("combiner", list(Combiner))
def test_fbgemm_lookup_equals_reference(dtype, combiner):
    _need_fbgemm()
    g = torch.Generator().manual_seed(0)
    table = QuantizedEmbeddingBag.from_float(
        "t", torch.randn(300, 16, generator=g), dtype, combiner, EmbeddingKernel.FBGEMM
    )
    lengths = torch.randint(0, 6, (64,), generator=g)
    ids = torch.randint(0, 300, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    got = table(ids, offsets)
    assert table.uses_fbgemm and table._lookup is not None
    assert table._lookup.tbe.weights_host.data_ptr() == table.rows.data_ptr()  # no copy
    torch.testing.assert_close(got, table.reference(ids, offsets), rtol=1e-6, atol=1e-6)
    copied = copy.deepcopy(table)  # the kernel is rebuilt over the copy's own rows
    assert copied._lookup is None
    torch.testing.assert_close(copied(ids, offsets), got, rtol=0, atol=0)
    assert copied._lookup.tbe.weights_host.data_ptr() == copied.rows.data_ptr()


def test_per_table_dtypes_and_state_dict(tiny):
    model, batches = tiny
    cfg = EmbeddingQuantConfig("int8", {"t0": "fp32", "t3": "int4"})
    q = quantize_embeddings_(copy.deepcopy(model), cfg)
    dtypes = table_dtypes(q)
    assert dtypes["t0"] is RowDtype.FP32 and dtypes["t3"] is RowDtype.INT4
    assert dtypes["t1"] is RowDtype.INT8
    assert type(q.embeddings["t0"]) is torch.nn.EmbeddingBag
    state = q.state_dict()
    assert state["embeddings.t3.rows"].dtype == torch.uint8
    assert tuple(state["embeddings.t3.rows"].shape) == (2000, 12)
    again = quantize_embeddings_(copy.deepcopy(model), cfg)
    again.load_state_dict(state)
    b = batches[0]
    with torch.no_grad():
        assert torch.equal(again(b.dense, b.sparse), q(b.dense, b.sparse))


def test_bad_input_names_the_table_and_leaves_the_model(tiny):
    model, _ = tiny
    m = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"names tables \['t9'\] that the model lacks"):
        quantize_embeddings_(m, EmbeddingQuantConfig("int8", {"t9": "int4"}))
    with torch.no_grad():
        m.embeddings["t5"].weight[7, 3] = float("inf")
    with pytest.raises(RowFormatError, match="table 't5': row 7 holds inf at column 3"):
        quantize_embeddings_(m, EmbeddingQuantConfig("int8"))
    assert all(type(m.embeddings[n]) is torch.nn.EmbeddingBag for n in m.table_names)
    with pytest.raises(RowFormatError, match="table 't1'.*int8 rows of width 16 are 20 bytes"):
        QuantizedEmbeddingBag("t1", torch.zeros(5, 21, dtype=torch.uint8), RowDtype.INT8, 16)
    table = QuantizedEmbeddingBag.from_float(
        "t2", torch.rand(4, 16), RowDtype.BF16, kernel="fbgemm"
    )
    with pytest.raises(
        ValueError, match="table 't2': FBGEMM's inference kernel does not read bf16"
    ):
        table(torch.tensor([0]), torch.tensor([0]))
    q = quantize_embeddings_(copy.deepcopy(model), EmbeddingQuantConfig("int8"))
    with pytest.raises(ValueError, match="table 't0' is already int8"):
        quantize_embeddings_(q, EmbeddingQuantConfig("int4"))


def test_public_names_resolve_and_doctests_run():
    import doctest

    import embark.quant
    import embark.quant.config
    import embark.quant.quantize
    import hps

    for pkg in (embark.quant, hps):
        assert [n for n in pkg.__all__ if getattr(pkg, n, None) is None] == []
    for module in (embark.quant.config, embark.quant.quantize):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0
