"""GPU check of the CUTLASS TW kernels: build, verify, benchmark (run by ``gpu_check.sh``).

1. Builds the extension for the device's architecture (every manifest instance of it).
2. Verifies every instance exactly against the CPU emulation of the same packed arguments
   (integer-valued inputs), and random fp16/bf16 layers against the fp32 reference.
3. Benchmarks, side by side in one run, on the BERT-base/large GEMMs (M = 12800 tokens) and the
   DLRM-DCNv2 top MLP at batch 65,536, at 50/75/90% TW sparsity (split between columns and
   per-tile rows as s' = 100 - sqrt(10000 - 100 s), Guo et al. SC20):
   dense cuBLAS (``torch.matmul``), TW kernel on K-major activations (the paper's setting), TW
   through the row-major op (``tw_linear_cuda``, with the two transposes), and 2:4
   semi-structured (``torch.sparse.to_sparse_semi_structured``) at 50% as a peer.
   Every benchmarked TW layer is also checked against dense ``torch.matmul`` on its masked weight.

Robust to a broken instance: instances that fail to compile are left out of the build, each
main loop's instances are verified in a child process (a faulting kernel poisons only that
child's CUDA context), broken ones are left out of the benchmark, and the JSON is rewritten
after every shape (``--budget-s`` stops starting new shapes in time).

Exit status: 0 all checks passed; 1 a compile error or numeric mismatch (the rows are still
written); 3 no CUDA device or no CUDA torch; 4 no nvcc.

    python -m benchmarks.cutlass_kernels.gpu_check [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import glob
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

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
TOL = {torch.float16: {"rtol": 1e-2, "atol": 1e-2}, torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}


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
                "in .whl/ and run gpu_check.sh (see its header)") from e


def split_sparsity(s: float) -> float:
    """Per-step sparsity s' (%) so that columns then rows give s overall (Guo et al.)."""
    return 100.0 - math.sqrt(10000.0 - 100.0 * s)


def tw_layout(K: int, N: int, G: int, sparsity: float, gen: torch.Generator, dtype: torch.dtype):
    """A random exactly-tiled TW layer: (1-s') of the columns, each tile of G keeping (1-s')
    of the rows; values ~ N(0, 1/K). Built directly in the condensed format (fast)."""
    from tilesparse.format import TWLayout

    keep = 1.0 - split_sparsity(sparsity) / 100.0
    nk = max(1, round(N * keep))
    cols = torch.randperm(N, generator=gen)[:nk].sort().values
    rk = max(1, round(K * keep))
    col_idx, tile_ptr, row_idx, row_ptr, val_ptr = cols, [0], [], [0], [0]
    for start in range(0, nk, G):
        g = min(G, nk - start)
        tile_ptr.append(start + g)
        rows = torch.randperm(K, generator=gen)[:rk].sort().values
        row_idx.append(rows)
        row_ptr.append(row_ptr[-1] + rk)
        val_ptr.append(val_ptr[-1] + rk * g)
    i64 = torch.int64
    values = (torch.randn(val_ptr[-1], generator=gen) / math.sqrt(K)).to(dtype)
    return TWLayout(K, N, G, col_idx.to(i64), torch.tensor(tile_ptr, dtype=i64),
                    torch.cat(row_idx).to(i64), torch.tensor(row_ptr, dtype=i64), values,
                    torch.tensor(val_ptr, dtype=i64))


