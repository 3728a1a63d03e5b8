"""``TWChain``: TW layers run K-major through the CUTLASS emulation, bit-equal to the reference
(integer-valued inputs) for fp16/bf16 with bias, ReLU and GELU, tails and empty tiles; the
conversion of ``nn.Sequential`` blocks; the fallbacks that keep autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tilesparse
from cutlass_kernels.epilogue import Activation, apply_activation
from tests.tilesparse.tw_cases import layout_with_empty_tile, tw_random_mask
from tilesparse import TileSparseLinear, TWChain, chain_, to_chain

DTYPES = (torch.float16, torch.bfloat16)


def tw_layer(
    K: int,
    N: int,
    G: int,
    gen: torch.Generator,
    dtype: torch.dtype,
    bias: bool = True,
    nonneg: bool = False,
) -> TileSparseLinear:
    """A TW layer with weights in {-1, 0, 1} ({0, 1} when ``nonneg``), half of its columns'
    tiles' rows kept, a quarter of its columns pruned, integer bias in [-2, 2]."""
    mask = tw_random_mask(K, N, G, keep_rows=0.5, gen=gen, drop_cols=0.25)
    lin = nn.Linear(K, N, bias=bias)
    lo = 0 if nonneg else -1
    with torch.no_grad():
        lin.weight.copy_(torch.randint(lo, 2, (N, K), generator=gen).float())
        if bias:
            lin.bias.copy_(torch.randint(-2, 3, (N,), generator=gen).float())
    layer = TileSparseLinear.from_dense(lin.to(dtype), mask_kn=mask, tile=G, backend="reference")
    return layer


def empty_tile_layer(dtype: torch.dtype) -> TileSparseLinear:
    """K=5, N=8: a tile {4, 5} that keeps no rows, column 6 pruned, integer bias."""
    layer = TileSparseLinear(5, 8, tile=4, backend="reference", dtype=dtype)
    layer.set_layout(layout_with_empty_tile(5, 8, dtype))
    with torch.no_grad():
        assert layer.bias is not None
        layer.bias.copy_(torch.tensor([1, -1, 2, 0, -2, 3, 4, -3], dtype=dtype))
    return layer


def fused_reference(x: torch.Tensor, seq: nn.Sequential) -> torch.Tensor:
    """What the fused epilogue computes, from the dense weights: per layer the exact product
    (float64, checked exact in fp32 too), ``act(acc + bias)`` in fp32, one rounding; ``act`` the
    epilogue's formula (``cutlass_kernels.epilogue.apply_activation``: ReLU exact, GELU its
    fp32 rational form, compared with torch's GELU in tests/cutlass_kernels/test_epilogue.py)."""
    dtype = x.dtype
    h = x
    mods = list(seq)
    for i, m in enumerate(mods):
        if not isinstance(m, TileSparseLinear):
            continue
        w = m.to_dense().weight.detach().double()
        acc = h.double() @ w.T
        # every partial sum exact in fp32: terms are multiples of 2^-11 (fp16/bf16 activations
        # above 0.5 times small integers) and bounded well below 2^24 · 2^-11
        terms = h.double().abs() @ w.abs().T
        assert float(terms.max()) < 2.0**12 and torch.equal(acc.float().double(), acc)
        d = acc.float()
        if m.bias is not None:
            d = d + m.bias.detach().float()
        nxt = next(  # the activation before the next layer, past dropouts
            (a for a in mods[i + 1 :] if isinstance(a, TileSparseLinear | nn.ReLU | nn.GELU)), None
        )
        if type(nxt) is nn.ReLU:
            d = apply_activation(d, Activation.RELU)
        elif type(nxt) is nn.GELU:
            gelu = Activation.GELU_TANH if nxt.approximate == "tanh" else Activation.GELU
            d = apply_activation(d, gelu)
        h = d.to(dtype)
    return h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["none", "relu"])
