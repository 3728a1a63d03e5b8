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

The rows of one shape come from :mod:`benchmarks.cutlass_kernels.gpu_bench`, the verification
from :mod:`benchmarks.cutlass_kernels.gpu_verify`, the timing from
:mod:`benchmarks.cutlass_kernels.gpu_timing`.

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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.cutlass_kernels.gpu_bench import bench_shape
from benchmarks.cutlass_kernels.gpu_timing import Budget, Timer, gpu_warmup
from benchmarks.cutlass_kernels.gpu_verify import (
    CHILD_TIMEOUT_S,
    CudaContextLost,
    cuda_alive,
    err_text,
    verify_child,
    verify_in_children,
)

if TYPE_CHECKING:
    from cutlass_kernels.manifest import Arch, TWKernel

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
DTYPES = {
    "f16": (torch.float16,),
    "bf16": (torch.bfloat16,),
    "both": (torch.float16, torch.bfloat16),
}
EXIT_NO_TIMING = 5


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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    return p.parse_args(argv)


@dataclass
class _Run:
    """What one check run records: the JSON's rows, checks, failures, skipped shapes and
    metadata, written by :meth:`save` after every stage."""

    out: str
    budget: Budget
    meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def save(self) -> Path:
        from benchmarks.meta import write_json

        return write_json(
            self.out,
            self.rows,
            checks=self.checks,
            failures=self.failures,
            skipped_shapes=self.skipped,
            elapsed_s=self.budget.elapsed(),
            **self.meta,
        )


def _build(
    run: _Run, arch: Arch, nvcc: str, dtypes: tuple[torch.dtype, ...]
) -> tuple[ModuleType, list[TWKernel]] | None:
    """The extension of every instance of ``arch`` the nvcc builds (benchmarked dtypes first)
    and its instances in build order (``--built`` gives a verification child the same
    extension); None when the build failed (recorded)."""
    from cutlass_kernels import build, toolchain
    from cutlass_kernels.manifest import manifest

    t0 = time.perf_counter()
    try:
        order = build_order(manifest(arch, toolchain.nvcc_version(nvcc)), dtypes)
        ext = build.load_extension(arch, order, skip_failed=True)
    except Exception as e:  # recorded in the JSON
        run.failures.append(f"build failed: {err_text(e)}")
        run.meta.update(stage="build failed", build_error=str(e)[-4000:])
        print(f"gpu_check: build failed ({time.perf_counter() - t0:.0f} s): {e}", file=sys.stderr)
        run.save()
        return None
    run.meta["build_seconds"] = build_s = time.perf_counter() - t0
    run.failures += [f"{n}: compile error (left out of the build)" for n in ext.failed]
    have = set(ext.instances())
    kernels = [k for k in order if k.name in have]
    run.meta.update(
        stage="verifying", compile_failures={n: e[-2000:] for n, e in ext.failed.items()}
    )
    print(
        f"built {len(kernels)} {arch.value} instances in {build_s:.1f} s; "
        f"{len(ext.failed)} failed to compile: {sorted(ext.failed)}",
        flush=True,
    )
    run.save()
    return ext, kernels


def _verify(run: _Run, kernels: list[TWKernel]) -> set[str]:
    """Verify the built instances in child processes; the names of the broken ones."""
    t0 = time.perf_counter()
    run.checks += verify_in_children(
        kernels, run.failures, CHILD_TIMEOUT_S, built=[k.name for k in kernels], budget=run.budget
    )
    broken = {c["kernel"] for c in run.checks if not c["ok"]}
    run.meta.update(stage="benchmarking", verify_seconds=time.perf_counter() - t0)
    print(
        f"verified {len(run.checks)} checks in {run.meta['verify_seconds']:.0f} s, "
        f"{len(run.failures)} failures; broken: {sorted(broken)}",
        flush=True,
    )
    run.save()
    return broken


def _benchmark(
    run: _Run,
    args: argparse.Namespace,
    ext: ModuleType,
    kernels: list[TWKernel],
    broken: set[str],
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """Every shape × dtype while the budget lasts (after a GPU warm-up)."""
    shapes = SHAPES[:2] if args.quick else SHAPES
    reps = 5 if args.quick else args.reps
    jobs = [(name, M, K, N, dt) for dt in dtypes for name, M, K, N in shapes]
    try:
        run.meta["warmup_ms"] = gpu_warmup()
        timer = Timer("cuda")
        run.meta["sleep_cycles_per_us"] = timer.cycles_per_us
    except Exception as e:  # recorded in the JSON
        run.failures.append(f"GPU warm-up failed: {err_text(e)}")
        run.skipped += [f"{n}/{str(d).removeprefix('torch.')}" for n, _, _, _, d in jobs]
        jobs = []

    def bench_one(name: str, M: int, K: int, N: int, dtype: torch.dtype) -> list[dict[str, Any]]:
        try:
            return bench_shape(
                ext, kernels, name, M, K, N, dtype, timer, reps, run.failures, broken
            )
        except Exception as e:
            if not isinstance(e, CudaContextLost) and not cuda_alive():
                raise CudaContextLost(err_text(e)) from e
            raise
        finally:
            torch.cuda.empty_cache()

    run_shapes(jobs, bench_one, run.budget, run.rows, run.failures, run.skipped, run.save)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
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

    from cutlass_kernels import toolchain

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        print(
            "gpu_check: nvcc not found (set CUDA_HOME or PATH); cannot build the kernels",
            file=sys.stderr,
        )
        return 4
    dtypes = DTYPES[args.dtype]
    arch = toolchain.device_arch()
    meta: dict[str, Any] = {
        "arch": arch.value,
        "device": torch.cuda.get_device_name(0),
        "budget_s": args.budget_s,
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "stage": "building",
    }
    run = _Run(args.out, budget, meta)
    run.save()
    built = _build(run, arch, nvcc, dtypes)
    if built is None:
        return 1
    ext, kernels = built
    broken = _verify(run, kernels)
    _benchmark(run, args, ext, kernels, broken, dtypes)
    meta["stage"] = "done"
    out = run.save()
    print(f"wrote {out} ({budget.elapsed():.0f} s)")
    status = exit_status(run.rows, run.failures)
    if status == EXIT_NO_TIMING:
        print("gpu_check: no timing row at all (every shape skipped or failed)", file=sys.stderr)
    if run.failures:
        print("FAILURES:\n  " + "\n  ".join(run.failures), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
