"""The benchmark rows of ``gpu_check``: one GEMM shape, dense cuBLAS against the TW kernel at
each sparsity (every candidate instance timed, the fastest re-timed interleaved with dense,
then the row-major path with its two transposes) and 2:4 semi-structured at 50%. Every timed
output is checked at sampled batch columns against the fp32 product of the same condensed
problem; an error in a candidate, a sparsity or the 2:4 peer is recorded in its row.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.cutlass_kernels.gpu_timing import Timer, Timing, launch_bound
from benchmarks.cutlass_kernels.gpu_verify import (
    CudaContextLost,
    check_close,
    cuda_alive,
    err_text,
    tw_layout,
)

if TYPE_CHECKING:
    from cutlass_kernels.manifest import TWKernel
    from cutlass_kernels.reference import TWLaunch, TWPackedWeight

SPARSITIES = (50, 75, 90)
LAST_BLOCK = 256  # widest batch tile of any instance: the sampled columns cover the last one


def sample_columns(M: int, n: int = 64, last: int = LAST_BLOCK) -> list[int]:
    """Batch rows to check of an ``(M, N)`` output: the first ``n``, ``n`` in the middle and the
    last ``last`` (the last batch block of any instance, ragged or not)."""
    picked = (
        set(range(min(n, M)))
        | set(range(M // 2, min(M // 2 + n, M)))
        | set(range(max(0, M - last), M))
    )
    return sorted(picked)


# ------------------------------------------------------------------------------------ benchmark
def _tw_linear(
    x: torch.Tensor, pw: TWPackedWeight, kernel: TWKernel, ext: ModuleType | None
) -> torch.Tensor:
    """Row-major ``(M, K) → (M, N)`` through the kernel (pack, run, unpack), on ``ext``
    (``launch.tw_linear_packed`` would load the default extension, not this run's)."""
    from cutlass_kernels import launch
    from cutlass_kernels.reference import pack_launch, unpack_output

    args = pack_launch(x, pw)
    launch.tw_gemm_kmajor(args, kernel=kernel, ext=ext)
    return unpack_output(args)


def time_candidates(
    cands: list[TWKernel],
    time_one: Callable[[TWKernel], Timing],
    check_one: Callable[[TWKernel], tuple[bool, float]],
    alive: Callable[[], bool],
) -> tuple[dict[str, Timing], dict[str, float], dict[str, str]]:
    """Time each candidate instance, then check its timed output; ``(timings, max_abs_err,
    errors)`` by instance name. A candidate that raises or whose output is off is recorded in
    ``errors`` and not in ``timings``.

    Raises:
        CudaContextLost: a candidate left the device unusable (``alive()`` false).
    """
    timings: dict[str, Timing] = {}
    max_err: dict[str, float] = {}
    errors: dict[str, str] = {}
    for k in cands:
        try:
            t = time_one(k)
            ok, max_err[k.name] = check_one(k)
            if not ok:
                errors[k.name] = (
                    f"timed output off the fp32 reference (max abs err {max_err[k.name]:.3g})"
                )
                continue
            timings[k.name] = t
        except Exception as e:  # recorded in the row
            if not alive():
                raise CudaContextLost(f"{k.name}: {err_text(e)}") from e
            errors[k.name] = err_text(e)
    return timings, max_err, errors


def _bench_tw(
    row: dict[str, Any],
    ext: ModuleType | None,
    cands: list[TWKernel],
    x: torch.Tensor,
    cols: torch.Tensor,
    s: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    timer: Timer,
    reps: int,
    dense_fn: Callable[[], object],
    device: str,
) -> None:
    """Fill ``row`` with one TW layer's figures: ``x (M, K)``, ``cols`` the sampled batch rows
    checked, the layer ``(K, row["N"])`` at ``s`` % (``row`` stays partial on an error)."""
    from cutlass_kernels import launch
    from cutlass_kernels.reference import pack_launch, pack_weight
    from tilesparse.format import reference_matmul

    M, K = x.shape
    N = row["N"]
    layout = tw_layout(K, N, 128, s, gen, torch.float32)
    layout.values.copy_(layout.values.to(dtype))  # the very problem the kernel gets
    ref = reference_matmul(x[cols].float(), layout)  # (len(cols), N) fp32
    pw = pack_weight(layout, dtype=dtype, device=device)
    args = pack_launch(x, pw)  # xt (K, M'), yt (N, M')
    density = layout.density
    row.update(density=density, ideal=1.0 / density)

    def kmajor_output_ok(_k: object = None) -> tuple[bool, float]:  # yt: the last timed output
        return check_close(args.yt[:, cols].t(), ref, dtype)

    kernel = _search_candidates(row, args, ext, cands, timer, reps, kmajor_output_ok, device)
    # The winner again, in a fresh measurement alternating with dense: the reported figures.
    args.yt.zero_()
    fresh = timer.interleaved(
        {"tw": lambda: launch.tw_gemm_kmajor(args, kernel=kernel, ext=ext), "dense": dense_fn},
        reps,
    )
    ok, err = kmajor_output_ok()
    us, dense_us = fresh["tw"], fresh["dense"]
    row.update(
        us=us,
        dense_us=dense_us,
        ratio=dense_us / us,
        fraction_of_ideal=dense_us / us * density,
        launch_bound=launch_bound(row["host_us"], us),
        max_abs_err=err,
        ok=ok and not row["candidate_errors"],
        effective_tflops=2.0 * M * K * N * density / us / 1e6,
    )
    # Row-major path: the two transposes included.
    last: dict[str, torch.Tensor] = {}
    op = timer.time(lambda: last.__setitem__("y", _tw_linear(x, pw, kernel, ext)), reps)
    op_ok, op_err = check_close(last["y"][cols], ref, dtype)
    row.update(
        op_us=op.us,
        op_hot_us=op.hot_us,
        op_host_us=op.host_us,
        op_launch_bound=op.launch_bound,
        ratio_op=dense_us / op.us,
        op_max_abs_err=op_err,
        ok=row["ok"] and op_ok,
    )


def _search_candidates(
    row: dict[str, Any],
    args: TWLaunch,
    ext: ModuleType | None,
    cands: list[TWKernel],
    timer: Timer,
    reps: int,
    output_ok: Callable[[], tuple[bool, float]],
    device: str,
) -> TWKernel:
    """Time every candidate on ``args`` (K-major), record them in ``row`` with the instance
    ``select_for`` would pick; the fastest that is correct.

    Raises:
        RuntimeError: every candidate failed.
    """
    from cutlass_kernels import launch

    def time_one(k: TWKernel) -> Timing:  # yt zeroed first: pruned rows keep what was there
        args.yt.zero_()
        return timer.time(lambda: launch.tw_gemm_kmajor(args, kernel=k, ext=ext), reps)

    timings, max_err, errors = time_candidates(
        cands, time_one, lambda _k: output_ok(), lambda: cuda_alive(device)
    )
    row.update(
        candidates_us={n: t.us for n, t in timings.items()},
        candidate_errors=errors,
        candidate_max_abs_err=max_err,
    )
    if not timings:
        raise RuntimeError(f"every candidate failed: {errors}")
    best = min(timings, key=lambda n: timings[n].us)
    try:  # what the layer's op would pick without tuning (None: a broken or unbuilt one)
        picked = launch.select_for(args, ext)
    except ValueError:
        picked = None
    row.update(
        kernel=best,
        selected_kernel=picked and picked.name,
        selected_us=timings[picked.name].us if picked and picked.name in timings else None,
        **timings[best].fields(),
        search_us=timings[best].us,
    )
    return next(k for k in cands if k.name == best)


def _bench_24(
    row: dict[str, Any],
    x: torch.Tensor,
    w_dense: torch.Tensor,
    cols: torch.Tensor,
    dtype: torch.dtype,
    timer: Timer,
    reps: int,
    dense_fn: Callable[[], object],
) -> None:
    """Fill ``row`` with 2:4 semi-structured at 50% (``x (M, K)``, ``w_dense (K, N)``)."""
    from torch.sparse import to_sparse_semi_structured

    K, N = w_dense.shape
    mask = torch.tensor([1, 1, 0, 0], dtype=torch.bool, device=x.device).repeat(N, K // 4)
    w_masked = w_dense.t().contiguous() * mask  # nn.Linear weight (N, K); 2:4 along K
    w_sp = to_sparse_semi_structured(w_masked)
    last: dict[str, torch.Tensor] = {}
    t = timer.time(lambda: last.__setitem__("y", torch.nn.functional.linear(x, w_sp)), reps)
    ok, err = check_close(last["y"][cols], x[cols].float() @ w_masked.float().t(), dtype)
    row.update(**t.fields(), search_us=t.us, max_abs_err=err, ok=ok)
    fresh = timer.interleaved(
        {"sp": lambda: torch.nn.functional.linear(x, w_sp), "dense": dense_fn}, reps
    )
    us, dense_us = fresh["sp"], fresh["dense"]
    row.update(
        us=us,
        dense_us=dense_us,
        ratio=dense_us / us,
        fraction_of_ideal=dense_us / us / 2.0,
        launch_bound=launch_bound(t.host_us, us),
    )


def bench_shape(
    ext: ModuleType | None,
    kernels: list[TWKernel],
    name: str,
    M: int,
    K: int,
    N: int,
    dtype: torch.dtype,
    timer: Timer,
    reps: int,
    failures: list[str],
    broken: set[str],
    device: str = "cuda",
) -> list[dict[str, Any]]:
    """Rows of one GEMM ``(M, K) x (K, N)``: dense, TW at each sparsity, 2:4. An error in a
    candidate, a sparsity or the 2:4 peer is recorded in its row (TW ones also in ``failures``).

    Raises:
        CudaContextLost: the device became unusable (nothing more can run in this process).
    """
    from cutlass_kernels.manifest import DType

    dts = str(dtype).removeprefix("torch.")
    base: dict[str, Any] = {"shape": name, "M": M, "K": K, "N": N, "dtype": dts}
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(M, K, device=device, dtype=dtype)
    w_dense = (torch.randn(K, N, device=device) / math.sqrt(K)).to(dtype)
    dense_fn = lambda: torch.matmul(x, w_dense)  # noqa: E731
    dense = timer.time(dense_fn, reps)
    rows: list[dict[str, Any]] = [
        {
            **base,
            "method": "dense_cublas",
            **dense.fields(),
            "tflops": 2.0 * M * K * N / dense.us / 1e6,
        }
    ]
    cols = torch.tensor(sample_columns(M), device=device)
    kdt = DType.F16 if dtype == torch.float16 else DType.BF16
    cands = [k for k in kernels if k.dtype is kdt and k.tile_g == 128 and k.name not in broken]
    for s in SPARSITIES:
        row: dict[str, Any] = {**base, "method": "tw_cutlass", "sparsity": s}
        try:
            if not cands:
                raise RuntimeError(f"every {kdt.value} G=128 instance failed verification")
            _bench_tw(row, ext, cands, x, cols, s, dtype, gen, timer, reps, dense_fn, device)
            if not row["ok"]:
                failures.append(
                    f"{name} {dts} {s}%: candidate errors {row['candidate_errors']}, "
                    f"max abs err {row['max_abs_err']:.3g} / op {row['op_max_abs_err']:.3g}"
                )
        except CudaContextLost:
            raise
        except Exception as e:  # recorded in the row
            if not cuda_alive(device):
                raise CudaContextLost(f"{name} {dts} {s}%: {err_text(e)}") from e
            row.update(ok=False, error=err_text(e))
            failures.append(f"{name} {dts} {s}%: {row['error']}")
        rows.append(row)
    row = {**base, "method": "2:4_semi_structured", "sparsity": 50, "ideal": 2.0}
    try:
        _bench_24(row, x, w_dense, cols, dtype, timer, reps, dense_fn)
    except Exception as e:  # the peer's errors are recorded, not failures
        if not cuda_alive(device):
            raise CudaContextLost(f"{name} {dts} 2:4: {err_text(e)}") from e
        row.update(error=err_text(e))
    rows.append(row)
    return rows
