"""Whole models with tile-wise (TW) sparse linears on the CPU kernel against the same models
dense, side by side in one run, JSON out and a markdown table on stdout.

    python -m benchmarks.tilesparse.bench_models                   # everything (~2-3 min, 2 cores)
    python -m benchmarks.tilesparse.bench_models --only dlrm --dtypes fp32
    python -m benchmarks.tilesparse.bench_models --quick --out /tmp/models.json   # seconds

Sections (``--only``):

- ``dlrm``: the DLRM-DCNv2 dense part (``DLRM.dense_forward``: bottom MLP 13-512-256-128, three
  low-rank cross layers over 3456 features, top MLP 3456-1024-1024-512-256-1; 14 linears) at
  batch 4096, every linear pruned to ``s`` ∈ {0.5, 0.75, 0.9} per layer (``prune_`` with
  ``global_threshold=False``, G=128) and compressed, against the unpruned model of the same seed.
  The issue's target is ``speedup >= 2`` at 75% in fp32: fields ``target`` / ``meets_target``
  on that row (``null`` elsewhere; bf16 is reported beside it, not held to the target). The output is checked against the *masked dense* model (same
  weights, masks multiplied in). bf16 rows cast both models (``.to(torch.bfloat16)``) and
  check against the fp32 masked dense output.
- ``encoder``: a BERT-base-like ``nn.TransformerEncoder`` (d_model 768, 12 heads, FFN 3072, 2
  layers, batch 8 × seq 512 = 4096 tokens), only the FFN linears (``linear1``, ``linear2``) at
  75% TW, eval + ``no_grad``. A dense ``nn.TransformerEncoderLayer`` in eval + no_grad runs
  torch's native fused kernel (``aten::_transformer_encoder_layer_fwd``), a TW one cannot (it
  would read the dense ``.weight``), so the dense model is timed both ways: ``dense_fused_ms``
  (the fast path) and ``dense_unfused_ms`` (``torch.backends.mha.set_fastpath_enabled(False)``:
  the same Python path the TW model takes). ``speedup`` is against the unfused (same code path),
  ``speedup_vs_fused`` against the fused one. Which path each ran is read from the profiler
  (``*_fused_path``), not assumed.

Each TW model is also timed with backend ``auto`` (``auto_ms``, ``auto_vs_dense`` = the dense
time of the row's baseline over it; ``auto_routes`` how many layers ran the TW kernel and how
many the dense GEMM on their cached dense weight, as ``tilesparse.ops.auto_decision`` reports),
in the same interleaved rounds; the first AUTO call, a warm-up, measures each layer's crossover
unless the machine's table already holds it.

Every timing is ``torch.no_grad()``, the same ``--threads``, interleaved medians
(:mod:`benchmarks.tilesparse.timing`). Memory per model is ``tilesparse.model_memory``: the
bytes of every linear layer's weight as stored over the same weights dense (for the encoder
that includes the dense attention ``out_proj``; the packed ``in_proj`` is no ``nn.Linear`` and
counts as "other").
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import tilesparse
from benchmarks.meta import RESULTS_DIR, write_json
from benchmarks.tilesparse.model_checks import (
    MODEL_TOL,
    masked_dense_err,
    masked_reference,
    max_err,
    memory_fields,
    op_counts,
    time_rows,
    verdict,
)
from benchmarks.tilesparse.timing import (
    add_threads_arg,
    cpu_features,
    default_dtypes,
    free_memory,
    set_threads,
)
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import Workload, get_workload
from tilesparse.kernels import cpu_kernel_available
from tilesparse.ops import auto_decision

log = logging.getLogger("bench_models")

SECTIONS = ("dlrm", "encoder")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET_SPARSITY, TARGET_SPEEDUP = 0.75, 2.0  # the issue: >= 2x on the DLRM dense part at 75%
TW_OP = "tilesparse::tw_linear"
FUSED_OP = "aten::_transformer_encoder_layer_fwd"

# knobs: full size / --quick
FULL = {
    "dlrm_batch": 4096,
    "dlrm_sparsities": (0.5, 0.75, 0.9),
    "dlrm_tile": 128,
    "d_model": 768,
    "heads": 12,
    "ffn": 3072,
    "layers": 2,
    "batch": 8,
    "seq": 512,
    "enc_sparsities": (0.75,),
    "enc_tile": 128,
}
QUICK = {
    "dlrm_batch": 128,
    "dlrm_sparsities": (0.75,),
    "dlrm_tile": 128,
    "d_model": 96,
    "heads": 4,
    "ffn": 384,
    "layers": 2,
    "batch": 2,
    "seq": 16,
    "enc_sparsities": (0.75,),
    "enc_tile": 32,
}
QUICK_REPEATS = 3


# ------------------------------------------------------------------------------ backends


def set_backend(model: nn.Module, backend: str) -> None:
    """Set every ``TileSparseLinear`` of ``model`` to ``backend``."""
    for m in model.modules():
        if isinstance(m, tilesparse.TileSparseLinear):
            m.backend = backend


def run_as(model: nn.Module, backend: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``model``'s TW layers on ``backend`` (a contender of the timed rounds)."""
    set_backend(model, backend)
    return fn()