def test_chain_equals_reference_layers(dtype: torch.dtype, act: str) -> None:
    """Tails everywhere (K, N, batch not multiples of the tile or of 8), a layer without bias:
    equal to the same Sequential run layer by layer on the reference backend."""
    gen = torch.Generator().manual_seed(1)
    mods: list[nn.Module] = [tw_layer(37, 53, 8, gen, dtype)]
    if act == "relu":
        mods.append(nn.ReLU())
    mods += [tw_layer(53, 29, 16, gen, dtype, bias=False), nn.Dropout(0.1)]
    if act == "relu":
        mods.append(nn.ReLU())
    mods.append(tw_layer(29, 11, 4, gen, dtype))
    seq = nn.Sequential(*mods).eval()
    chain = to_chain(seq)
    assert chain.backend == "emulated"
    for m in (13, 8, 1):
        x = torch.randint(-1, 2, (m, 37), generator=gen).to(dtype)
        with torch.no_grad():
            ref = seq(x)  # layer by layer, backend "reference"
            got = chain(x)
        assert float(ref.abs().max()) <= 256  # integers: exact in bf16, no double rounding
        assert torch.equal(got, ref), (m, (got - ref).abs().max())
        assert torch.equal(got, fused_reference(x, seq))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_chain_gelu_and_empty_tile(dtype: torch.dtype, approximate: str) -> None:
    """A GELU fused between layers (its outputs fractional), a layer whose tile keeps no rows
    (those columns are act(bias)) and a pruned column, batch 3 (padded to 8), 3-D input."""
    gen = torch.Generator().manual_seed(2)
    seq = nn.Sequential(
        tw_layer(19, 5, 4, gen, dtype, nonneg=True),
        nn.ReLU(),
        empty_tile_layer(dtype),
        nn.GELU(approximate=approximate),
        tw_layer(8, 13, 4, gen, dtype),
        nn.GELU(approximate=approximate),
    ).eval()
    chain = to_chain(seq)
    assert chain.activations() == (
        "relu",
        f"gelu{'_tanh' if approximate == 'tanh' else ''}",
    ) + (chain.activations()[2],)
    x = torch.randint(0, 2, (3, 2, 19), generator=gen).to(dtype)
    with torch.no_grad():
        got = chain(x)
    ref = fused_reference(x.reshape(6, 19), seq).reshape(3, 2, 13)
    assert torch.equal(got, ref)
    # the layer-by-layer op agrees to within its extra rounding (GELU of a rounded sum)
    with torch.no_grad():
        torch.testing.assert_close(got, seq(x), atol=0.05, rtol=0.02)


def test_chain_all_pruned_layer_gives_act_bias() -> None:
    """Every column of the last layer pruned: the output is act(bias) in every row."""
    gen = torch.Generator().manual_seed(3)
    last = TileSparseLinear(6, 4, tile=4, backend="reference", dtype=torch.float16)
    with torch.no_grad():
        assert last.bias is not None
        last.bias.copy_(torch.tensor([-1.0, 2.0, 0.0, 3.0]))
    chain = TWChain(tw_layer(9, 6, 4, gen, torch.float16), last, nn.ReLU())
    x = torch.randint(-1, 2, (5, 9), generator=gen).half()
    with torch.no_grad():
        y = chain(x)
    assert torch.equal(y, torch.tensor([0.0, 2.0, 0.0, 3.0]).half().expand(5, 4))


def test_chain_repacks_after_edit_and_shape_change() -> None:
    gen = torch.Generator().manual_seed(4)
    seq = nn.Sequential(
        tw_layer(12, 20, 4, gen, torch.float16), nn.ReLU(), tw_layer(20, 7, 4, gen, torch.float16)
    )
    chain = to_chain(seq)
    x = torch.randint(-1, 2, (10, 12), generator=gen).half()
    with torch.no_grad():
        chain(x)
        layer = chain.layers()[1]
        layer.values.mul_(2)  # in place: the chain packs again
        assert layer.bias is not None
        layer.bias.add_(1)
        assert torch.equal(chain(x), fused_reference(x, seq))
        x2 = x[:3]  # a new batch size: new buffers
        assert torch.equal(chain(x2), fused_reference(x2, seq))


