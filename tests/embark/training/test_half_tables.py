"""Half-size (FP16/BF16) tables in training: the rounding (nearest = FBGEMM's CPU kernel,
stochastic unbiased), the reference against FBGEMM, the typed table store, the trainer and
checkpoints (the dtype recorded, old checkpoints loading as FP32)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import embark.training.fbgemm_tables as fbgemm_tables
from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.tables import EmbeddingTables, TableModel
from embark.models.workloads import get_workload
from embark.training.config import (
    EmbeddingKernel,
    EmbeddingOptimizerKind,
    TableRounding,
    TrainConfig,
)
from embark.training.fused import SparseTableUpdate
from embark.training.rounding import (
    counter_bits,
    rounding_bits,
    stochastic_round,
    stochastic_round_reference,
)
from embark.training.sparse_rows import RowOptimizer, round_rows
from embark.training.trainer import Trainer
from hps.rowformat import RowDtype

HALF = [(torch.float16, 2.0**-10), (torch.bfloat16, 2.0**-7)]  # (dtype, ulp in [1, 2))


@pytest.mark.parametrize(("dtype", "ulp"), HALF)
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(dtype, ulp):
    # x = 1 + f ulp for fractions f: each rounds to 1 or 1 + ulp only, and the mean of
    # 20 000 draws is x within 5 standard errors (fixed seed); nearest is off by f or 1 - f
    fractions = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.95])
    x = (1.0 + fractions * ulp).repeat(20_000, 1)
    got = stochastic_round(x, dtype, counter_bits(0, torch.arange(20_000), 5)).float()
    assert got.dtype == torch.float32 and set(got.unique().tolist()) <= {1.0, 1.0 + ulp}
    bias = (got.mean(0) - x[0]) / ulp
    stderr = (fractions * (1 - fractions) / 20_000).sqrt()
    assert (bias.abs() <= 5 * stderr).all(), bias
    near = round_rows(x[:1], dtype, TableRounding.NEAREST, 0, torch.arange(1))
    assert ((near.float() - x[:1]).abs() / ulp).min() >= 0.05  # nearest keeps a bias
    # negative values, representable values, overflow and NaN
    y = torch.tensor([-1.0 - 0.25 * ulp, 3.0, 1e30, float("nan")])
    r = stochastic_round(y, dtype, counter_bits(1, torch.arange(1), 4).reshape(4)).float()
    assert r[0].item() in (-1.0, -1.0 - ulp) and r[1] == 3.0
    # a finite value beyond the dtype's range saturates (FBGEMM's round-toward-zero)
    assert (
        r[3].isnan()
        and r[2].isfinite()
        and abs(r[2] / min(1e30, torch.finfo(dtype).max) - 1) <= ulp
    )


def _need_fbgemm() -> None:
    if not fbgemm_tables.fbgemm_available():
        if os.environ.get("CI") == "true":
            pytest.fail("fbgemm_gpu does not import (CI needs it)")
        pytest.skip("fbgemm_gpu not installed")


@pytest.mark.parametrize("kind", list(EmbeddingOptimizerKind))
def test_fp16_reference_rounding_to_nearest_equals_fbgemm(kind):
    # FBGEMM's CPU kernel rounds FP16 rows to nearest (an SGD / Adagrad step rounded to fp16
    # first): the reference path does the same, bit for bit over 3 steps (bags of 3, ids
    # repeated within and across bags)
    _need_fbgemm()
    rows, dim, batch = 64, 8, 32
    gen = torch.Generator().manual_seed(1)
    start = (torch.rand(rows, dim, generator=gen) - 0.5).half()
    ids = torch.randint(0, rows, (batch * 3,), generator=gen)
    offsets = torch.arange(0, batch * 3, 3)
    grads = [torch.randn(batch, dim, generator=gen) * 0.01 for _ in range(3)]
    out: dict[EmbeddingKernel, torch.Tensor] = {}
    for kernel in (EmbeddingKernel.FBGEMM, EmbeddingKernel.REFERENCE):
        opt = RowOptimizer(kind, lr=0.05)
        upd = SparseTableUpdate("t", rows, dim, opt, kernel, TableRounding.NEAREST)
        w = start.clone()
        assert upd.uses_fbgemm(w) is (kernel is EmbeddingKernel.FBGEMM)
        for g in grads:
            pooled = upd(w, ids, offsets, "sum")
            assert pooled.dtype == torch.float32
            pooled.backward(g)
        out[kernel] = w
    a, b = out[EmbeddingKernel.FBGEMM].float(), out[EmbeddingKernel.REFERENCE].float()
    assert not torch.equal(a, start.float())
    assert torch.equal(a, b)


def test_stochastic_fp16_and_bf16_run_the_reference_path():
    upd = SparseTableUpdate(
        "t", 8, 4, RowOptimizer(EmbeddingOptimizerKind.SGD, 0.1), EmbeddingKernel.FBGEMM
    )
    assert not upd.uses_fbgemm(torch.zeros(8, 4, dtype=torch.float16))
    assert not upd.uses_fbgemm(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert upd.uses_fbgemm(torch.zeros(8, 4)) is fbgemm_tables.FbgemmTable.supports(4)


def test_store_is_typed_and_half_build_is_the_fp32_build_rounded():
    wl = get_workload("tiny")
    full = build_model(wl, seed=3)
    half = build_model(wl, seed=3, table_dtype=RowDtype.FP16)
    assert isinstance(half, TableModel) and isinstance(half.embedding_store(), EmbeddingTables)
    store = half.embedding_store()
    assert set(store.storage_dtypes().values()) == {RowDtype.FP16}
    for name, w in store.trainable_weights().items():
        assert torch.equal(w, full.embeddings.float_weight(name).half())
    for name, p in full.named_parameters():  # the dense part drawn alike
        if not name.startswith("embeddings."):
            assert torch.equal(p, half.get_parameter(name))
    with pytest.raises(ValueError, match="int8"):
        build_model(wl, table_dtype=RowDtype.INT8)
    with pytest.raises(ValueError, match="table_dtype"):
        TrainConfig(table_dtype=RowDtype.INT4)


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    return SyntheticCTR(get_workload("tiny"), batch_size=64, seed=0)


@pytest.mark.parametrize("dtype", [RowDtype.FP16, RowDtype.BF16])
def test_trainer_trains_half_tables_and_checkpoints_keep_their_dtype(data, dtype, tmp_path):
    cfg = TrainConfig(lr=0.05, embedding_optimizer="rowwise_adagrad", table_dtype=dtype)
    model = build_model(data.workload, seed=0)
    trainer = Trainer(model, cfg)
    torch_dtype = {RowDtype.FP16: torch.float16, RowDtype.BF16: torch.bfloat16}[dtype]
    start = {n: w.clone() for n, w in model.embedding_tables().items()}
    assert all(w.dtype == torch_dtype for w in start.values())
    trainer.fit(data.batches(4), 4, progress=False)
    moved = [n for n, w in model.embedding_tables().items() if not torch.equal(w, start[n])]
    assert moved and all(w.dtype == torch_dtype for w in model.embedding_tables().values())
    trainer.save_checkpoint(tmp_path / "ck")
    state = json.loads((tmp_path / "ck" / "state.json").read_text())
    assert state["train_config"]["table_dtype"] == dtype.value
    loaded = Trainer.load_checkpoint(tmp_path / "ck")
    for n, w in model.embedding_tables().items():
        assert torch.equal(loaded.model.embedding_tables()[n], w)  # type: ignore[operator]
    b = data.batch(9)
    trainer.train_step(b)
    loaded.train_step(b)
    for n, w in model.embedding_tables().items():  # resumed: same rows, state and rounding
        assert torch.equal(loaded.model.embedding_tables()[n], w)  # type: ignore[operator]


def test_checkpoint_without_table_dtype_loads_as_fp32(data, tmp_path):
    trainer = Trainer(build_model(data.workload), TrainConfig())
    trainer.fit(data.batches(1), 1, progress=False)
    trainer.save_checkpoint(tmp_path / "ck")
    path = tmp_path / "ck" / "state.json"
    state = json.loads(path.read_text())
    for key in ("table_dtype", "table_rounding"):  # as written before these fields existed
        del state["train_config"][key]
    path.write_text(json.dumps(state))
    loaded = Trainer.load_checkpoint(tmp_path / "ck")
    assert loaded.cfg.table_dtype is RowDtype.FP32
    assert all(w.dtype == torch.float32 for w in loaded.model.embedding_tables().values())  # type: ignore[operator]


def test_sharded_runtime_trains_fp16_shards_and_resharding_keeps_the_dtype(data, tmp_path):
    from embark import ShardedDLRM, ShardingPlan
    from embark.sharding import load_sharded_checkpoint, save_sharded_checkpoint
    from tests.embark.sharding.plans import uniform_plan

    cfg = TrainConfig(
        lr=0.05,
        embedding_optimizer="rowwise_adagrad",
        table_dtype=RowDtype.FP16,
        table_rounding=TableRounding.NEAREST,
    )
    batches = list(data.batches(3))
    single = Trainer(build_model(data.workload, seed=3), cfg)
    single.train_step(batches[0])
    single.save_checkpoint(tmp_path / "single")
    rowwise = ShardingPlan.from_dict(uniform_plan(1, "row_wise"))
    sharded = load_sharded_checkpoint(tmp_path / "single", rowwise, 0)
    assert isinstance(sharded.model, ShardedDLRM)
    shards = sharded.model.embedding_store().trainable_weights()
    assert shards and all(w.dtype == torch.float16 for w in shards.values())
    for name, w in single.model.embedding_tables().items():  # type: ignore[operator]
        assert torch.equal(shards[name], w)
    before = {n: w.clone() for n, w in shards.items()}
    sharded.train_step(batches[1])
    shards = sharded.model.embedding_store().trainable_weights()
    assert all(w.dtype == torch.float16 for w in shards.values())
    assert any(not torch.equal(w, before[n]) for n, w in shards.items())
    save_sharded_checkpoint(sharded, tmp_path / "sharded")
    back = Trainer.load_checkpoint(tmp_path / "sharded")  # resharded to one process
    assert back.cfg.table_dtype is RowDtype.FP16
    for name, w in back.model.embedding_tables().items():  # type: ignore[operator]
        assert w.dtype == torch.float16 and torch.equal(w, shards[name])


def _bits(key: int, n: int) -> torch.Tensor:
    """``(n,) int32`` rounding bits: the update bits of rows 0, 1, … of 8 values each."""
    return counter_bits(key, torch.arange(-(-n // 8)), 8).reshape(-1)[:n]


def _awkward_values() -> torch.Tensor:
    """float32 values over every case of the rounding: random magnitudes from 2^-30 to 2^20
    (FP16 subnormals and overflow included), exact FP16/BF16 values, the edges of both dtypes'
    ranges, zeros of both signs, float32 subnormals, ±inf and NaN."""
    gen = torch.Generator().manual_seed(5)
    mags = torch.exp2(torch.rand(20_000, generator=gen) * 50 - 30)
    signs = torch.where(torch.rand(20_000, generator=gen) < 0.5, -1.0, 1.0)
    edges = [0.0, -0.0, 2.0**-14, 2.0**-24, 1.5 * 2.0**-25, 65504.0, 65519.0, 65520.0, 65535.0]
    edges += [1e-45, 1e-40, 2.0**-126, 3.4e38, float("inf"), -float("inf"), float("nan")]
    exact = torch.randn(2000, generator=gen).half().float()
    edge = torch.tensor(edges + [-v for v in edges[2:]])
    return torch.cat([mags * signs, exact, edge])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_stochastic_rounding_equals_the_reference_bit_for_bit(dtype):
    # the same random bits in: the same bits out, over every kind of value, and for bits that
    # are all zeros / all ones (always down / up unless exact); each random draw is used
    x = _awkward_values()
    for bits in (
        _bits(6, x.numel()),
        torch.zeros(x.numel(), dtype=torch.int32),
        torch.full((x.numel(),), -1, dtype=torch.int32),
    ):
        ref = stochastic_round_reference(x, dtype, bits.clone())
        fast = stochastic_round(x, dtype, bits.clone())
        assert fast.dtype == dtype
        assert torch.equal(fast.view(torch.int16), ref.view(torch.int16))
    # the rule itself on a worked example: 1 + ulp/4 rounds up iff r >= 2^k - 2^k / 4
    k = rounding_bits(dtype)
    ulp = 2.0 ** -(23 - k)
    r = torch.tensor([2**k - 2 ** (k - 2) - 1, 2**k - 2 ** (k - 2)], dtype=torch.int32)
    got = stochastic_round(torch.full((2,), 1.0 + ulp / 4), dtype, r).float()
    assert got.tolist() == [1.0, 1.0 + ulp]
    # NaN stays NaN, inf stays inf, beyond FP16's range saturates
    y = torch.tensor([float("nan"), float("inf"), 1e6])
    out = stochastic_round(y, dtype, torch.zeros(3, dtype=torch.int32)).float()
    assert out[0].isnan() and out[1] == float("inf")
    assert out[2] == (65504.0 if dtype == torch.float16 else torch.tensor(1e6).to(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_of_a_finite_value_is_never_inf(dtype):
    # a finite value at or past the dtype's max, rounded up (all-ones bits) or by random bits,
    # saturates at ±max on both paths, as FBGEMM's CUDA rounding (round toward zero) does:
    # before, FP16 65505..65535 rounded up to 65536 = inf, and BF16 float32-max carried into
    # float32's inf pattern; below max the rule is unchanged (65472 < x < 65504 -> either)
    fmax = torch.finfo(dtype).max
    f32max = torch.finfo(torch.float32).max
    edge = [65472.0, 65488.0, 65503.0, 65504.0, 65505.0, 65519.0, 65520.0, 65535.0, 65536.0]
    edge += [1e6, 1e30, 3.3e38, 3.39e38, f32max]
    x = torch.tensor(edge + [-v for v in edge])
    for bits in (torch.full((x.numel(),), -1, dtype=torch.int32), _bits(3, x.numel())):
        for fn in (stochastic_round, stochastic_round_reference):
            got = fn(x, dtype, bits.clone()).float()
            assert got.isfinite().all(), (fn.__name__, x[~got.isfinite()])
            assert (got.abs() <= fmax).all() and torch.equal(got.sign(), x.sign())
            big = x.abs() >= fmax
            assert torch.equal(got[big].abs(), torch.full_like(got[big], fmax))
    # rounding to nearest stays IEEE (FBGEMM's CPU kernel): 65520 is inf in FP16
    near = round_rows(
        torch.tensor([[65519.0, 65520.0]]), torch.float16, TableRounding.NEAREST, 0, torch.arange(1)
    )
    assert near.float().tolist() == [[65504.0, float("inf")]]