def auto_fields(model: nn.Module, batch: int) -> dict[str, Any]:
    """``auto_routes``: layers by the route AUTO took for ``batch`` rows (``"tw"``, ``"dense"``,
    ``"unmeasured"``)."""
    routes: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, tilesparse.TileSparseLinear):
            d = auto_decision(m.layout, batch)
            name = "unmeasured" if d is None else d.route.value
            routes[name] = routes.get(name, 0) + 1
    return {"auto_routes": routes}


# ------------------------------------------------------------------------------ DLRM-DCNv2


def _dlrm_inputs(w: Workload, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense (B, 13)``, ``pooled (B, 26, 128)`` float32 from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, w.dense_features, generator=gen)
    pooled = torch.randn(batch, len(w.tables), w.tables[0].dim, generator=gen)
    return dense, pooled


@torch.no_grad()
def _dlrm_row(
    dense_m: DLRM,
    tw_m: DLRM,
    d_in: torch.Tensor,
    p_in: torch.Tensor,
    want: torch.Tensor,
    reference_err: float | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Check and time one (dense, TW) pair of DLRMs on ``dense_forward(d_in, p_in)``."""
    dtype = d_in.dtype
    err, ok = max_err(tw_m.dense_forward(d_in, p_in), want, dtype)
    calls = op_counts(lambda: tw_m.dense_forward(d_in, p_in), (TW_OP,))[TW_OP]
    forward = functools.partial(tw_m.dense_forward, d_in, p_in)
    t, repeats = time_rows(
        {
            "dense": lambda: dense_m.dense_forward(d_in, p_in),
            "tw": functools.partial(run_as, tw_m, "cpu", forward),
            "auto": functools.partial(run_as, tw_m, "auto", forward),
        },
        args,
    )
    auto_err, auto_ok = max_err(run_as(tw_m, "auto", forward), want, dtype)
    set_backend(tw_m, "cpu")
    return {
        "bench": "dlrm_dcnv2_dense_forward",
        "model": "dlrm_dcnv2",
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "dense_ms": t["dense"],
        "tw_ms": t["tw"],
        "dense_iqr_ms": t["dense_iqr"],
        "tw_iqr_ms": t["tw_iqr"],
        "speedup": t["dense"] / t["tw"],
        "auto_ms": t["auto"],
        "auto_iqr_ms": t["auto_iqr"],
        "auto_vs_dense": t["dense"] / t["auto"],
        "auto_max_abs_err": auto_err,
        "auto_correct": verdict(auto_err, auto_ok, reference_err)["correct"],
        **auto_fields(tw_m, d_in.shape[0]),
        **verdict(err, ok, reference_err),
        "rtol": MODEL_TOL[dtype]["rtol"],
        "atol": MODEL_TOL[dtype]["atol"],
        "tw_linear_calls": calls,
        **memory_fields(tw_m),
    }


def _dense_forward(d_in: torch.Tensor, p_in: torch.Tensor, model: nn.Module) -> torch.Tensor:
    return cast(DLRM, model).dense_forward(d_in, p_in)


def _forward(x: torch.Tensor, model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(x)
    return out


def bench_dlrm(args: argparse.Namespace, knobs: dict[str, Any]) -> list[dict[str, Any]]:
    """DLRM-DCNv2 dense part: dense vs TW at each sparsity and dtype."""
    w = get_workload("dlrm_dcnv2").scaled(1e6)  # tables are not timed: keep them tiny

    def build() -> DLRM:
        return build_model(w, seed=args.seed).eval()

    batch, G = knobs["dlrm_batch"], knobs["dlrm_tile"]
    dense_in, pooled_in = _dlrm_inputs(w, batch, args.seed)
    dense32 = build()
    rows = []
    for s in knobs["dlrm_sparsities"]:
        t0 = time.perf_counter()
        tw32 = build()
        cfg = tilesparse.TileSparseConfig(sparsity=s, tile=G, global_threshold=False)
        pruner = tilesparse.prune_(tw32, cfg)
        reference = masked_reference(build, pruner)
        if not isinstance(reference, DLRM):
            raise TypeError(f"masked_reference built a {type(reference).__name__}, not a DLRM")
        pruner.compress(backend="cpu")
        prune_s = time.perf_counter() - t0
        with torch.no_grad():
            want = reference.dense_forward(dense_in, pooled_in)
        for dname in args.dtype_list:
            dtype = DTYPES[dname]
            dense_m = dense32 if dtype == torch.float32 else copy.deepcopy(dense32).to(dtype)
            tw_m = tw32 if dtype == torch.float32 else copy.deepcopy(tw32).to(dtype)
            d_in, p_in = dense_in.to(dtype), pooled_in.to(dtype)
            ref_err = masked_dense_err(
                reference, dtype, functools.partial(_dense_forward, d_in, p_in), want
            )
            row = _dlrm_row(dense_m, tw_m, d_in, p_in, want, ref_err, args)
            ideal = 1.0 / (1.0 - s)
            row.update(
                batch=batch,
                dtype=dname,
                G=G,
                sparsity=s,
                prune_and_compress_s=prune_s,
                ideal=ideal,
                fraction_of_ideal=row["speedup"] / ideal,
            )
            target = TARGET_SPEEDUP if s == TARGET_SPARSITY and dtype == torch.float32 else None
            row.update(
                target=target, meets_target=None if target is None else row["speedup"] >= target
            )
            rows.append(row)
            log.info(
                "dlrm %s s=%.2f batch %d: dense %.1f ms, TW %.1f ms (%.2f×; target %s), err %.2e %s, "
                "%d tw_linear calls",
                dname,
                s,
                batch,
                row["dense_ms"],
                row["tw_ms"],
                row["speedup"],
                "—"
                if target is None
                else f"{target:g}× {'met' if row['meets_target'] else 'MISSED'}",
                row["max_abs_err"],
                "ok" if row["correct"] else "WRONG",
                row["tw_linear_calls"],
            )
            del dense_m, tw_m
            free_memory()
        del tw32, pruner, reference
        free_memory()
    return rows


# ------------------------------------------------------------------------------ TransformerEncoder


def _build_encoder(knobs: dict[str, Any], seed: int) -> nn.TransformerEncoder:
    """The encoder from a fixed seed; the global RNG (which nn layers draw from) is restored."""
    state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(
            knobs["d_model"], knobs["heads"], knobs["ffn"], dropout=0.0, batch_first=True
        )
        return nn.TransformerEncoder(layer, knobs["layers"], enable_nested_tensor=False).eval()
    finally:
        torch.set_rng_state(state)


def _ffn_only(module: nn.Module, fqn: str) -> bool:
    return fqn.endswith(("linear1", "linear2"))


@contextmanager
def fastpath(enabled: bool) -> Iterator[None]:
    """``torch.backends.mha.set_fastpath_enabled(enabled)`` for the block, restored after."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@torch.no_grad()
def _encoder_row(
    dense_m: nn.Module,
    tw_m: nn.Module,
    x: torch.Tensor,
    want: torch.Tensor,
    reference_err: float | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Check and time one (dense, TW) pair of encoders on ``x (B, S, d_model)``: the dense one
    with and without the fused fast path."""

    def dense_unfused() -> torch.Tensor:
        with fastpath(False):
            return dense_m(x)

    dtype = x.dtype
    err, ok = max_err(tw_m(x), want, dtype)
    ops_tw = op_counts(lambda: tw_m(x), (TW_OP, FUSED_OP))
    ops_fused = op_counts(lambda: dense_m(x), (FUSED_OP,))
    ops_unfused = op_counts(dense_unfused, (FUSED_OP,))
    forward = functools.partial(tw_m, x)
    t, repeats = time_rows(
        {
            "dense_fused": lambda: dense_m(x),
            "dense_unfused": dense_unfused,
            "tw": functools.partial(run_as, tw_m, "cpu", forward),
            "auto": functools.partial(run_as, tw_m, "auto", forward),
        },
        args,
    )
    auto_err, auto_ok = max_err(run_as(tw_m, "auto", forward), want, dtype)
    set_backend(tw_m, "cpu")
    return {
        "bench": "transformer_encoder",
        "model": "transformer_encoder",
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "dense_fused_ms": t["dense_fused"],
        "dense_unfused_ms": t["dense_unfused"],
        "tw_ms": t["tw"],
        "dense_fused_iqr_ms": t["dense_fused_iqr"],
        "dense_unfused_iqr_ms": t["dense_unfused_iqr"],
        "tw_iqr_ms": t["tw_iqr"],
        "speedup": t["dense_unfused"] / t["tw"],
        "speedup_vs_fused": t["dense_fused"] / t["tw"],
        "auto_ms": t["auto"],
        "auto_iqr_ms": t["auto_iqr"],
        "auto_vs_dense": t["dense_unfused"] / t["auto"],
        "auto_vs_fused": t["dense_fused"] / t["auto"],
        "auto_max_abs_err": auto_err,
        "auto_correct": verdict(auto_err, auto_ok, reference_err)["correct"],
        **auto_fields(tw_m, x.shape[0] * x.shape[1]),
        "baseline": "speedup: dense with the fused fast path disabled (the TW model's code path)",
        "dense_fused_path": ops_fused[FUSED_OP] > 0,
        "dense_unfused_path_fused": ops_unfused[FUSED_OP] > 0,
        "tw_fused_path": ops_tw[FUSED_OP] > 0,
        "tw_linear_calls": ops_tw[TW_OP],
        **verdict(err, ok, reference_err),
        "rtol": MODEL_TOL[dtype]["rtol"],
        "atol": MODEL_TOL[dtype]["atol"],
        **memory_fields(tw_m),
    }


def bench_encoder(args: argparse.Namespace, knobs: dict[str, Any]) -> list[dict[str, Any]]:
    """TransformerEncoder with TW FFN linears vs dense (fused and unfused)."""
    G, tokens = knobs["enc_tile"], knobs["batch"] * knobs["seq"]
    x32 = torch.randn(
        knobs["batch"],
        knobs["seq"],
        knobs["d_model"],
        generator=torch.Generator().manual_seed(args.seed),
    )
    dense32 = _build_encoder(knobs, args.seed)
    rows = []
    for s in knobs["enc_sparsities"]:
        tw32 = _build_encoder(knobs, args.seed)
        cfg = tilesparse.TileSparseConfig(sparsity=s, tile=G, global_threshold=False)
        pruner = tilesparse.prune_(tw32, cfg, _ffn_only)
        reference = masked_reference(lambda: _build_encoder(knobs, args.seed), pruner)
        pruner.compress(backend="cpu")
        with torch.no_grad(), fastpath(False):
            want = reference(x32)
        for dname in args.dtype_list:
            dtype = DTYPES[dname]
            dense_m = dense32 if dtype == torch.float32 else copy.deepcopy(dense32).to(dtype)
            tw_m = tw32 if dtype == torch.float32 else copy.deepcopy(tw32).to(dtype)
            x = x32.to(dtype)
            ref_err = masked_dense_err(reference, dtype, functools.partial(_forward, x), want)
            row = _encoder_row(dense_m, tw_m, x, want, ref_err, args)
            row.update(
                d_model=knobs["d_model"],
                heads=knobs["heads"],
                ffn=knobs["ffn"],
                layers=knobs["layers"],
                batch=knobs["batch"],
                seq=knobs["seq"],
                tokens=tokens,
                dtype=dname,
                G=G,
                sparsity=s,
                pruned="linear1, linear2 of every layer",
            )
            rows.append(row)
            log.info(
                "encoder %s s=%.2f %d tokens: dense fused %.1f ms (fused path %s), unfused %.1f ms, "
                "TW %.1f ms (%.2f× unfused, %.2f× fused), %d tw_linear calls, err %.2e %s",
                dname,
                s,
                tokens,
                row["dense_fused_ms"],
                row["dense_fused_path"],
                row["dense_unfused_ms"],
                row["tw_ms"],
                row["speedup"],
                row["speedup_vs_fused"],
                row["tw_linear_calls"],
                row["max_abs_err"],
                "ok" if row["correct"] else "WRONG",
            )
            del dense_m, tw_m
            free_memory()
        del tw32, pruner, reference
        free_memory()
    return rows


# ------------------------------------------------------------------------------ CLI


def _routes(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(row["auto_routes"].items())) or "—"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The summary tables the README carries."""
    out = []
    dlrm = [r for r in rows if r["bench"] == "dlrm_dcnv2_dense_forward"]
    if dlrm:
        out += [
            "| DLRM-DCNv2 dense part | dtype | s | dense ms | TW ms | speedup | ideal | target | "
            "AUTO ms | AUTO/dense | AUTO routes | linear weights TW/dense | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in dlrm:
            tgt = (
                "—"
                if r["target"] is None
                else f"≥{r['target']:g}× {'✓' if r['meets_target'] else '✗'}"
            )
            out.append(
                f"| batch {r['batch']}, G={r['G']} | {r['dtype']} | {r['sparsity']:.2f} | {r['dense_ms']:.1f} "
                f"| {r['tw_ms']:.1f} | {r['speedup']:.2f}× | {r['ideal']:.0f}× | {tgt} "
                f"| {r['auto_ms']:.1f} | {r['auto_vs_dense']:.2f}× | {_routes(r)} "
                f"| {100 * r['memory_fraction']:.1f}% "
                f"| {'yes' if r['correct'] and r['auto_correct'] else 'NO'} |"
            )
    enc = [r for r in rows if r["bench"] == "transformer_encoder"]
    if enc:
        if out:
            out.append("")
        out += [
            "| TransformerEncoder (FFN TW) | dtype | s | dense fused ms | dense unfused ms | TW ms "
            "| speedup (unfused) | speedup (fused) | AUTO ms | AUTO/dense (unfused) | AUTO routes "
            "| linear weights TW/dense | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in enc:
            out.append(
                f"| {r['layers']}×(d {r['d_model']}, FFN {r['ffn']}), {r['tokens']} tokens, G={r['G']} "
                f"| {r['dtype']} | {r['sparsity']:.2f} | {r['dense_fused_ms']:.1f} | {r['dense_unfused_ms']:.1f} "
                f"| {r['tw_ms']:.1f} | {r['speedup']:.2f}× | {r['speedup_vs_fused']:.2f}× "
                f"| {r['auto_ms']:.1f} | {r['auto_vs_dense']:.2f}× | {_routes(r)} "
                f"| {100 * r['memory_fraction']:.1f}% "
                f"| {'yes' if r['correct'] and r['auto_correct'] else 'NO'} |"
            )
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help=f"tiny models, s=0.75, {QUICK_REPEATS} repeats"
    )
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument(
        "--dtypes",
        default=None,
        help=f"comma list of {tuple(DTYPES)} (default: all; bf16 only where the CPU has native bf16)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved rounds per row (default: enough for ~--row-seconds, 5..30)",
    )
    ap.add_argument("--row-seconds", type=float, default=8.0, help="time budget of a row's rounds")
    ap.add_argument(
        "--dlrm-batch", type=int, default=None, help=f"DLRM batch (default {FULL['dlrm_batch']})"
    )
    ap.add_argument(
        "--encoder-batch", type=int, default=None, help=f"encoder batch (default {FULL['batch']})"
    )
    ap.add_argument(
        "--seq", type=int, default=None, help=f"encoder sequence length (default {FULL['seq']})"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "tilesparse_models.json")
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    explicit_dtypes = args.dtypes is not None
    for name, value, allowed in (
        ("only", args.only, SECTIONS),
        ("dtypes", args.dtypes or ",".join(DTYPES), tuple(DTYPES)),
    ):
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in allowed]
        if bad or not items:
            ap.error(f"--{name}: unknown {bad or 'empty list'}; choose from {','.join(allowed)}")
        setattr(args, "section_list" if name == "only" else "dtype_list", items)
    if not explicit_dtypes:
        args.dtype_list = default_dtypes(args.dtype_list, args.quick)
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    for name in ("dlrm_batch", "encoder_batch", "seq"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.quick:
        args.repeats = args.repeats or QUICK_REPEATS
    return args


def knobs_for(args: argparse.Namespace) -> dict[str, Any]:
    """:data:`FULL` or :data:`QUICK`, with the batch/sequence overrides applied."""
    knobs = dict(QUICK if args.quick else FULL)
    for arg, key in (("dlrm_batch", "dlrm_batch"), ("encoder_batch", "batch"), ("seq", "seq")):
        if getattr(args, arg) is not None:
            knobs[key] = getattr(args, arg)
    return knobs


def main(argv: list[str] | None = None) -> Path:
    """CLI entry point; returns the JSON path written.

    Raises:
        SystemExit: for bad arguments, or when the compiled CPU kernel is missing.
    """
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    threads = set_threads(args.threads)
    if not cpu_kernel_available():
        raise SystemExit(
            "bench_models: the compiled tilesparse CPU kernel is missing; run "
            "`python -m tilesparse.build_ext -v` first"
        )
    knobs = knobs_for(args)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for section in args.section_list:
        t0 = time.perf_counter()
        rows += bench_dlrm(args, knobs) if section == "dlrm" else bench_encoder(args, knobs)
        log.info("section %s took %.1f s", section, time.perf_counter() - t0)
    path = write_json(
        args.out,
        rows,
        args={k: str(v) for k, v in vars(args).items()},
        threads=threads,
        cpu_features=cpu_features(),
        knobs={k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()},
        seconds=time.perf_counter() - t_start,
    )
    print(markdown(rows), flush=True)
    log.info("wrote %s (%d rows, %.0f s)", path, len(rows), time.perf_counter() - t_start)
    return path


if __name__ == "__main__":
    main()
