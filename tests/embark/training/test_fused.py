"""The fused sparse embedding update: FBGEMM == reference == dense autograd + torch optimizer,
on integer-valued inputs (duplicates in and across bags, empty bags, sum and mean)."""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import embark.training.fbgemm_tables as fbgemm_tables
import embark.training.fused as fused
from embark.data import SyntheticCTR
from embark.data.jagged import JaggedBatch
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.config import EmbeddingKernel, EmbeddingOptimizerKind, TrainConfig
from embark.training.fused import SparseTableUpdate
from embark.training.sparse_rows import RowOptimizer, row_gradients
from embark.training.trainer import Trainer

ROWS, DIM = 12, 4
# bags: [1, 1, 3] | [] | [5, 1] | [11] | []  -> duplicates in a bag and across bags, empty bags
IDS = torch.tensor([1, 1, 3, 5, 1, 11])
OFFSETS = torch.tensor([0, 3, 3, 5, 6])
KINDS = list(EmbeddingOptimizerKind)


def _tol(kind: EmbeddingOptimizerKind, mode: str) -> tuple[float, float]:
    """``(atol, rtol)``: exact for summed SGD (integer arithmetic, lr 0.5); a mean's 1/3 and
    Adagrad's sqrt and division round differently per kernel."""
    exact = kind is EmbeddingOptimizerKind.SGD and mode == "sum"
    return (0.0, 0.0) if exact else (1e-6, 1e-6)


def _need_fbgemm() -> None:
    if not fbgemm_tables.fbgemm_available():
        if os.environ.get("CI") == "true":
            pytest.fail("fbgemm_gpu does not import (CI needs it)")
        pytest.skip("fbgemm_gpu not installed")


def _weight() -> torch.Tensor:
    return (torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM) % 7) - 3


def _grads(step: int) -> torch.Tensor:
    return (torch.arange(5 * DIM, dtype=torch.float32).view(5, DIM) % 5) - 2 + step


def _run_fused(kind: EmbeddingOptimizerKind, kernel: EmbeddingKernel, mode: str, steps: int = 2):
    opt = RowOptimizer(kind, lr=0.5, eps=1e-8, initial_accumulator_value=0.0)
    upd = SparseTableUpdate("t", ROWS, DIM, opt, kernel)
    w = _weight()
    outs = []
    for s in range(steps):
        out = upd(w, IDS, OFFSETS, mode)
        outs.append(out.detach().clone())
        out.backward(_grads(s))
    return w, {k: v.clone() for k, v in upd.state().items()}, outs