def cuda_time_us(fn, reps: int, warmup: int = 3) -> float:
    """Mean µs per call over ``reps`` calls between two CUDA events (after ``warmup``)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps


def verify_instances(ext, kernels, failures: list[str]) -> list[dict[str, Any]]:
    """Each instance vs the emulation (exact) and vs the fp32 reference (tolerance)."""
    from cutlass_kernels import build
    from cutlass_kernels.manifest import DType
    from cutlass_kernels.reference import emulate, pack_launch, pack_weight
    from tilesparse.format import reference_matmul

    rows = []
    gen = torch.Generator().manual_seed(0)
    for kernel in kernels:
        dt = torch.float16 if kernel.dtype is DType.F16 else torch.bfloat16
        G = kernel.tile_g
        # Exact: values in {-1, 0, 1}; K, N not multiples of G; M=1 and a ragged batch.
        for M, K, N in ((1, 301, 2 * G + 5), (333, 517, 3 * G - 3)):
            layout = tw_layout(K, N, G, 75, gen, torch.float32)
            layout.values.copy_(torch.randint(-1, 2, layout.values.shape, generator=gen).float())
            x = torch.randint(-1, 2, (M, K), generator=gen).to(dt)
            bias = torch.randint(-2, 3, (N,), generator=gen).to(dt)
            want = emulate(pack_launch(x, pack_weight(layout, dtype=dt), bias))
            gpu = pack_launch(x.cuda(), pack_weight(layout, dtype=dt, device="cuda"), bias.cuda())
            got = build.tw_gemm_kmajor(gpu, kernel=kernel, ext=ext).cpu()
            ok = torch.equal(got[:, :M], want[:, :M])
            if not ok:
                bad = int((got[:, :M] != want[:, :M]).sum())
                failures.append(f"{kernel.name} M={M} K={K} N={N}: {bad} elements differ from the emulation")
            rows.append({"check": "exact_vs_emulation", "kernel": kernel.name, "M": M, "K": K, "N": N, "ok": ok})
            print(f"  {kernel.name} exact M={M} K={K} N={N}: {'ok' if ok else 'MISMATCH'}", flush=True)
        # Tolerance: random normal data vs the fp32 reference.
        layout = tw_layout(1000, 4 * G + 7, G, 50, gen, torch.float32)
        x = torch.randn(777, 1000, generator=gen)
        want = reference_matmul(x, layout)
        launch = pack_launch(x.to(dt).cuda(), pack_weight(layout, dtype=dt, device="cuda"))
        got = build.tw_gemm_kmajor(launch, kernel=kernel, ext=ext)[:, :777].t().float().cpu()
        err = float((got - want).abs().max())
        try:
            torch.testing.assert_close(got, want, **TOL[dt])
            ok = True
        except AssertionError as e:
            ok = False
            failures.append(f"{kernel.name} random layer: {str(e).splitlines()[0]} (max err {err:.3g})")
        rows.append({"check": "close_to_reference", "kernel": kernel.name, "max_abs_err": err, "ok": ok})
    return rows


def bench_shape(ext, kernels, name, M, K, N, dtype, reps, failures, broken) -> list[dict[str, Any]]:
    from cutlass_kernels import build
    from cutlass_kernels.manifest import DType
    from cutlass_kernels.reference import pack_launch, pack_weight

    dev = "cuda"
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(M, K, device=dev, dtype=dtype)
    w_dense = (torch.randn(K, N, device=dev) / math.sqrt(K)).to(dtype)
    dense_us = cuda_time_us(lambda: torch.matmul(x, w_dense), reps)
    flops = 2.0 * M * K * N
    rows: list[dict[str, Any]] = [{
        "shape": name, "M": M, "K": K, "N": N, "dtype": str(dtype).removeprefix("torch."),
        "method": "dense_cublas", "us": dense_us, "tflops": flops / dense_us / 1e6,
    }]
    kdt = DType.F16 if dtype == torch.float16 else DType.BF16
    cands = [k for k in kernels if k.dtype is kdt and k.tile_g == 128 and k.name not in broken]
    if not cands:
        failures.append(f"{name}: every {kdt.value} G=128 instance failed verification; no TW timing")
        return rows
    for s in SPARSITIES:
        layout = tw_layout(K, N, 128, s, gen, torch.float32)
        density = layout.density
        pw = pack_weight(layout, dtype=dtype, device=dev)
        launch = pack_launch(x, pw)
        per_kernel = {}
        for kernel in cands:  # every instance: the fastest is the figure, all are recorded
            per_kernel[kernel.name] = cuda_time_us(
                lambda k=kernel, a=launch: build.tw_gemm_kmajor(a, kernel=k, ext=ext), reps)
        kernel = min(cands, key=lambda k: per_kernel[k.name])
        tw_us = per_kernel[kernel.name]
        try:  # what tw_linear_cuda would pick without tuning (None: a broken or unbuilt one)
            picked = build.select_for(launch, ext)
        except ValueError:
            picked = None
        op_us = cuda_time_us(lambda k=kernel, lay=layout: build.tw_linear_cuda(x, lay, kernel=k), reps)
        # Correctness of exactly this layer against dense cuBLAS on the masked weight.
        y = build.tw_linear_cuda(x[:4096], layout, kernel=kernel).float()
        w_masked = layout.to_dense().to(device=dev, dtype=dtype)
        ref = torch.matmul(x[:4096], w_masked).float()
        ok = True
        try:
            torch.testing.assert_close(y, ref, **TOL[dtype])
        except AssertionError as e:
            ok = False
            failures.append(f"{name} {s}%: TW vs cuBLAS on the masked weight: {str(e).splitlines()[0]}")
        ideal = 1.0 / density
        rows.append({
            "shape": name, "M": M, "K": K, "N": N, "dtype": str(dtype).removeprefix("torch."),
            "method": "tw_cutlass", "sparsity": s, "density": density, "kernel": kernel.name,
            "us": tw_us, "op_us": op_us, "dense_us": dense_us,
            "ratio": dense_us / tw_us, "ratio_op": dense_us / op_us,
            "ideal": ideal, "fraction_of_ideal": dense_us / tw_us / ideal,
            "effective_tflops": flops * density / tw_us / 1e6, "ok": ok,
            "selected_kernel": picked and picked.name,
            "selected_us": per_kernel.get(picked.name) if picked else None,
            "candidates_us": per_kernel,
        })
    # 2:4 semi-structured at 50% (the hardware-supported peer).
    row: dict[str, Any] = {"shape": name, "M": M, "K": K, "N": N, "dtype": str(dtype).removeprefix("torch."),
                           "method": "2:4_semi_structured", "sparsity": 50, "ideal": 2.0, "dense_us": dense_us}
    try:
        from torch.sparse import to_sparse_semi_structured

        w_nk = w_dense.t().contiguous()  # nn.Linear weight (N, K); 2:4 along K
        mask = torch.tensor([1, 1, 0, 0], dtype=torch.bool, device=dev).repeat(N, K // 4)
        w_sp = to_sparse_semi_structured(w_nk * mask)
        sp_us = cuda_time_us(lambda: torch.nn.functional.linear(x, w_sp), reps)
        row.update(us=sp_us, ratio=dense_us / sp_us, fraction_of_ideal=dense_us / sp_us / 2.0)
    except (RuntimeError, NotImplementedError, ValueError) as e:  # recorded in the row, not hidden
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    rows.append(row)
    return rows


def _verify_child(args) -> int:
    """Child mode (``--verify-kernels``): verify those instances, write the rows as JSON."""
    import json

    from cutlass_kernels import build
    from cutlass_kernels.manifest import manifest

    arch = build.device_arch()
    ext = build.load_extension(arch, skip_failed=True)
    want = set(args.verify_kernels.split(","))
    kernels = [k for k in manifest(arch) if k.name in want]
    failures: list[str] = []
    rows = verify_instances(ext, kernels, failures)
    torch.cuda.synchronize()  # a kernel fault surfaces here, before the rows are written
    Path(args.verify_out).write_text(json.dumps({"checks": rows, "failures": failures}))
    return 0


CHILD_CMD = [sys.executable, "-m", "benchmarks.cutlass_kernels.gpu_check"]


def verify_in_children(
    kernels, failures: list[str], timeout_s: float, child_cmd: list[str] | None = None
) -> list[dict[str, Any]]:
    """Verify each main loop's instances in a child process of its own: a kernel that faults
    (illegal address, trap) poisons only that child's CUDA context; its instances are then
    marked broken and the benchmark goes on with the others.

    ``child_cmd`` (default: this module) gets ``--verify-kernels a,b --verify-out FILE`` and
    must write ``{"checks": [...], "failures": [...]}`` there and exit 0."""
    import json
    import subprocess
    import tempfile

    checks: list[dict[str, Any]] = []
    families: dict[str, list] = {}
    for k in kernels:
        families.setdefault(k.mainloop.value, []).append(k)
    for family, ks in families.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "verify.json"
            cmd = [*(child_cmd or CHILD_CMD),
                   "--verify-kernels", ",".join(k.name for k in ks), "--verify-out", str(out)]
            print(f"verifying {len(ks)} {family} instances (child process)", flush=True)
            try:
                proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True)
                print(proc.stdout, end="", flush=True)
                why = None if proc.returncode == 0 and out.is_file() else (
                    f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
            except subprocess.TimeoutExpired:
                why = f"timed out after {timeout_s:.0f} s"
            if why is None:
                got = json.loads(out.read_text())
                checks += got["checks"]
                failures += got["failures"]
            else:
                failures.append(f"{family}: verification child failed ({why}); its instances are marked broken")
                checks += [{"check": "child_process", "kernel": k.name, "ok": False, "error": why[:500]} for k in ks]
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cutlass_gpu_check.json"))
    p.add_argument("--quick", action="store_true", help="BERT-base shapes only, fewer reps")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", choices=["f16", "bf16"], default="f16", help="benchmark dtype")
    p.add_argument("--budget-s", type=float, default=440.0,
                   help="stop starting new shapes after this many seconds (the JSON is written after every shape)")
    p.add_argument("--verify-kernels", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--verify-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    t_start = time.perf_counter()

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__} (torch.version.cuda="
              f"{torch.version.cuda}). Run it with a CUDA build of torch on a machine with an "
              "NVIDIA GPU (sm_80 or newer).", file=sys.stderr)
        return 3
    _import_cutlass_library()
    sys.path.insert(0, str(ROOT))
    if args.verify_kernels:
        return _verify_child(args)
    import logging

    from benchmarks.meta import write_json
    from cutlass_kernels import build
    from cutlass_kernels.manifest import manifest

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if build.find_nvcc() is None:
        print("gpu_check: nvcc not found (set CUDA_HOME or PATH); cannot build the kernels",
              file=sys.stderr)
        return 4
    arch = build.device_arch()
    t0 = time.perf_counter()
    ext = build.load_extension(arch, skip_failed=True)
    build_s = time.perf_counter() - t0
    failures: list[str] = [f"{n}: compile error (left out of the build)" for n in ext.failed]
    kernels = [k for k in manifest(arch) if k.name in set(ext.instances())]
    print(f"built {len(kernels)} {arch.value} instances in {build_s:.1f} s; "
          f"{len(ext.failed)} failed to compile: {sorted(ext.failed)}", flush=True)

    checks = verify_in_children(kernels, failures, timeout_s=120.0)
    broken = {c["kernel"] for c in checks if not c["ok"]}
    print(f"verified {len(checks)} checks, {len(failures)} failures; broken: {sorted(broken)}", flush=True)

    dtype = torch.float16 if args.dtype == "f16" else torch.bfloat16
    shapes = SHAPES[:2] if args.quick else SHAPES
    reps = 5 if args.quick else args.reps
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    meta = {"arch": arch.value, "device": torch.cuda.get_device_name(0), "build_seconds": build_s,
            "compile_failures": {n: e[-2000:] for n, e in ext.failed.items()}}

    def save():
        return write_json(args.out, rows, checks=checks, failures=failures, skipped_shapes=skipped, **meta)

    save()
    for name, M, K, N in shapes:
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(name)
            print(f"{name}: skipped (over the {args.budget_s:.0f} s budget)", flush=True)
            continue
        new = bench_shape(ext, kernels, name, M, K, N, dtype, reps, failures, broken)
        rows += new
        for r in new:
            tag = f"{r['method']:>20} {r.get('sparsity', ''):>3}"
            fig = f"{r['us']:9.1f} us" if "us" in r else r.get("error", "")
            extra = f" ratio {r['ratio']:.2f} (op {r.get('ratio_op', float('nan')):.2f}) frac {r['fraction_of_ideal']:.2f}" if "ratio" in r else ""
            print(f"{name:>15} {tag} {fig}{extra}", flush=True)
        torch.cuda.empty_cache()
        save()
    out = save()
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
