"""Helpers shared by the HPS tests (tables with integer-valued rows, the reference lookup,
the compiled kernel required)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hps.kernels import load_extension


def needs_ext() -> None:
    """Skip the test when the hps compiled kernel is not built (fail it in CI)."""
    if load_extension() is None:
        if os.environ.get("CI"):
            pytest.fail("the hps compiled kernel could not be built (python -m hps.build_ext -v)")
        pytest.skip("the hps compiled kernel is not built")


def make_table(
    num_keys: int, dim: int, seed: int, key_space: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``num_keys`` unique keys drawn from ``[0, key_space)`` (shuffled), integer-valued rows
    (so every comparison is exact)."""
    g = np.random.default_rng(seed)
    key_space = key_space or 2 * num_keys
    keys = g.choice(key_space, size=num_keys, replace=False).astype(np.int64)
    rows = g.integers(-1000, 1000, size=(num_keys, dim)).astype(np.float32)
    return keys, rows


def reference_lookup(
    keys: np.ndarray, rows: np.ndarray, query: torch.Tensor, default: float
) -> torch.Tensor:
    """Plain full-table index lookup: a dense table over the key range with ``default`` rows
    where no key exists, then ``torch.nn.functional.embedding``."""
    span = int(keys.max()) + 1
    full = torch.full((span + 1, rows.shape[1]), default, dtype=torch.float32)
    full[torch.from_numpy(keys)] = torch.from_numpy(rows)
    q = query.clone()
    q[(q < 0) | (q >= span)] = span  # the row of "exists nowhere"
    return torch.nn.functional.embedding(q, full)