def _run_dense(kind: EmbeddingOptimizerKind, mode: str, steps: int = 2):
    """Dense autograd gradient of the whole table, then the update by its definition."""
    w = torch.nn.Parameter(_weight())
    state = RowOptimizer(kind, lr=0.5).new_state(ROWS, DIM)
    torch_opt: torch.optim.Optimizer | None = None
    if kind is EmbeddingOptimizerKind.ADAGRAD:
        torch_opt = torch.optim.Adagrad([w], lr=0.5, eps=1e-8)
    elif kind is EmbeddingOptimizerKind.SGD:
        torch_opt = torch.optim.SGD([w], lr=0.5)
    outs = []
    for s in range(steps):
        w.grad = None
        out = F.embedding_bag(IDS, w, OFFSETS, mode=mode)
        outs.append(out.detach().clone())
        out.backward(_grads(s))
        if torch_opt is not None:
            torch_opt.step()
            continue
        with torch.no_grad():  # row-wise Adagrad on the dense gradient, every row
            g = w.grad
            state["row_sum"] += g.square().mean(1)
            w -= 0.5 * g / (state["row_sum"].sqrt() + 1e-8).unsqueeze(1)
    if kind is EmbeddingOptimizerKind.ADAGRAD:
        assert torch_opt is not None
        state = {"sum": torch_opt.state[w]["sum"]}
    return w.detach(), state, outs


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_reference_equals_dense_autograd_and_torch_optimizer(kind, mode):
    w_ref, st_ref, outs_ref = _run_fused(kind, EmbeddingKernel.REFERENCE, mode)
    w_d, st_d, outs_d = _run_dense(kind, mode)
    atol, rtol = _tol(kind, mode)
    for a, b in zip(outs_ref, outs_d):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    torch.testing.assert_close(w_ref, w_d, atol=atol, rtol=rtol)
    assert st_ref.keys() == st_d.keys()
    for k in st_ref:
        torch.testing.assert_close(st_ref[k], st_d[k], atol=atol, rtol=rtol)
    # untouched rows and their state never moved
    untouched = torch.tensor([r for r in range(ROWS) if r not in IDS.tolist()])
    assert torch.equal(w_ref[untouched], _weight()[untouched])
    for v in st_ref.values():
        assert torch.count_nonzero(v[untouched]) == 0


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_fbgemm_equals_reference(kind, mode):
    _need_fbgemm()
    w_f, st_f, outs_f = _run_fused(kind, EmbeddingKernel.FBGEMM, mode)
    w_r, st_r, outs_r = _run_fused(kind, EmbeddingKernel.REFERENCE, mode)
    atol, rtol = _tol(kind, mode)
    for a, b in zip(outs_f, outs_r):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    torch.testing.assert_close(w_f, w_r, atol=atol, rtol=rtol)
    assert st_f.keys() == st_r.keys()
    for k in st_f:
        torch.testing.assert_close(st_f[k], st_r[k], atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_fbgemm_kernel_is_built_over_the_table_without_a_copy(kind, monkeypatch):
    """Building the kernel allocates no buffer of the table's size (FBGEMM would zero one of
    weights and one of state) and leaves the table and its state as they were; the kernel
    holds neither between calls."""
    _need_fbgemm()
    rows, dim = 4096, 8
    opt = RowOptimizer(kind, lr=0.5, initial_accumulator_value=0.25)
    weight = torch.randn(rows, dim)
    state = opt.new_state(rows, dim)
    before = weight.clone(), {k: v.clone() for k, v in state.items()}
    sizes: list[int] = []
    zeros = torch.zeros

    def spy(*args, **kwargs):
        out = zeros(*args, **kwargs)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "zeros", spy)
    table = fbgemm_tables.FbgemmTable(weight, state, opt, mean=False)
    monkeypatch.undo()
    assert sizes and max(sizes) < rows
    torch.testing.assert_close(weight, before[0], atol=0.0, rtol=0.0)
    for k, v in state.items():
        torch.testing.assert_close(v, before[1][k], atol=0.0, rtol=0.0)
    held = [t.numel() for t in table.tbe.parameters()] + [t.numel() for t in table.tbe.buffers()]
    assert max(held) < rows


def test_row_gradients_sum_duplicates_and_skip_empty_bags():
    grad = torch.arange(5 * DIM, dtype=torch.float32).view(5, DIM)
    rows, g = row_gradients(grad, IDS, OFFSETS, mean=False)
    assert rows.tolist() == [1, 3, 5, 11]
    assert torch.equal(g[0], 2 * grad[0] + grad[2])  # twice in bag 0, once in bag 2
    assert torch.equal(g[1], grad[0]) and torch.equal(g[2], grad[2])
    assert torch.equal(g[3], grad[3])
    rows, g = row_gradients(grad, IDS, OFFSETS, mean=True)
    assert torch.equal(g[0], 2 * grad[0] / 3 + grad[2] / 2)
    empty = row_gradients(grad, IDS[:0], torch.zeros(5, dtype=torch.long), mean=False)
    assert empty[0].numel() == 0 and empty[1].shape == (0, DIM)


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    w = get_workload("tiny")
    return SyntheticCTR(replace(w, tables=w.tables[:3]), batch_size=32, seed=7)


