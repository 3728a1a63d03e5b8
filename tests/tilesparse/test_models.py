"""Whole-model inference through the fast path: a pruned DLRM-DCNv2 and a pruned
``nn.TransformerEncoder``, compressed into ``TileSparseLinear`` and run on the compiled CPU
kernel, in eager mode, under ``torch.export`` and under ``torch.compile``.

Every check compares with the *masked dense* model: the same initial weights with the pruner's
masks multiplied in, run as plain ``nn.Linear`` layers. A counting spy on the extension's entry
point proves the CPU kernel ran (and the reference path did not), so a silent fallback fails.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import tilesparse
from embark.data import JaggedBatch
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import Workload, get_workload
from tests.tolerances import tol
from tilesparse import ops
from tilesparse.linear import TileSparseLinear
from tilesparse.memory import model_memory

SPARSITY = 0.75
# The DLRM-DCNv2 dense part (real MLPerf widths: bottom 13-512-256-128, 3 cross layers of rank
# 512 over 27·128 = 3456 features, top 1024-1024-512-256-1); tables scaled down (rows ÷ 1e6).
DLRM_BATCH = 64
DLRM_LINEARS = 14  # 3 bottom + 3·2 cross + 5 top

# A TransformerEncoder small enough to compile in seconds; G=32 so each FFN linear has tiles.
D_MODEL, N_HEAD, D_FF, N_LAYERS, TX_TILE = 96, 4, 384, 2, 32

# nn.TransformerEncoderLayer's native fused path (torch._transformer_encoder_layer_fwd) reads
# linear1.weight / linear2.weight directly; TileSparseLinear's forward pre-hook makes the layer
# decline it, so eval + no_grad / inference_mode, torch.export and fullgraph compile all go
# through tw_linear (the tests below count the kernel calls).


@dataclass
class KernelCalls:
    """Calls of the compiled CPU kernel and of the reference path since the fixture started."""

    cpu: int = 0
    reference: int = 0

    def reset(self) -> None:
        self.cpu = self.reference = 0


@pytest.fixture
def kernel_calls(ext, monkeypatch) -> KernelCalls:
    """Count calls into ``ext.tw_linear_cpu`` (the fused gather-GEMM) and into the reference
    ``reference_matmul`` that ``tilesparse.ops`` falls back to. Backend ``auto`` is held on the
    kernel route (``TILESPARSE_AUTO_ROUTE=tw``): its choice between the kernel and a dense GEMM
    is tested in kernels/test_ops_auto.py."""
    monkeypatch.setenv("TILESPARSE_AUTO_ROUTE", "tw")
    calls = KernelCalls()
    real_cpu, real_ref = ext.tw_linear_cpu, ops.reference_matmul

    def cpu(*args):
        calls.cpu += 1
        return real_cpu(*args)

    def reference(*args, **kwargs):
        calls.reference += 1
        return real_ref(*args, **kwargs)

    monkeypatch.setattr(ext, "tw_linear_cpu", cpu)
    monkeypatch.setattr(ops, "reference_matmul", reference)
    return calls


def _masked_dense_copy(
    build: Callable[[], nn.Module], pruner: tilesparse.TileSparsePruner
) -> nn.Module:
    """A freshly built (same-seed) model with the pruner's masks multiplied into its weights."""
    return pruner.apply_masks_to(build())


def _count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


# -- DLRM-DCNv2 ---------------------------------------------------------------------------------
@dataclass
class PrunedDLRM:
    workload: Workload
    model: DLRM  # compressed: every linear a TileSparseLinear
    reference: DLRM  # masked dense
    linear_fqns: list[str]


@pytest.fixture(scope="module")
def dlrm() -> PrunedDLRM:
    w = get_workload("dlrm_dcnv2").scaled(1e6)

    def build() -> DLRM:
        return build_model(w, seed=0).eval()

    model = build()
    fqns = [f for f, m in model.named_modules() if isinstance(m, nn.Linear)]
    # 75% in EVERY layer (a global threshold would spread it unevenly across layers)
    cfg = tilesparse.TileSparseConfig(sparsity=SPARSITY, tile=128, global_threshold=False)
    pruner = tilesparse.prune_(model, cfg)
    reference = _masked_dense_copy(build, pruner)
    pruner.compress()
    return PrunedDLRM(w, model, reference, fqns)


def _dlrm_inputs(
    w: Workload, batch: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, JaggedBatch]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, w.dense_features, generator=gen)
    pooled = torch.randn(batch, len(w.tables), w.tables[0].dim, generator=gen)
    per_key = {}
    for t in w.tables:
        lengths = torch.randint(0, t.hotness + 1, (batch,), generator=gen, dtype=torch.int32)
        per_key[t.name] = (
            torch.randint(0, t.num_rows, (int(lengths.sum()),), generator=gen),
            lengths,
        )
    return dense, pooled, JaggedBatch.from_per_key(per_key)


