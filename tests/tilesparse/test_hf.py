"""load_compressed: saved TileSparseLinear layers back into a dense architecture (no MiniLM:
the MiniLM round trip is in tests/recipes/test_prune_transformer.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import tilesparse
from tilesparse.hf import load_compressed


class Inner(nn.Module):
    """A stand-in for a Hugging Face model: saved alone, loaded under a parent."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.auto_model = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.auto_model(x)


def _saved(tmp_path) -> tuple[Inner, torch.Tensor]:
    torch.manual_seed(0)
    inner = Inner()
    pruner = tilesparse.prune_(inner, tilesparse.TileSparseConfig(sparsity=0.5, tile=8))
    pruner.compress(backend="reference")
    save_file(inner.state_dict(), str(tmp_path / "model.safetensors"))
    return inner, torch.randn(5, 16)


def test_round_trip_under_a_parent_is_exact(tmp_path) -> None:
    inner, x = _saved(tmp_path)
    outer = Outer()
    assert not torch.equal(outer(x), inner(x))
    load_compressed(outer, tmp_path, backend="reference")
    assert isinstance(outer.auto_model.fc1, tilesparse.TileSparseLinear)
    assert torch.equal(outer.auto_model.fc2.values, inner.fc2.values)
    assert torch.equal(outer.auto_model.fc2.bias, inner.fc2.bias)
    assert torch.equal(outer.auto_model.fc1.bias, inner.fc1.bias)
    assert torch.equal(outer(x), inner(x))


def test_mismatch_changes_nothing(tmp_path) -> None:
    _saved(tmp_path)

    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 9)  # the saved fc2 is 32x8

    wrong = Wrong()
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"'fc2' is a 32x8 \(in x out\) compressed linear, the model's is Linear \(32, 9\)",
    ):
        load_compressed(wrong, tmp_path)
    assert isinstance(wrong.fc1, nn.Linear)  # fc1 was fine, but nothing is replaced
    assert all(torch.equal(before[k], v) for k, v in wrong.state_dict().items())
    with pytest.raises(ValueError, match="'fc1' matches no module"):
        load_compressed(nn.Sequential(nn.Linear(16, 32)), tmp_path)


def test_no_compressed_layer(tmp_path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="holds no compressed"):
        load_compressed(nn.Linear(2, 2), tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_compressed(nn.Linear(2, 2), tmp_path / "missing")
