"""What every row of ``bench_models`` measures besides the time: the output's error against the
masked dense model (and the verdict), operator counts from the profiler, memory; and the
interleaved timing of a row's contenders."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import tilesparse
from benchmarks.tilesparse.timing import interleaved, time_once
from tilesparse.memory import model_memory

# Whole-model tolerance against the masked dense model: the ("tw_model", dtype) bounds of
# tests/tolerances.py (fp32 a different summation order per layer, bf16 against the fp32
# reference).
MODEL_TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.bfloat16: {"rtol": 5e-2, "atol": 5e-2},
}


def op_counts(fn: Callable[[], Any], names: tuple[str, ...]) -> dict[str, int]:
    """How many times each operator in ``names`` ran during one call of ``fn`` (profiler)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e.name for e in prof.events()]
    return {n: events.count(n) for n in names}


def max_err(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    """Max abs error of ``got`` against the fp32 ``want`` and whether it is within
    :data:`MODEL_TOL` of ``dtype`` (``|got − want| <= atol + rtol·|want|`` elementwise)."""
    tol = MODEL_TOL[dtype]
    diff = (got.float() - want.float()).abs()
    ok = got.shape == want.shape and bool(
        (diff <= tol["atol"] + tol["rtol"] * want.float().abs()).all()
    )
    return float(diff.max()), ok


def verdict(err: float, within_tol: bool, reference_err: float | None) -> dict[str, Any]:
    """The correctness fields of a row. ``correct``: within :data:`MODEL_TOL`, or (bf16) no
    more than twice the error the masked dense model itself makes in that dtype against the
    same fp32 output (``reference_err``): the error of the dtype, not of the TW path."""
    return {
        "max_abs_err": err,
        "within_tolerance": within_tol,
        "masked_dense_max_abs_err": reference_err,
        "correct": within_tol or (reference_err is not None and err <= 2.0 * reference_err),
    }


def masked_dense_err(
    reference: nn.Module,
    dtype: torch.dtype,
    run: Callable[[nn.Module], torch.Tensor],
    want: torch.Tensor,
) -> float | None:
    """Max abs error of the masked dense model cast to ``dtype`` against its fp32 output
    ``want`` (``None`` for fp32)."""
    if dtype == torch.float32:
        return None
    with torch.no_grad():
        return max_err(run(copy.deepcopy(reference).to(dtype)), want, dtype)[0]


def auto_repeats(round_s: float, row_seconds: float, lo: int = 5, hi: int = 30) -> int:
    """Rounds so that a row's calls take about ``row_seconds``."""
    return max(lo, min(hi, int(row_seconds / max(round_s, 1e-6)) + 1))


def memory_fields(model: nn.Module) -> dict[str, Any]:
    mem = model_memory(model)
    return {
        "dense_weight_bytes": mem.dense_bytes,
        "weight_bytes": mem.weight_bytes,
        "index_bytes": mem.index_bytes,
        "memory_fraction": mem.total_fraction,
        "index_fraction": mem.index_bytes / max(1, mem.dense_bytes),
        "sparse_layers": len(mem.sparse_layers),
        "linear_layers": len(mem.layers),
        "memory_summary": mem.summary(),
    }


def masked_reference(
    build: Callable[[], nn.Module], pruner: tilesparse.TileSparsePruner
) -> nn.Module:
    """A freshly built (same-seed) model with the pruner's masks multiplied into its weights."""
    return pruner.apply_masks_to(build())


def time_rows(
    fns: dict[str, Callable[[], Any]], args: argparse.Namespace
) -> tuple[dict[str, float], int]:
    """Warm, pick the rounds, time interleaved; medians in ms and the rounds used."""
    for fn in fns.values():
        fn()
    round_s = sum(time_once(fn) for fn in fns.values())
    repeats = args.repeats if args.repeats is not None else auto_repeats(round_s, args.row_seconds)
    t = interleaved(fns, repeats, warmup=0)
    return {k: v.median_ms for k, v in t.items()} | {
        f"{k}_iqr": 1e3 * v.iqr_s for k, v in t.items()
    }, repeats