class DenseOnly(nn.Module):
    """``dense_forward`` as a module's ``forward`` (what torch.export takes)."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.model.dense_forward(dense, pooled)


def test_dlrm_every_linear_compressed_at_75(dlrm):
    assert len(dlrm.linear_fqns) == DLRM_LINEARS
    assert _count(dlrm.model, nn.Linear) == 0
    assert _count(dlrm.model, TileSparseLinear) == DLRM_LINEARS
    for fqn in dlrm.linear_fqns:
        layer = dlrm.model.get_submodule(fqn)
        assert isinstance(layer, TileSparseLinear) and layer.tile == 128
        assert layer.sparsity == pytest.approx(SPARSITY, abs=0.01), fqn
    # the memory acceptance on the whole dense part: ≤ (1−s) values + ≤ 3% indices
    mem = model_memory(dlrm.model)
    assert len(mem.sparse_layers) == DLRM_LINEARS
    assert mem.index_bytes <= 0.03 * mem.dense_bytes
    assert mem.total_fraction <= (1 - SPARSITY) + 0.005 + 0.03


def test_dlrm_dense_forward_and_forward_through_cpu_kernel(dlrm, kernel_calls):
    dense, pooled, sparse = _dlrm_inputs(dlrm.workload, DLRM_BATCH)
    with torch.no_grad():
        got = dlrm.model.dense_forward(dense, pooled)
        assert (kernel_calls.cpu, kernel_calls.reference) == (DLRM_LINEARS, 0)
        want = dlrm.reference.dense_forward(dense, pooled)
        assert got.shape == (DLRM_BATCH,)
        torch.testing.assert_close(got, want, **tol("tw_model", torch.float32))
        # the whole model on a synthetic batch: embeddings (unpruned) → dense part
        kernel_calls.reset()
        got = dlrm.model(dense, sparse)
        assert (kernel_calls.cpu, kernel_calls.reference) == (DLRM_LINEARS, 0)
        torch.testing.assert_close(
            got, dlrm.reference(dense, sparse), **tol("tw_model", torch.float32)
        )
    # a batch of one goes through the same path
    kernel_calls.reset()
    with torch.no_grad():
        one = dlrm.model.dense_forward(dense[:1], pooled[:1])
    assert kernel_calls.cpu == DLRM_LINEARS
    torch.testing.assert_close(
        one, dlrm.reference.dense_forward(dense[:1], pooled[:1]), **tol("tw_model", torch.float32)
    )


def test_dlrm_torch_export_of_dense_part(dlrm, kernel_calls):
    dense, pooled, _ = _dlrm_inputs(dlrm.workload, DLRM_BATCH, seed=1)
    module = DenseOnly(dlrm.model)
    exported = torch.export.export(module, (dense, pooled))
    ops_in_graph = [n for n in exported.graph.nodes if "tilesparse.tw_linear" in str(n.target)]
    assert len(ops_in_graph) == DLRM_LINEARS
    kernel_calls.reset()
    with torch.no_grad():
        got = exported.module()(dense, pooled)
        assert kernel_calls.cpu == DLRM_LINEARS and kernel_calls.reference == 0
        torch.testing.assert_close(got, module(dense, pooled), **tol("tw_model", torch.float32))


def test_dlrm_bf16_through_cpu_kernel(dlrm, kernel_calls):
    dense, pooled, _ = _dlrm_inputs(dlrm.workload, DLRM_BATCH, seed=2)
    model = copy.deepcopy(dlrm.model).to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, TileSparseLinear)]
    assert all(m.values.dtype == torch.bfloat16 and m.col_idx.dtype == torch.int64 for m in layers)
    with torch.no_grad():
        got = model.dense_forward(dense.bfloat16(), pooled.bfloat16())
        want = dlrm.reference.dense_forward(dense, pooled)
    assert got.dtype == torch.bfloat16
    assert (kernel_calls.cpu, kernel_calls.reference) == (DLRM_LINEARS, 0)
    torch.testing.assert_close(got.float(), want, **tol("tw_model", torch.bfloat16))


# -- TransformerEncoder -------------------------------------------------------------------------
def _build_encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)  # nn layers draw their init from the global generator
    layer = nn.TransformerEncoderLayer(D_MODEL, N_HEAD, D_FF, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, N_LAYERS, enable_nested_tensor=False).eval()


def _ffn_only(module: nn.Module, fqn: str) -> bool:
    return fqn.endswith(("linear1", "linear2"))


@pytest.fixture
def encoder() -> tuple[nn.TransformerEncoder, nn.TransformerEncoder]:
    """(pruned and compressed FFNs, masked dense reference); each call builds a fresh pair."""
    rng_state = torch.get_rng_state()
    try:
        model = _build_encoder()
        cfg = tilesparse.TileSparseConfig(sparsity=SPARSITY, tile=TX_TILE, global_threshold=False)
        pruner = tilesparse.prune_(model, cfg, _ffn_only)
        assert sorted(pruner.layers) == [
            f"layers.{i}.{n}" for i in range(N_LAYERS) for n in ("linear1", "linear2")
        ]
        reference = _masked_dense_copy(_build_encoder, pruner)
        pruner.compress()
    finally:
        torch.set_rng_state(rng_state)
    assert _count(model, TileSparseLinear) == 2 * N_LAYERS
    return model, reference


def _tokens(seed: int, batch: int = 3, seq: int = 10) -> torch.Tensor:
    return torch.randn(batch, seq, D_MODEL, generator=torch.Generator().manual_seed(seed))


def test_encoder_eager_through_cpu_kernel(encoder, kernel_calls):
    model, reference = encoder
    x = _tokens(0)
    got = model(x)  # eval, autograd on: the layer takes its Python path
    assert (kernel_calls.cpu, kernel_calls.reference) == (2 * N_LAYERS, 0)
    with torch.no_grad():
        torch.testing.assert_close(got, reference(x), **tol("tw_model", torch.float32))


def test_encoder_inference_mode_through_cpu_kernel(encoder, kernel_calls):
    model, reference = encoder
    x = _tokens(1)
    with torch.inference_mode():
        got = model(x)
        torch.testing.assert_close(got, reference(x), **tol("tw_model", torch.float32))
    assert (kernel_calls.cpu, kernel_calls.reference) == (2 * N_LAYERS, 0)


def test_encoder_torch_export(encoder, kernel_calls):
    model, _ = encoder
    x = _tokens(2)
    exported = torch.export.export(model, (x,))
    ops_in_graph = [n for n in exported.graph.nodes if "tilesparse.tw_linear" in str(n.target)]
    assert len(ops_in_graph) == 2 * N_LAYERS
    kernel_calls.reset()
    got = exported.module()(x)
    assert kernel_calls.cpu == 2 * N_LAYERS
    torch.testing.assert_close(got, model(x), **tol("tw_model", torch.float32))


def test_encoder_torch_export_train_mode(encoder, kernel_calls):
    """The op itself exports: in train mode (dropout 0, same function) the layer never reaches
    the native fused path's ``.weight`` read, so this isolates the op from that path."""
    model, _ = encoder
    model.train()
    x = _tokens(3)
    exported = torch.export.export(model, (x,))
    ops_in_graph = [n for n in exported.graph.nodes if "tilesparse.tw_linear" in str(n.target)]
    assert len(ops_in_graph) == 2 * N_LAYERS
    kernel_calls.reset()
    got = exported.module()(x)
    assert (kernel_calls.cpu, kernel_calls.reference) == (2 * N_LAYERS, 0)
    torch.testing.assert_close(got, model(x), **tol("tw_model", torch.float32))