@pytest.mark.parametrize("kernel", ["reference", "fbgemm"])
@pytest.mark.parametrize(("acc", "atol"), [(0.0, 1e-4), (0.1, 1e-5)])
def test_default_trainer_equals_dense_adagrad(data, kernel, acc, atol):
    """Exact Adagrad (the default) equals the dense path: nn.EmbeddingBag gradients and one
    torch.optim.Adagrad over every parameter, from the default zero accumulator and from 0.1."""
    if kernel == "fbgemm":
        _need_fbgemm()
    cfg = TrainConfig(
        lr=0.05, embedding_lr=0.1, embedding_kernel=kernel, initial_accumulator_value=acc
    )
    fused_model = build_model(data.workload, seed=2)
    dense_model = copy.deepcopy(fused_model)
    t = Trainer(fused_model, cfg)
    emb = [p for n, p in dense_model.named_parameters() if n.startswith("embeddings.")]
    rest = [p for n, p in dense_model.named_parameters() if not n.startswith("embeddings.")]
    opt = torch.optim.Adagrad(
        [{"params": emb, "lr": 0.1}, {"params": rest}],
        lr=0.05,
        eps=1e-8,
        initial_accumulator_value=acc,
    )
    for b in data.batches(4):
        t.train_step(b)
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(dense_model(b.dense, b.sparse), b.labels).backward()
        opt.step()
    got, want = fused_model.state_dict(), dense_model.state_dict()
    # the row gradients are summed in another order than autograd's; Adagrad's first step on
    # a tiny gradient is lr * g / (|g| + eps), sensitive to it (1e-3 of a 0.1 step from a zero
    # accumulator); a non-zero start damps that to 1e-4 of a step
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5)
    assert t.embedding_updates is not None
    for key, v in t.embedding_updates.state_tensors().items():
        p = dense_model.get_parameter(key.split("::")[0])
        torch.testing.assert_close(v, opt.state[p]["sum"], atol=1e-9, rtol=1e-5)


@pytest.mark.parametrize("bad", [-1, 1000])
def test_bad_id_is_refused_before_any_row_changes(data, bad):
    t = Trainer(
        build_model(data.workload, seed=2), TrainConfig(embedding_optimizer="rowwise_adagrad")
    )
    t.train_step(next(iter(data.batches(1))))
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    assert t.embedding_updates is not None
    state = {k: v.clone() for k, v in t.embedding_updates.state_tensors().items()}
    batch = next(iter(data.batches(1, start=1)))
    values = batch.sparse.values.clone()
    name = data.workload.tables[1].name
    assert batch.sparse.values_for(name).numel() > 0
    start = int(batch.sparse.offsets[batch.sparse.keys.index(name) * batch.batch_size])
    values[start] = bad if bad < 0 else data.workload.tables[1].num_rows + 7
    bad_id = int(values[start])
    sparse = JaggedBatch(batch.sparse.keys, values, batch.sparse.lengths)
    broken = replace(batch, sparse=sparse)
    with pytest.raises(ValueError, match=rf"table '{name}' has \d+ rows but id {bad_id} was"):
        t.train_step(broken)
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in t.embedding_updates.state_tensors().items():
        assert torch.equal(v, state[k]), k
    assert t.step == 1


def test_rowwise_state_is_one_value_per_row(data):
    t = Trainer(build_model(data.workload), TrainConfig(embedding_optimizer="rowwise_adagrad"))
    assert t.embedding_updates is not None
    shapes = t.embedding_updates.state_shapes()
    assert shapes == {
        f"embeddings.{tb.name}.weight::row_sum": (tb.num_rows,) for tb in data.workload.tables
    }
    assert all(not p.requires_grad for p in t.embedding_updates.weights.values())
    assert all(not n.startswith("embeddings.") for g in t.optimizer.param_groups for n in g)


@pytest.mark.parametrize(
    ("field", "value"), [("embedding_optimizer", "adam"), ("embedding_kernel", "cuda")]
)
def test_config_names_bad_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig.{field} must be one of .* got '{value}'"):
        TrainConfig(**{field: value})


def test_config_round_trips_and_defaults():
    cfg = TrainConfig(optimizer="sgd", embedding_kernel="reference")
    assert cfg.embedding_update is EmbeddingOptimizerKind.SGD
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig().embedding_update is EmbeddingOptimizerKind.ADAGRAD


def test_missing_fbgemm_falls_back_with_one_warning_or_errors(monkeypatch, caplog):
    def fail(name: str):
        raise ImportError(f"no module named {name}")

    fbgemm_tables._fbgemm.cache_clear()
    monkeypatch.setattr(fbgemm_tables.importlib, "import_module", fail)
    try:
        with caplog.at_level(logging.WARNING, logger=fbgemm_tables.__name__):
            assert fused.resolve_kernel(EmbeddingKernel.AUTO) is EmbeddingKernel.REFERENCE
            assert fused.resolve_kernel(EmbeddingKernel.AUTO) is EmbeddingKernel.REFERENCE
        assert sum("fbgemm_gpu does not import" in r.message for r in caplog.records) == 1
        with pytest.raises(ValueError, match="embedding_kernel='fbgemm' but fbgemm_gpu"):
            fused.resolve_kernel(EmbeddingKernel.FBGEMM)
    finally:
        fbgemm_tables._fbgemm.cache_clear()
