"""GPU check of the CUTLASS TW kernels: build, verify, benchmark (run by ``gpu_check.sh``).

1. Builds the extension for the device's architecture (every manifest instance of it that the
   nvcc can build; the benchmarked dtypes' G=128 instances first in the nvcc queue).
2. Verifies every instance exactly against the CPU emulation of the same packed arguments
   (integer-valued inputs), and a random fp16/bf16 layer against the fp32 reference.
3. Benchmarks, side by side in one run, on the BERT-base/large GEMMs (M = 12800 tokens) and the
   DLRM-DCNv2 top MLP at batch 65,536, at 50/75/90% TW sparsity (split between columns and
   per-tile rows as s' = 100 - sqrt(10000 - 100 s), Guo et al. SC20), fp16 then bf16:
   dense cuBLAS (``torch.matmul``), TW kernel on K-major activations (the paper's setting;
   every G=128 instance timed, the fastest re-timed interleaved with dense and reported), TW
   through the row-major path (pack, kernel, unpack: the two transposes included), and 2:4
   semi-structured (``torch.sparse.to_sparse_semi_structured``) at 50% as a peer. Timing
   (``gpu_timing``): queued behind a GPU busy-wait (no launch-overhead bias; host µs/call and
   ``launch_bound`` recorded), L2 flushed before every timed call (``us``: cold median; ``hot_us``:
   back to back). Every timed output is checked at sampled batch columns (the last batch block
   included) against the fp32 product of the same condensed problem.

Robust to a broken instance: instances that fail to compile are left out of the build; each
(main loop, dtype) group is verified in child processes (a faulting kernel poisons only its
child's CUDA context) that load the same cached extension and report instance by instance, so
a fault or hang costs only the instance it hit (the rest go on in a fresh child); broken ones
are left out of the benchmark; an error in one candidate, sparsity or shape is recorded in its
row. The JSON is written before and after the build, after verification and after every shape;
``--budget-s`` caps the children's timeouts and stops starting new shapes in time.

Exit status: 0 all checks passed; 1 a build error, compile error or numeric mismatch (the rows
are still written); 3 no CUDA device or no CUDA torch; 4 no nvcc; 5 no timing row at all (every
shape skipped or failed).

    python -m benchmarks.cutlass_kernels.gpu_check [--out FILE] [--quick] [--dtype f16|bf16|both]
"""

from __future__ import annotations

import argparse
import glob
import math
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.cutlass_kernels.gpu_timing import Budget, Timer, Timing, gpu_warmup, launch_bound
from benchmarks.cutlass_kernels.gpu_verify import (  # noqa: F401  (split_sparsity: re-exported)
    CHILD_TIMEOUT_S,
    TOL,
    CudaContextLost,
    check_close,
    cuda_alive,
    err_text,
    split_sparsity,
    tw_layout,
    verify_child,
    verify_in_children,
)

if TYPE_CHECKING:
    from cutlass_kernels.manifest import TWKernel
    from cutlass_kernels.reference import TWPackedWeight

ROOT = Path(__file__).resolve().parents[2]

# (name, M, K, N). BERT: 12800 tokens (the paper's 12800x768x3072); DCNv2 top MLP input is the
# cross-net output, 13 dense + 26 tables x 128 = 128 + 26*128 = 3456 (MLPerf DLRM-DCNv2).
SHAPES = [
    ("bert_base_fc1", 12800, 768, 3072),
    ("bert_base_fc2", 12800, 3072, 768),
    ("bert_large_fc1", 12800, 1024, 4096),
    ("bert_large_fc2", 12800, 4096, 1024),
    ("dcnv2_top_0", 65536, 3456, 1024),
    ("dcnv2_top_1", 65536, 1024, 1024),
    ("dcnv2_top_2", 65536, 1024, 512),
    ("dcnv2_top_3", 65536, 512, 256),
]
SPARSITIES = (50, 75, 90)
DTYPES = {
    "f16": (torch.float16,),
    "bf16": (torch.bfloat16,),
    "both": (torch.float16, torch.bfloat16),
}
EXIT_NO_TIMING = 5
LAST_BLOCK = 256  # widest batch tile of any instance: the sampled columns cover the last one