@pytest.mark.parametrize(
    "backend",
    [
        "eager",
        "aot_eager",
        # inductor's first compile takes ~20 s on 2 cores (≈3 s with its on-disk cache warm)
        pytest.param("inductor", marks=pytest.mark.slow),
    ],
)
def test_encoder_torch_compile(encoder, kernel_calls, backend):
    model, reference = encoder
    x = _tokens(4)
    want = model(x)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend)
        kernel_calls.reset()
        got = compiled(x)
        assert kernel_calls.cpu >= 2 * N_LAYERS and kernel_calls.reference == 0
        torch.testing.assert_close(got, want, **tol("tw_model", torch.float32))
        with torch.no_grad():
            torch.testing.assert_close(got, reference(x), **tol("tw_model", torch.float32))
    finally:
        torch._dynamo.reset()


def test_encoder_torch_compile_fullgraph(encoder, kernel_calls):
    model, _ = encoder
    x = _tokens(5)
    want = model(x)
    torch._dynamo.reset()
    try:
        got = torch.compile(model, backend="eager", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, **tol("tw_model", torch.float32))


def test_encoder_bf16_through_cpu_kernel(encoder, kernel_calls):
    model, reference = encoder
    x = _tokens(6)
    got = model.to(torch.bfloat16)(x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert (kernel_calls.cpu, kernel_calls.reference) == (2 * N_LAYERS, 0)
    with torch.no_grad():
        torch.testing.assert_close(got.float(), reference(x), **tol("tw_model", torch.bfloat16))
