"""Tile-wise (TW) sparse CPU GEMM against dense ``torch.matmul`` and torch's sparse CSR matmul,
side by side in one run, JSON out and a markdown table on stdout.

    python -m benchmarks.tilesparse.bench_gemm                      # everything (~10-15 min, 2 cores)
    python -m benchmarks.tilesparse.bench_gemm --only bert --dtypes fp32 --threads 2
    python -m benchmarks.tilesparse.bench_gemm --quick --out /tmp/gemm.json   # seconds

Every row is one ``Y (M, N) = X (M, K) · W (K, N)``, no bias in any contender:

- ``dense``: ``torch.matmul(x, w)``, ``w`` dense contiguous ``(K, N)``, same dtype and threads;
- ``tw``: ``tilesparse.ops.tw_linear(x, layout, None, "cpu")``, ``layout`` condensed from ``w``
  under ``tw_mask(scores, s, G)`` (the compiled CPU kernel; the run stops if it is missing);
- ``auto``: ``tilesparse.ops.tw_linear(x, layout, None, "auto")``, the same layout: the TW
  kernel or a dense GEMM on the layer's cached dense weight, whichever the machine's measured
  crossover chooses (``tilesparse.kernels.auto``; its first call, a warm-up, measures when the
  machine's table does not hold the signature yet). ``auto_vs_dense = dense_ms / auto_ms``
  (never below 0.95 is the target), ``auto_route`` what it ran;
- ``csr``: ``torch.sparse.mm(w_csrᵀ, xᵀ)`` or ``x @ w_csr``, whichever a probe on ``M/8`` rows
  finds faster, on ``w`` under the unstructured ``ew_mask(scores, s)``: the same sparsity with
  no structure. It is ``null`` with a reason where torch cannot run it (bf16 on CPU today) or
  where one call would take more than ``--csr-max-seconds``.

``scores`` are ``torch.rand`` from a fixed seed. ``speedup = dense_ms / tw_ms``; the ideal is
``1 / (1 − s)`` (only the kept weights' FLOPs); ``fraction_of_ideal = speedup / ideal``.
``correct`` compares ``tw`` with ``tilesparse.reference_matmul`` elementwise under
``|y − ref| <= atol + rtol·|ref|`` (the ``tw_gemm`` bounds of tests/tolerances.py, atol scaled by
``sqrt(K / 300)``). Memory: the condensed layout's bytes over the dense weight's
(``tilesparse.layer_memory``), and the CSR matrix's for comparison.

Shape groups (``--only``): ``square`` 4096³; ``bert`` the BERT-base FFN at 4096 tokens
(768→3072, 3072→768); ``dlrm`` the DLRM-DCNv2 top MLP at batch 4096 (widths read from
``embark``: 3456→1024→1024→512→256; the 256→1 logit layer is left out); ``dlrm_cross`` the
low-rank cross layers (3456→512, 512→3456; not in the default set).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.meta import RESULTS_DIR, write_json
from benchmarks.tilesparse.timing import (
    add_threads_arg,
    cpu_features,
    default_dtypes,
    free_memory,
    interleaved,
    set_threads,
    time_once,
)
from embark.models.workloads import get_workload
from tilesparse.format import TWLayout, condense, reference_matmul
from tilesparse.kernels import cpu_kernel_available
from tilesparse.memory import layer_memory
from tilesparse.ops import auto_decision, tw_linear
from tilesparse.patterns import ew_mask, tw_mask

log = logging.getLogger("bench_gemm")

GROUPS = ("square", "bert", "dlrm", "dlrm_cross")
DEFAULT_GROUPS = ("square", "bert", "dlrm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SPARSITIES = (0.5, 0.75, 0.9)
TILES = (128, 64)
TOKENS = 4096  # M of every full-size row: BERT tokens per batch, DLRM batch
# Per-dtype tolerance of the kernel against reference_matmul: the ("tw_gemm", dtype) bounds of
# tests/tolerances.py, measured at K <= 300; rounding of a K-term sum grows ~sqrt(K), so atol
# is scaled by sqrt(K / TOL_K) above that.
TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 2e-2, "atol": 5e-2},
}
TOL_K = 300
CSR_BETA_WARNING = "Sparse CSR tensor support is in beta"  # torch warns once per process


@dataclass(frozen=True)
class Shape:
    """One GEMM ``(M, K) · (K, N)``; ``group`` is what ``--only`` selects."""

    name: str
    group: str
    M: int
    K: int
    N: int


def dlrm_shapes(batch: int = TOKENS) -> list[Shape]:
    """The DLRM-DCNv2 top-MLP and cross layers, widths read from the ``dlrm_dcnv2`` workload
    (top input = bottom output · (tables + 1) = 128 · 27 = 3456)."""
    w = get_workload("dlrm_dcnv2")
    top_in = w.bottom_mlp[-1] * (len(w.tables) + 1)
    widths = [top_in, *w.top_mlp]
    out = [
        Shape(f"dlrm_top{i}_{k}x{n}", "dlrm", batch, k, n)
        for i, (k, n) in enumerate(zip(widths[:-1], widths[1:]))
        if n > 1  # the logit layer (N=1) has no tiles to speak of
    ]
    r = w.interaction.low_rank
    out += [
        Shape(f"dlrm_cross_v_{top_in}x{r}", "dlrm_cross", batch, top_in, r),
        Shape(f"dlrm_cross_u_{r}x{top_in}", "dlrm_cross", batch, r, top_in),
    ]
    return out


def full_shapes() -> list[Shape]:
    """Every full-size shape, in run order."""
    return [
        Shape("square_4096", "square", 4096, 4096, 4096),
        Shape("bert_ffn1_768x3072", "bert", TOKENS, 768, 3072),
        Shape("bert_ffn2_3072x768", "bert", TOKENS, 3072, 768),
        *dlrm_shapes(),
    ]


QUICK_SHAPES = [Shape("quick_256x512x512", "quick", 256, 512, 512)]
QUICK_SPARSITIES = (0.75,)
QUICK_REPEATS = 3


def csr_support(dtype: torch.dtype) -> str | None:
    """``None`` when torch can multiply a CPU sparse CSR matrix in ``dtype``, else why not."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CSR_BETA_WARNING)
        w = torch.eye(4, dtype=dtype).to_sparse_csr()
    try:
        torch.sparse.mm(w, torch.ones(4, 2, dtype=dtype))
    except (NotImplementedError, RuntimeError) as e:
        return f"torch {torch.__version__} CPU sparse CSR matmul: {str(e).splitlines()[0]}"
    return None


