"""The speed half of the ``prune_dlrm`` story: is the pruned model faster?

The AUC half trains a laptop-sized DLRM-DCNv2 whose layers (13–144 wide) are far too small for
any GEMM to speed up. Speed is measured where it matters: the DLRM-DCNv2 dense part at its
MLPerf widths (bottom MLP 13-512-256-128, three rank-512 cross layers over 3456 features, top
MLP 1024-1024-512-256-1; 14 linears), every linear pruned with the run's pattern and sparsity
(one-shot magnitude masks on the initial weights — speed does not depend on the values),
condensed into ``TileSparseLinear`` and timed against the dense model of the same seed,
interleaved (dense, pruned, dense, ...), medians. The pruned output is checked against the
masked dense model.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from embark import build_model, get_workload
from tilesparse import Pattern, TileSparseConfig, model_memory, prune_

__all__ = ["measure_speed"]


def measure_speed(
    pattern: str = "tw",
    sparsity: float = 0.75,
    tile: int = 128,
    batch: int = 4096,
    threads: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Time ``dense_forward`` of the full-width DLRM-DCNv2, dense vs pruned + condensed.

    Args:
        pattern, sparsity, tile: the pruning (``TileSparseConfig``), per layer (no global threshold).
        batch: rows of the dense-part input (``dense (batch, 13)``, pooled ``(batch, 26, 128)``).
        threads: torch intra-op threads while timing (restored afterwards).
        repeats: timed rounds after one warm-up round.

    Returns:
        ``dense_ms``, ``pruned_ms`` (medians), ``speedup``, ``ideal`` ``1/(1-s)``, ``max_abs_err``
        against the masked dense model, weight bytes of both, and the settings.

    Raises:
        ValueError: for ``batch``, ``threads`` or ``repeats`` < 1 (and from ``TileSparseConfig``).
    """
    for name, v in (("batch", batch), ("threads", threads), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"measure_speed: {name} must be an integer >= 1, got {v!r}")
    cfg = TileSparseConfig(
        pattern=Pattern(pattern), sparsity=sparsity, tile=tile, global_threshold=False
    )
    workload = get_workload("dlrm_dcnv2").scaled(1e6)  # tables shrunk; dense widths untouched
    dense = build_model(workload, seed=seed).eval()
    pruned = copy.deepcopy(dense)
    pruner = prune_(pruned, cfg)
    masked = copy.deepcopy(dense)
    pruner.apply_masks_to(masked)
    achieved = pruner.overall_sparsity()
    pruner.compress()

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, workload.dense_features, generator=gen)
    pooled = torch.randn(batch, len(workload.tables), workload.tables[0].dim, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            err = float(
                (pruned.dense_forward(x, pooled) - masked.dense_forward(x, pooled)).abs().max()
            )
            times: dict[str, list[float]] = {"dense": [], "pruned": []}
            models = {"dense": dense, "pruned": pruned}
            for rnd in range(repeats + 1):
                for name, model in models.items():
                    t0 = time.perf_counter()
                    model.dense_forward(x, pooled)
                    if rnd:  # round 0 warms up
                        times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    dense_ms = 1e3 * statistics.median(times["dense"])
    pruned_ms = 1e3 * statistics.median(times["pruned"])
    mem = model_memory(pruned)
    return {
        "model": "dlrm_dcnv2 dense part (full widths)",
        "pattern": pattern,
        "sparsity": sparsity,
        "achieved_sparsity": achieved,
        "tile": tile,
        "batch": batch,
        "threads": threads,
        "repeats": repeats,
        "dense_ms": dense_ms,
        "pruned_ms": pruned_ms,
        "speedup": dense_ms / pruned_ms,
        "ideal": 1.0 / (1.0 - sparsity),
        "max_abs_err": err,
        "dense_weight_bytes": mem.dense_bytes,
        "pruned_weight_bytes": mem.weight_bytes,
    }
