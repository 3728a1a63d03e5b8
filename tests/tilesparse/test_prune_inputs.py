"""Hostile inputs to ``prune_`` and ``load_compressed``: tied (shared) weights pruned once
with their true sparsity reported, a failed prune leaving the model exactly as it was, the
non-finite score error naming the layer, and saved non-finite values refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn.utils import parametrize

import tilesparse
from tilesparse.hf import load_compressed


class Tied(nn.Module):
    """Two linears sharing one weight tensor, fed inputs of different scales (so activation
    scores of the two differ), and a third linear of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.b.weight = self.a.weight
        self.c = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.linspace(0.1, 3.0, 32)
        return self.c(torch.relu(self.a(x)) + self.b(x * scale.flip(0)))


def _zero_fraction(t: torch.Tensor) -> float:
    return float((t == 0).float().mean())


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_tied_weight_is_pruned_once_and_its_true_sparsity_reported(calibrated) -> None:
    model = Tied()
    g = torch.Generator().manual_seed(1)
    calib = [(torch.randn(64, 32, generator=g),) for _ in range(4)] if calibrated else None
    cfg = tilesparse.TileSparseConfig(pattern="ew", sparsity=0.5, global_threshold=False)
    pruner = tilesparse.prune_(model, cfg, calibration=calib)
    shared = model.a.weight.detach()
    assert _zero_fraction(shared) == 0.5  # asked 50 %, got 50 %: one mask on the tensor
    assert model.b.weight is model.a.parametrizations.weight.original  # still one tensor
    assert pruner.tied == {"b": "a"}
    assert sorted(pruner.layers) == ["a", "c"]
    assert torch.equal(model.b.weight.detach(), shared)
    stats = {s.fqn: s for s in pruner.stats()}
    assert stats["a"].sparsity == _zero_fraction(shared)
    every = torch.cat([shared.flatten(), model.c.weight.detach().flatten()])
    assert pruner.overall_sparsity() == pytest.approx(_zero_fraction(every))


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state as raw bits (NaN compares equal to itself)."""
    return {k: v.detach().clone().view(torch.uint8) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_failed_prune_leaves_the_model_exactly_as_it_was(calibrated) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    with torch.no_grad():
        model[2].weight[3, 5] = float("nan")
    before, cls = _bits(model), [type(m) for m in model]
    g = torch.Generator().manual_seed(1)
    calib = [(torch.randn(32, 16, generator=g),)] if calibrated else None
    with pytest.raises(ValueError, match=r"layer '2'.*(NaN or inf|non-finite)"):
        tilesparse.prune_(model, tilesparse.TileSparseConfig(sparsity=0.5), calibration=calib)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert [type(m) for m in model] == cls
    after = _bits(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_load_compressed_refuses_non_finite_values(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    pruner = tilesparse.prune_(model, tilesparse.TileSparseConfig(sparsity=0.5, tile=8))
    pruner.compress(backend="reference")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["2.values"].view(-1)[0] = float("inf")
    save_file(state, str(tmp_path / "model.safetensors"))
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    before = _bits(fresh)
    with pytest.raises(ValueError, match=r"'2': saved 'values' holds 1 non-finite"):
        load_compressed(fresh, tmp_path, backend="reference")
    assert all(isinstance(m, nn.Linear | nn.ReLU) for m in fresh)  # nothing replaced
    assert all(torch.equal(_bits(fresh)[k], v) for k, v in before.items())