def _import_cutlass_library() -> None:
    """Use the repo venv's nvidia-cutlass when this interpreter (a CUDA torch outside the
    venv) lacks it; appended last, so this interpreter's torch still wins."""
    try:
        import cutlass_library  # noqa: F401
    except ImportError:
        for site in sorted(glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages"))):
            sys.path.append(site)
        try:
            import cutlass_library  # noqa: F401
        except ImportError as e:
            raise SystemExit(
                "gpu_check: nvidia-cutlass (module cutlass_library) is not installed for this "
                f"python ({sys.executable}): pip install nvidia-cutlass==4.2.0.0, or put its wheel "
                "in .whl/ and run gpu_check.sh (see its header)"
            ) from e


def build_order(
    kernels: tuple[TWKernel, ...] | list[TWKernel], dtypes: tuple[torch.dtype, ...]
) -> list[TWKernel]:
    """The instances in the order to compile them: the benchmarked dtypes first (in ``dtypes``
    order), G=128 (the benchmarked width) before G=64, then manifest order. ``nvcc`` jobs start
    in this order, so the instances the benchmark needs never wait behind the others."""
    from cutlass_kernels.manifest import DType

    rank = {DType.F16 if d == torch.float16 else DType.BF16: i for i, d in enumerate(dtypes)}
    pos = {k.name: i for i, k in enumerate(kernels)}
    return sorted(
        kernels, key=lambda k: (rank.get(k.dtype, len(rank)), k.tile_g != 128, pos[k.name])
    )


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
    x: torch.Tensor, pw: TWPackedWeight, kernel: TWKernel, ext: ModuleType
) -> torch.Tensor:
    """Row-major ``(M, K) → (M, N)`` through the kernel (pack, run, unpack), on ``ext``
    (``build.tw_linear_cuda`` would load the default extension, not this run's)."""
    from cutlass_kernels import build
    from cutlass_kernels.reference import pack_launch, unpack_output

    launch = pack_launch(x, pw)
    build.tw_gemm_kmajor(launch, kernel=kernel, ext=ext)
    return unpack_output(launch)


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
    from cutlass_kernels import build
    from cutlass_kernels.reference import pack_launch, pack_weight
    from tilesparse.format import reference_matmul

    M, K = x.shape
    N = row["N"]
    layout = tw_layout(K, N, 128, s, gen, torch.float32)
    layout.values.copy_(layout.values.to(dtype))  # the very problem the kernel gets
    ref = reference_matmul(x[cols].float(), layout)  # (len(cols), N) fp32
    pw = pack_weight(layout, dtype=dtype, device=device)
    launch = pack_launch(x, pw)  # xt (K, M'), yt (N, M')
    density = layout.density
    row.update(density=density, ideal=1.0 / density)

    def kmajor_output_ok(_k=None) -> tuple[bool, float]:  # yt holds the last timed call's output
        return check_close(launch.yt[:, cols].t(), ref, dtype)

    def time_one(k):  # yt zeroed first: pruned rows stay as a previous candidate left them
        launch.yt.zero_()
        return timer.time(lambda: build.tw_gemm_kmajor(launch, kernel=k, ext=ext), reps)

    timings, max_err, errors = time_candidates(
        cands, time_one, kmajor_output_ok, lambda: cuda_alive(device)
    )
    row.update(
        candidates_us={n: t.us for n, t in timings.items()},
        candidate_errors=errors,
        candidate_max_abs_err=max_err,
    )
    if not timings:
        raise RuntimeError(f"every candidate failed: {errors}")
    best = min(timings, key=lambda n: timings[n].us)
    kernel = next(k for k in cands if k.name == best)
    try:  # what tw_linear_cuda would pick without tuning (None: a broken or unbuilt one)
        picked = build.select_for(launch, ext)
    except ValueError:
        picked = None
    row.update(
        kernel=best,
        selected_kernel=picked and picked.name,
        selected_us=timings[picked.name].us if picked and picked.name in timings else None,
        **timings[best].fields(),
        search_us=timings[best].us,
    )
    # The winner again, in a fresh measurement alternating with dense: the reported figures.
    tw_fn = lambda: build.tw_gemm_kmajor(launch, kernel=kernel, ext=ext)  # noqa: E731
    launch.yt.zero_()
    fresh = timer.interleaved({"tw": tw_fn, "dense": dense_fn}, reps)
    ok, err = kmajor_output_ok()
    us, dense_us = fresh["tw"], fresh["dense"]
    row.update(
        us=us,
        dense_us=dense_us,
        ratio=dense_us / us,
        fraction_of_ideal=dense_us / us * density,
        launch_bound=launch_bound(row["host_us"], us),
        max_abs_err=err,
        ok=ok and not errors,
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


def _print_row(r: dict[str, Any]) -> None:
    tag = f"{r['shape']:>15} {r.get('dtype', ''):>8} {r.get('method', ''):>20} {r.get('sparsity', ''):>3}"
    fig = (
        f"{r['us']:9.1f} us (hot {r.get('hot_us', float('nan')):.1f})"
        if "us" in r
        else r.get("error", "")
    )
    extra = (
        f" ratio {r['ratio']:.2f} (op {r.get('ratio_op', float('nan')):.2f}) frac "
        f"{r['fraction_of_ideal']:.2f}{' LAUNCH-BOUND' if r.get('launch_bound') else ''}"
        if "ratio" in r
        else ""
    )
    print(f"{tag} {fig}{extra}", flush=True)


def run_shapes(
    jobs: list[tuple[str, int, int, int, torch.dtype]],
    bench_one: Callable[..., list[dict[str, Any]]],
    budget: Budget,
    rows: list[dict[str, Any]],
    failures: list[str],
    skipped: list[str],
    save: Callable[[], object],
) -> None:
    """``bench_one(name, M, K, N, dtype)`` for each job while the budget lasts, appending to
    ``rows`` and saving after each; a job that raises leaves an error row (and a failure), a
    lost CUDA context ends the run (the rest are skipped)."""
    for i, (name, M, K, N, dtype) in enumerate(jobs):
        dts = str(dtype).removeprefix("torch.")
        if budget.over():
            skipped.append(f"{name}/{dts}")
            print(f"{name} {dts}: skipped (over the {budget.budget_s:.0f} s budget)", flush=True)
            continue
        base = {"shape": name, "M": M, "K": K, "N": N, "dtype": dts, "method": "shape", "ok": False}
        try:
            new = bench_one(name, M, K, N, dtype)
        except CudaContextLost as e:
            rows.append({**base, "error": f"CUDA context lost: {e}"})
            failures.append(
                f"{name} {dts}: CUDA context lost ({e}); the rest of the run is skipped"
            )
            skipped.extend(
                f"{n}/{str(d).removeprefix('torch.')}" for n, _, _, _, d in jobs[i + 1 :]
            )
            save()
            return
        except Exception as e:  # recorded in the row
            new = [{**base, "error": err_text(e)}]
            failures.append(f"{name} {dts}: {err_text(e)}")
        rows.extend(new)
        for r in new:
            _print_row(r)
        save()


def exit_status(rows: list[dict[str, Any]], failures: list[str]) -> int:
    """5 when no row holds a timing, else 1 on any failure, else 0."""
    if not any("us" in r for r in rows):
        return EXIT_NO_TIMING
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cutlass_gpu_check.json"))
    p.add_argument("--quick", action="store_true", help="BERT-base shapes only, fewer reps")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="both",
        help="benchmark dtype(s); both: every fp16 shape, then every bf16 one",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=440.0,
        help="seconds from start after which no new shape or verification child starts "
        "(child timeouts are capped to what is left; the JSON is written after every shape)",
    )
    p.add_argument("--verify-kernels", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--verify-out", help=argparse.SUPPRESS)
    p.add_argument("--built", help=argparse.SUPPRESS)  # child mode: the parent's built instances
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)

    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device visible to torch {torch.__version__} (torch.version.cuda="
            f"{torch.version.cuda}). Run it with a CUDA build of torch on a machine with an "
            "NVIDIA GPU (sm_80 or newer).",
            file=sys.stderr,
        )
        return 3
    _import_cutlass_library()
    sys.path.insert(0, str(ROOT))
    if args.verify_kernels:
        return verify_child(args)
    import logging

    from benchmarks.meta import write_json
    from cutlass_kernels import build
    from cutlass_kernels.manifest import manifest

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    nvcc = build.find_nvcc()
    if nvcc is None:
        print(
            "gpu_check: nvcc not found (set CUDA_HOME or PATH); cannot build the kernels",
            file=sys.stderr,
        )
        return 4
    dtypes = DTYPES[args.dtype]
    arch = build.device_arch()
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    failures: list[str] = []
    skipped: list[str] = []
    meta: dict[str, Any] = {
        "arch": arch.value,
        "device": torch.cuda.get_device_name(0),
        "budget_s": args.budget_s,
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "stage": "building",
    }

    def save() -> Path:
        return write_json(
            args.out,
            rows,
            checks=checks,
            failures=failures,
            skipped_shapes=skipped,
            elapsed_s=budget.elapsed(),
            **meta,
        )

    save()
    t0 = time.perf_counter()
    try:
        order = build_order(manifest(arch, build.nvcc_version(nvcc)), dtypes)
        ext = build.load_extension(arch, order, skip_failed=True)
    except Exception as e:  # recorded in the JSON
        failures.append(f"build failed: {err_text(e)}")
        meta.update(stage="build failed", build_error=str(e)[-4000:])
        print(f"gpu_check: build failed ({time.perf_counter() - t0:.0f} s): {e}", file=sys.stderr)
        save()
        return 1
    meta["build_seconds"] = build_s = time.perf_counter() - t0
    failures += [f"{n}: compile error (left out of the build)" for n in ext.failed]
    have = set(ext.instances())
    kernels = [
        k for k in order if k.name in have
    ]  # in build order: --built gives the child the same ext
    meta.update(stage="verifying", compile_failures={n: e[-2000:] for n, e in ext.failed.items()})
    print(
        f"built {len(kernels)} {arch.value} instances in {build_s:.1f} s; "
        f"{len(ext.failed)} failed to compile: {sorted(ext.failed)}",
        flush=True,
    )
    save()

    t0 = time.perf_counter()
    checks += verify_in_children(
        kernels, failures, CHILD_TIMEOUT_S, built=[k.name for k in kernels], budget=budget
    )
    broken = {c["kernel"] for c in checks if not c["ok"]}
    meta.update(stage="benchmarking", verify_seconds=time.perf_counter() - t0)
    print(
        f"verified {len(checks)} checks in {meta['verify_seconds']:.0f} s, {len(failures)} failures; "
        f"broken: {sorted(broken)}",
        flush=True,
    )
    save()

    shapes = SHAPES[:2] if args.quick else SHAPES
    reps = 5 if args.quick else args.reps
    jobs = [(name, M, K, N, dt) for dt in dtypes for name, M, K, N in shapes]
    try:
        meta["warmup_ms"] = gpu_warmup()
        timer = Timer("cuda")
        meta["sleep_cycles_per_us"] = timer.cycles_per_us
    except Exception as e:  # recorded in the JSON
        failures.append(f"GPU warm-up failed: {err_text(e)}")
        skipped += [f"{n}/{str(d).removeprefix('torch.')}" for n, _, _, _, d in jobs]
        jobs = []

    def bench_one(name: str, M: int, K: int, N: int, dtype: torch.dtype) -> list[dict[str, Any]]:
        try:
            return bench_shape(ext, kernels, name, M, K, N, dtype, timer, reps, failures, broken)
        except Exception as e:
            if not isinstance(e, CudaContextLost) and not cuda_alive():
                raise CudaContextLost(err_text(e)) from e
            raise
        finally:
            torch.cuda.empty_cache()

    run_shapes(jobs, bench_one, budget, rows, failures, skipped, save)
    meta["stage"] = "done"
    out = save()
    print(f"wrote {out} ({budget.elapsed():.0f} s)")
    status = exit_status(rows, failures)
    if status == EXIT_NO_TIMING:
        print("gpu_check: no timing row at all (every shape skipped or failed)", file=sys.stderr)
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