def test_chain_falls_back_for_autograd_and_training() -> None:
    """Gradients needed or dropout active: the layers one by one (autograd intact)."""
    gen = torch.Generator().manual_seed(5)
    seq = nn.Sequential(
        tw_layer(6, 9, 4, gen, torch.float32), nn.GELU(), tw_layer(9, 3, 4, gen, torch.float32)
    )
    chain = to_chain(seq)
    x = torch.randn(4, 6, generator=gen, requires_grad=True)
    y = chain(x)
    y.sum().backward()
    assert x.grad is not None and chain.layers()[0].bias.grad is not None  # type: ignore[union-attr]
    torch.testing.assert_close(y, seq(x))


def test_chain_refuses_what_it_cannot_run() -> None:
    gen = torch.Generator().manual_seed(6)
    a, b = tw_layer(6, 9, 4, gen, torch.float16), tw_layer(8, 3, 4, gen, torch.float16)
    with pytest.raises(ValueError, match="module 1 takes 8 features but the layer before gives 9"):
        TWChain(a, b)
    with pytest.raises(ValueError, match=r"module 1 \(Tanh\) cannot be chained"):
        TWChain(a, nn.Tanh())
    with pytest.raises(ValueError, match="module 0 .Dropout."):
        TWChain(nn.Dropout(), a)
    with pytest.raises(ValueError, match="unknown tw_linear backend 'gpu'"):
        TWChain(a, backend="gpu")
    chain = TWChain(a, backend="cutlass")
    with pytest.raises(ValueError, match="float16/bfloat16 CUDA tensors, got torch.float16 on cpu"):
        with torch.no_grad():
            chain(torch.zeros(2, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match="x has 5 features"), torch.no_grad():
        TWChain(a)(torch.zeros(2, 5, dtype=torch.float16))


def test_chain_in_place_keeps_state_dict_and_output() -> None:
    """``chain_`` converts the Sequentials of a model (an MLP and an FFN block) in place."""
    gen = torch.Generator().manual_seed(7)
    dt = torch.float16

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bottom = nn.Sequential(
                tw_layer(10, 16, 4, gen, dt), nn.ReLU(), tw_layer(16, 12, 4, gen, dt), nn.ReLU()
            )
            self.ffn = nn.Sequential(
                tw_layer(12, 24, 8, gen, dt),
                nn.GELU(),
                nn.Dropout(0.1),
                tw_layer(24, 12, 8, gen, dt),
            )
            self.head = nn.Sequential(nn.LayerNorm(12, dtype=dt), nn.Linear(12, 1, dtype=dt))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.ffn(self.bottom(x)))

    net = Net().eval()
    keys = list(net.state_dict())
    x = torch.randint(-1, 2, (7, 10), generator=gen).to(dt)
    with torch.no_grad():
        before = net(x)
    assert chain_(net) == ["bottom", "ffn"]
    assert isinstance(net.bottom, TWChain) and isinstance(net.ffn, TWChain)
    assert type(net.head) is nn.Sequential
    assert list(net.state_dict()) == keys
    assert not net.ffn.training
    with torch.no_grad():
        torch.testing.assert_close(net(x), before, atol=0.02, rtol=0.01)
    assert "chain_" in tilesparse.__all__ and "to_chain" in tilesparse.__all__


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_on_cutlass_equals_emulation(dtype: torch.dtype) -> None:
    """On a CUDA device: bias + ReLU/GELU chains (fused in the kernel's epilogue) bit-equal to
    the emulation, with and without CUDA graphs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(8)
    for act in (nn.ReLU(), nn.GELU()):
        seq = nn.Sequential(
            tw_layer(200, 300, 64, gen, dtype, nonneg=True), act, tw_layer(300, 130, 32, gen, dtype)
        ).eval()
        x = torch.randint(0, 2, (77, 200), generator=gen).to(dtype)
        with torch.no_grad():
            want = to_chain(seq, backend="emulated")(x)
            gpu = seq.cuda()
            for graph in (False, True):
                chain = to_chain(gpu, backend="cutlass", cuda_graph=graph)
                for _ in range(3):  # eager, capture + replay, replay
                    assert torch.equal(chain(x.cuda()).cpu(), want)