@dataclass
class CSRContender:
    """The faster of the two CSR formulations for one ``(shape, sparsity)``."""

    variant: str
    fn: Callable[[], torch.Tensor]
    estimate_s: float
    total_fraction: float  # CSR bytes (crow, col, values) over the dense weight's


def pick_csr(x: torch.Tensor, w_masked: torch.Tensor, max_seconds: float) -> CSRContender | str:
    """Probe ``torch.sparse.mm(w_csrᵀ, xᵀ)`` and ``x @ w_csr`` on ``M/8`` rows of ``x``,
    extrapolate to ``M``, keep the faster.

    Args:
        x: ``(M, K)`` activations.
        w_masked: ``(K, N)`` dense weight with the pruned entries zero, ``x``'s dtype.
        max_seconds: the estimate above which CSR is skipped.

    Returns:
        the contender, or the reason it is skipped.
    """
    M = x.shape[0]
    sub = x[: max(1, M // 8)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CSR_BETA_WARNING)
        w_t = w_masked.T.contiguous().to_sparse_csr()  # (N, K)
        w_c = w_masked.to_sparse_csr()  # (K, N)
    variants: dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = {
        "sparse.mm(w_csr_T, x.T)": (w_t, lambda a: torch.sparse.mm(w_t, a.T)),
        "x @ w_csr": (w_c, lambda a: a @ w_c),
    }
    est: dict[str, float] = {}
    for name, (_, f) in variants.items():
        f(sub)  # warm
        est[name] = time_once(functools.partial(f, sub)) * M / sub.shape[0]
    best = min(est, key=lambda k: est[k])
    if est[best] > max_seconds:
        return f"one call estimated at {est[best]:.1f} s (> --csr-max-seconds {max_seconds:g})"
    mat, f = variants[best]
    csr_bytes = sum(
        t.numel() * t.element_size() for t in (mat.crow_indices(), mat.col_indices(), mat.values())
    )
    return CSRContender(
        best, lambda: f(x), est[best], csr_bytes / (w_masked.numel() * w_masked.element_size())
    )


def compare(y: torch.Tensor, ref: torch.Tensor, K: int) -> tuple[float, float, bool]:
    """``(max |y − ref|, atol, within)`` under the ``tw_gemm`` bounds (module docstring), atol
    scaled for ``K``."""
    tol = TOL[ref.dtype]
    atol = tol["atol"] * max(1.0, math.sqrt(K / TOL_K))
    diff = (y.float() - ref.float()).abs()
    ok = (
        y.shape == ref.shape
        and y.dtype == ref.dtype
        and bool((diff <= atol + tol["rtol"] * ref.float().abs()).all())
    )
    return (float(diff.max()) if diff.numel() else 0.0), atol, ok


def check_tw(x: torch.Tensor, layout: TWLayout) -> dict[str, Any]:
    """Run the CPU kernel once and compare it with ``reference_matmul`` (see module docstring).

    Returns:
        ``tw_max_abs_err``, ``tw_rtol``, ``tw_atol``, ``correct``.
    """
    err, atol, ok = compare(
        tw_linear(x, layout, None, "cpu"), reference_matmul(x, layout), x.shape[1]
    )
    return {"tw_max_abs_err": err, "tw_rtol": TOL[x.dtype]["rtol"], "tw_atol": atol, "correct": ok}


def auto_fields(x: torch.Tensor, layout: TWLayout) -> dict[str, Any]:
    """AUTO's route for this call and the crossover it measured (``tilesparse.ops.auto_decision``),
    and its result checked like :func:`check_tw`'s.

    Returns:
        ``auto_route``, ``auto_calibration_tw_ms``, ``auto_calibration_dense_ms``,
        ``auto_max_abs_err``, ``auto_correct``.
    """
    d = auto_decision(layout, x.shape[0])
    y = tw_linear(x, layout, None, "auto")
    err, _, ok = compare(y, reference_matmul(x, layout), x.shape[1])
    return {
        "auto_route": None if d is None else d.route.value,
        "auto_calibration_tw_ms": None if d is None else 1e3 * d.tw_s,
        "auto_calibration_dense_ms": None if d is None else 1e3 * d.dense_s,
        "auto_max_abs_err": err,
        "auto_correct": ok,
    }


def auto_repeats(round_s: float, row_seconds: float, lo: int = 5, hi: int = 100) -> int:
    """Rounds so that the dense + TW calls of a row take about ``row_seconds``."""
    return max(lo, min(hi, math.ceil(row_seconds / max(round_s, 1e-6))))


class MaskCache:
    """The latest ``(K, N, s)``'s EW mask, shared by the rows that differ only in dtype or
    ``G`` (``ew_mask`` takes ~10 s on 4096 × 4096 on one core)."""

    def __init__(self) -> None:
        self.key: tuple[int, int, float] | None = None
        self.ew: torch.Tensor | None = None

    def ew_mask(self, scores: torch.Tensor, s: float) -> torch.Tensor:
        """``ew_mask(scores, s)``, computed once per ``(K, N, s)``."""
        key = (int(scores.shape[0]), int(scores.shape[1]), s)
        if key != self.key or self.ew is None:
            self.key, self.ew = key, ew_mask(scores, s)
        return self.ew


def _csr_contender(
    x: torch.Tensor,
    w: torch.Tensor,
    scores: torch.Tensor,
    s: float,
    masks: MaskCache,
    csr_why_not: str | None,
    args: argparse.Namespace,
) -> tuple[CSRContender | None, str | None]:
    """``(contender, None)`` for the CSR peer on ``w`` under the EW mask of ``s`` (its
    full-size call warmed), or ``(None, why it is skipped)``."""
    if csr_why_not is not None:
        return None, csr_why_not
    picked = pick_csr(x, w * masks.ew_mask(scores, s).to(w.dtype), args.csr_max_seconds)
    if isinstance(picked, str):
        return None, picked
    picked.fn()  # warm the full-size call
    return picked, None


def bench_row(
    shape: Shape,
    dtype_name: str,
    G: int,
    s: float,
    x32: torch.Tensor,
    w32: torch.Tensor,
    scores: torch.Tensor,
    masks: MaskCache,
    csr_why_not: str | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One row: time dense, TW and CSR interleaved, check TW, measure memory."""
    dtype = DTYPES[dtype_name]
    x, w = x32.to(dtype), w32.to(dtype)
    layout = condense(w, tw_mask(scores, s, G), G)
    mem = layer_memory(layout)
    fns: dict[str, Callable[[], Any]] = {
        "dense": lambda: torch.matmul(x, w),
        "tw": lambda: tw_linear(x, layout, None, "cpu"),
        "auto": lambda: tw_linear(x, layout, None, "auto"),
    }
    check = check_tw(x, layout)
    for fn in fns.values():
        fn()  # warm (the first AUTO call measures its crossover unless the table holds it)
    auto = auto_fields(x, layout)
    round_s = sum(time_once(fn) for fn in fns.values())
    repeats = args.repeats if args.repeats is not None else auto_repeats(round_s, args.row_seconds)
    csr, csr_skipped = _csr_contender(x, w, scores, s, masks, csr_why_not, args)
    if csr is not None:
        fns["csr"] = csr.fn
    caps = {"csr": min(args.csr_repeats, repeats)} if csr else {}
    t = interleaved(fns, repeats, warmup=0, caps=caps)
    dense_ms, tw_ms, auto_ms = t["dense"].median_ms, t["tw"].median_ms, t["auto"].median_ms
    csr_ms = t["csr"].median_ms if csr else None
    ideal = 1.0 / (1.0 - s)
    speedup = dense_ms / tw_ms
    return {
        "bench": "tw_gemm",
        "shape": shape.name,
        "group": shape.group,
        "M": shape.M,
        "K": shape.K,
        "N": shape.N,
        "dtype": dtype_name,
        "G": G,
        "sparsity": s,
        "threads": torch.get_num_threads(),
        "bias": False,
        "repeats": repeats,
        "dense_ms": dense_ms,
        "tw_ms": tw_ms,
        "csr_ms": csr_ms,
        "speedup": speedup,
        "csr_speedup": dense_ms / csr_ms if csr_ms else None,
        "tw_vs_csr": csr_ms / tw_ms if csr_ms else None,
        "auto_ms": auto_ms,
        "auto_vs_dense": dense_ms / auto_ms,
        "auto_min_ms": 1e3 * t["auto"].min_s,
        "auto_iqr_ms": 1e3 * t["auto"].iqr_s,
        **auto,
        "ideal": ideal,
        "fraction_of_ideal": speedup / ideal,
        "dense_min_ms": 1e3 * t["dense"].min_s,
        "dense_iqr_ms": 1e3 * t["dense"].iqr_s,
        "tw_min_ms": 1e3 * t["tw"].min_s,
        "tw_iqr_ms": 1e3 * t["tw"].iqr_s,
        "csr_min_ms": 1e3 * t["csr"].min_s if csr else None,
        "csr_repeats": t["csr"].samples if csr else 0,
        "csr_variant": csr.variant if csr else None,
        "csr_skipped": csr_skipped,
        **check,
        "tw_density": layout.density,
        "tiles": layout.num_tiles,
        "kept_columns": int(layout.col_idx.numel()),
        "values_fraction": mem.values_fraction,
        "index_fraction": mem.index_fraction,
        "memory_fraction": mem.total_fraction,
        "csr_memory_fraction": csr.total_fraction if csr else None,
    }  # the row's tensors die here; main() collects before the next row


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The summary table the README carries (one line per row)."""
    head = (
        "| shape | M×K×N | dtype | G | s | dense ms | TW ms | speedup | ideal | of ideal "
        "| AUTO ms | AUTO/dense | AUTO route | CSR ms | CSR speedup | TW mem | ok |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['M']}×{r['K']}×{r['N']} | {r['dtype']} | {r['G']} | {r['sparsity']:.2f} "
            f"| {r['dense_ms']:.2f} | {r['tw_ms']:.2f} | {r['speedup']:.2f}× | {r['ideal']:.0f}× "
            f"| {100 * r['fraction_of_ideal']:.0f}% | {r['auto_ms']:.2f} | {r['auto_vs_dense']:.2f}× "
            f"| {r['auto_route'] or '—'} | {_fmt(r['csr_ms'], '.2f')} "
            f"| {_fmt(r['csr_speedup'], '.2f')}{'×' if r['csr_speedup'] else ''} "
            f"| {100 * r['memory_fraction']:.1f}% "
            f"| {'yes' if r['correct'] and r['auto_correct'] else 'NO'} |"
        )
    return "\n".join(lines)


def _csv(value: str, allowed: tuple[str, ...], what: str, ap: argparse.ArgumentParser) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        ap.error(f"--{what}: unknown {bad or 'empty list'}; choose from {','.join(allowed)}")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"one tiny shape {QUICK_SHAPES[0].name}, s={QUICK_SPARSITIES}, {QUICK_REPEATS} repeats",
    )
    ap.add_argument("--only", default=",".join(DEFAULT_GROUPS), help=f"comma list of {GROUPS}")
    ap.add_argument(
        "--dtypes",
        default=None,
        help=f"comma list of {tuple(DTYPES)} (default: all; bf16 only where the CPU has native bf16)",
    )
    ap.add_argument(
        "--sparsities", default=",".join(map(str, SPARSITIES)), help="comma list in [0, 1)"
    )
    ap.add_argument("--tiles", default=",".join(map(str, TILES)), help="comma list of G")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved rounds per row (default: enough for ~--row-seconds of dense+TW, 5..100)",
    )
    # 8 s: the default run (84 rows) takes ~10-12 min on 2 quiet cores, estimated from 1-thread rows
    ap.add_argument(
        "--row-seconds", type=float, default=8.0, help="time budget of a row's dense+TW rounds"
    )
    ap.add_argument("--csr-repeats", type=int, default=3, help="most rounds CSR joins (it is slow)")
    ap.add_argument(
        "--csr-max-seconds",
        type=float,
        default=10.0,
        help="skip CSR when one call would take longer",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "tilesparse_gemm.json")
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    args.group_list = _csv(args.only, GROUPS, "only", ap)
    if args.dtypes is None:
        args.dtype_list = default_dtypes(list(DTYPES), args.quick)
    else:
        args.dtype_list = _csv(args.dtypes, tuple(DTYPES), "dtypes", ap)
    try:
        args.sparsity_list = [float(v) for v in args.sparsities.split(",") if v.strip()]
        args.tile_list = [int(v) for v in args.tiles.split(",") if v.strip()]
    except ValueError as e:
        ap.error(f"--sparsities/--tiles: {e}")
    if not all(0.0 <= v < 1.0 for v in args.sparsity_list) or not args.sparsity_list:
        ap.error(f"--sparsities must lie in [0, 1), got {args.sparsities!r}")
    if not all(g > 0 for g in args.tile_list) or not args.tile_list:
        ap.error(f"--tiles must be positive integers, got {args.tiles!r}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.csr_repeats < 1:
        ap.error(f"--csr-repeats must be >= 1, got {args.csr_repeats}")
    if args.row_seconds <= 0 or args.csr_max_seconds <= 0:
        ap.error(
            f"--row-seconds and --csr-max-seconds must be > 0, got {args.row_seconds}, {args.csr_max_seconds}"
        )
    if args.quick:
        args.sparsity_list = list(QUICK_SPARSITIES)
        args.repeats = args.repeats or QUICK_REPEATS
    return args


def _bench_shape(
    shape: Shape,
    args: argparse.Namespace,
    csr_why_not: dict[str, str | None],
    rows: list[dict[str, Any]],
    total: int,
) -> None:
    """Every (sparsity, dtype, G) row of one shape, appended to ``rows`` and logged."""
    log.info("shape %s (M=%d, K=%d, N=%d)", shape.name, shape.M, shape.K, shape.N)
    gen = torch.Generator().manual_seed(args.seed)
    x32 = torch.randn(shape.M, shape.K, generator=gen)
    w32 = torch.randn(shape.K, shape.N, generator=gen) / math.sqrt(shape.K)
    scores = torch.rand(shape.K, shape.N, generator=gen)
    masks = MaskCache()
    for s in args.sparsity_list:
        for dtype_name in args.dtype_list:
            for G in args.tile_list:
                t0 = time.perf_counter()
                r = bench_row(
                    shape, dtype_name, G, s, x32, w32, scores, masks, csr_why_not[dtype_name], args
                )
                rows.append(r)
                free_memory()
                log.info(
                    "[%d/%d] %s %s G=%d s=%.2f: dense %.2f ms, TW %.2f ms (%.2f×, %.0f%% of %.0f×), "
                    "AUTO %.2f ms (%.2f×, %s), CSR %s ms, correct=%s (%.1f s)",
                    len(rows),
                    total,
                    shape.name,
                    dtype_name,
                    G,
                    s,
                    r["dense_ms"],
                    r["tw_ms"],
                    r["speedup"],
                    100 * r["fraction_of_ideal"],
                    r["ideal"],
                    r["auto_ms"],
                    r["auto_vs_dense"],
                    r["auto_route"],
                    _fmt(r["csr_ms"], ".2f"),
                    r["correct"] and r["auto_correct"],
                    time.perf_counter() - t0,
                )


def main(argv: list[str] | None = None) -> Path:
    """CLI entry point; returns the JSON path written.

    Raises:
        SystemExit: for bad arguments, or when the compiled CPU kernel is missing (timing the
            reference path would be meaningless).
    """
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    threads = set_threads(args.threads)
    if not cpu_kernel_available():
        raise SystemExit(
            "bench_gemm: the compiled tilesparse CPU kernel is missing; run "
            "`python -m tilesparse.build_ext -v` first"
        )
    shapes = (
        QUICK_SHAPES if args.quick else [s for s in full_shapes() if s.group in args.group_list]
    )
    csr_why_not = {d: csr_support(DTYPES[d]) for d in args.dtype_list}
    for d, why in csr_why_not.items():
        if why:
            log.info("CSR skipped for %s: %s", d, why)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    total = len(shapes) * len(args.sparsity_list) * len(args.dtype_list) * len(args.tile_list)
    for shape in shapes:
        _bench_shape(shape, args, csr_why_not, rows, total)
        free_memory()
    path = write_json(
        args.out,
        rows,
        args={k: str(v) for k, v in vars(args).items()},
        threads=threads,
        cpu_features=cpu_features(),
        csr_support={d: why or "supported" for d, why in csr_why_not.items()},
        seconds=time.perf_counter() - t_start,
    )
    print(markdown(rows), flush=True)
    log.info("wrote %s (%d rows, %.0f s)", path, len(rows), time.perf_counter() - t_start)
    return path


if __name__ == "__main__":
    main()
