"""Verification of the CUTLASS TW kernels for ``gpu_check``, in child processes.

Each instance is checked exactly against the CPU emulation of the same packed arguments
(integer-valued inputs; plain, and with the fused epilogue: bias + ReLU / GELU / tanh-GELU) and
against the fp32 reference on a random layer. A child process
(``gpu_check --verify-kernels a,b --verify-out FILE --built x,y``) loads the parent's very
extension (``--built``: the same instances in the same order, so the same cache key: nothing is
recompiled), verifies its instances one by one and appends JSON lines as it goes
(:func:`child_loop`); the parent (:func:`verify_in_children`) runs one child per (main loop,
dtype) group, the groups concurrently, and reads the lines back (:func:`read_progress`). An
exception costs only its instance; a fault or hang costs only the instance the child was on,
the rest go on in a fresh child. Also home of what the benchmark shares with it: the random TW
layers (:func:`tw_layout`), the tolerances and :func:`check_close`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.cutlass_kernels.gpu_timing import Budget

if TYPE_CHECKING:
    from cutlass_kernels.manifest import TWKernel
    from tilesparse.format import TWLayout

ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float16: {"rtol": 1e-2, "atol": 1e-2}, torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}
CHILD_TIMEOUT_S = 60.0  # one verification child (startup + its instances)
CHILD_CMD = [sys.executable, "-m", "benchmarks.cutlass_kernels.gpu_check"]
MAX_HANGS = 2  # a group whose children time out this often is given up (the rest marked broken)


class CudaContextLost(RuntimeError):
    """A sticky CUDA error (illegal address, trap): every later call in this process fails."""


def err_text(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def cuda_alive(device: str | torch.device = "cuda") -> bool:
    """Whether the device still runs work after an error (False after a sticky error)."""
    if torch.device(device).type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # any failure means the context is gone
        return False


def split_sparsity(s: float) -> float:
    """Per-step sparsity s' (%) so that columns then rows give s overall (Guo et al.)."""
    return 100.0 - math.sqrt(10000.0 - 100.0 * s)


def tw_layout(
    K: int, N: int, G: int, sparsity: float, gen: torch.Generator, dtype: torch.dtype
) -> TWLayout:
    """A random exactly-tiled TW ``(K, N)`` layer: (1-s') of the columns, each tile of G keeping
    (1-s') of the rows; values ~ N(0, 1/K). Built directly in the condensed format (fast)."""
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
    return TWLayout(
        K,
        N,
        G,
        col_idx.to(i64),
        torch.tensor(tile_ptr, dtype=i64),
        torch.cat(row_idx).to(i64),
        torch.tensor(row_ptr, dtype=i64),
        values,
        torch.tensor(val_ptr, dtype=i64),
    )


def check_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """``(ok, max abs err)`` of ``got`` vs the fp32 ``ref`` (same shape) at ``TOL[dtype]``."""
    tol = TOL[dtype]
    diff = (got.float() - ref.float()).abs()
    err = float(diff.max()) if diff.numel() else 0.0
    ok = bool(torch.isfinite(got).all()) and bool(
        (diff <= tol["atol"] + tol["rtol"] * ref.abs()).all()
    )
    return ok, err


# ---------------------------------------------------------------------------------- verification
def verify_instance(ext: ModuleType, kernel: TWKernel) -> tuple[list[dict[str, Any]], list[str]]:
    """One instance vs the emulation (exact) and vs the fp32 reference (tolerance): its check
    rows and failure messages. Raises whatever the launch raises (the caller records it)."""
    from cutlass_kernels import launch
    from cutlass_kernels.epilogue import Activation
    from cutlass_kernels.manifest import DType
    from cutlass_kernels.reference import emulate, pack_launch, pack_weight
    from tilesparse.format import reference_matmul

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    gen = torch.Generator().manual_seed(zlib.crc32(kernel.name.encode()))  # same data on a rerun
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
        got = launch.tw_gemm_kmajor(gpu, kernel=kernel, ext=ext).cpu()
        ok = torch.equal(got[:, :M], want[:, :M])
        if not ok:
            bad = int((got[:, :M] != want[:, :M]).sum())
            failures.append(
                f"{kernel.name} M={M} K={K} N={N}: {bad} elements differ from the emulation"
            )
        rows.append(
            {"check": "exact_vs_emulation", "kernel": kernel.name, "M": M, "K": K, "N": N, "ok": ok}
        )
        print(f"  {kernel.name} exact M={M} K={K} N={N}: {'ok' if ok else 'MISMATCH'}", flush=True)
        # The fused epilogue: bias + each activation, bit-equal to the emulation (GELU included).
        for act in (Activation.RELU, Activation.GELU, Activation.GELU_TANH):
            cpu = pack_launch(x, pack_weight(layout, dtype=dt))
            want = emulate(replace(cpu, bias=bias, activation=act))
            dev = pack_launch(x.cuda(), pack_weight(layout, dtype=dt, device="cuda"))
            fused = replace(dev, bias=bias.cuda(), activation=act)
            got = launch.tw_gemm_kmajor(fused, kernel=kernel, ext=ext).cpu()
            ok = torch.equal(got[:, :M], want[:, :M])
            if not ok:
                bad = int((got[:, :M] != want[:, :M]).sum())
                failures.append(
                    f"{kernel.name} epilogue bias+{act} M={M} K={K} N={N}: {bad} elements "
                    "differ from the emulation"
                )
            rows.append(
                {
                    "check": "epilogue_vs_emulation",
                    "kernel": kernel.name,
                    "activation": act.value,
                    "M": M,
                    "ok": ok,
                }
            )
    # Tolerance: random normal data vs the fp32 reference.
    layout = tw_layout(1000, 4 * G + 7, G, 50, gen, torch.float32)
    x = torch.randn(777, 1000, generator=gen)
    want = reference_matmul(x, layout)
    args = pack_launch(x.to(dt).cuda(), pack_weight(layout, dtype=dt, device="cuda"))
    got = launch.tw_gemm_kmajor(args, kernel=kernel, ext=ext)[:, :777].t().float().cpu()
    err = float((got - want).abs().max())
    try:
        torch.testing.assert_close(got, want, **TOL[dt])
        ok = True
    except AssertionError as e:
        ok = False
        failures.append(f"{kernel.name} random layer: {str(e).splitlines()[0]} (max err {err:.3g})")
    rows.append(
        {"check": "close_to_reference", "kernel": kernel.name, "max_abs_err": err, "ok": ok}
    )
    torch.cuda.synchronize()  # a kernel fault surfaces here, inside this instance's try
    return rows, failures


def child_loop(
    names: list[str],
    verify_one: Callable[[str], tuple[list[dict[str, Any]], list[str]]],
    out: Path,
    alive: Callable[[], bool] = cuda_alive,
) -> int:
    """Verify ``names`` one by one, appending JSON lines to ``out`` as it goes: ``{"start":
    name}`` before an instance, then its ``{"check": row}`` / ``{"failure": msg}`` lines and
    ``{"done": name}`` in one write. An exception is recorded against its instance only; after
    one that left the device unusable (``alive()`` false) the loop stops and returns 2, so the
    parent re-runs the rest in a fresh process. Returns 0 when all were verified."""
    with open(out, "a") as f:

        def emit(*events: dict[str, Any]) -> None:
            f.write("".join(json.dumps(e, default=str) + "\n" for e in events))
            f.flush()

        for name in names:
            emit({"start": name})
            lost = False
            try:
                rows, fails = verify_one(name)
            except Exception as e:  # recorded against this instance only
                msg = err_text(e)
                rows = [{"check": "error", "kernel": name, "ok": False, "error": msg}]
                fails = [f"{name}: {msg}"]
                lost = not alive()
                print(f"  {name}: ERROR {msg}{' (CUDA context lost)' if lost else ''}", flush=True)
            emit(*({"check": r} for r in rows), *({"failure": m} for m in fails), {"done": name})
            if lost:
                return 2
    return 0


def read_progress(path: Path) -> tuple[list[dict[str, Any]], list[str], set[str], str | None]:
    """``(checks, failures, done, current)`` from a child's JSON lines: ``current`` is the
    instance it had started and not finished (None when it finished its last one)."""
    checks: list[dict[str, Any]] = []
    failures: list[str] = []
    done: set[str] = set()
    current = None
    if not path.is_file():
        return checks, failures, done, current
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            continue
        if "start" in ev:
            current = ev["start"]
        elif "check" in ev:
            checks.append(ev["check"])
        elif "failure" in ev:
            failures.append(ev["failure"])
        elif "done" in ev:
            done.add(ev["done"])
            current = None
    return checks, failures, done, current


def verify_child(args: argparse.Namespace) -> int:
    """Child mode (``--verify-kernels a,b --verify-out FILE [--built x,y]``): load the extension
    of exactly the parent's built instances (``--built``, in its order: the same cache key, so
    nothing is recompiled) and verify the named instances (:func:`child_loop`)."""
    from cutlass_kernels import build, toolchain
    from cutlass_kernels.manifest import manifest

    arch = toolchain.device_arch()
    by_name = {k.name: k for k in manifest(arch)}
    built = [by_name[n] for n in args.built.split(",")] if args.built else None
    ext = build.load_extension(arch, built, skip_failed=True)
    return child_loop(
        args.verify_kernels.split(","),
        lambda n: verify_instance(ext, by_name[n]),
        Path(args.verify_out),
    )


def _text(s: str | bytes | None) -> str:
    return s.decode(errors="replace") if isinstance(s, bytes) else (s or "")


def _verify_group(
    label: str, names: list[str], cmd: list[str], timeout_s: float, budget: Budget | None
) -> tuple[list[dict[str, Any]], list[str], str]:
    """Verify one (main loop, dtype) group in child processes: a child that dies or hangs
    costs the instance it was on; the rest go on in a new child while it makes progress (after
    ``MAX_HANGS`` time-outs the rest are given up: a main loop that hangs every time would
    otherwise spend ``timeout_s`` per instance)."""
    import subprocess
    import tempfile

    checks: list[dict[str, Any]] = []
    failures: list[str] = []
    log: list[str] = []

    def broken(ns: list[str], why: str) -> None:
        checks.extend(
            {"check": "child_process", "kernel": n, "ok": False, "error": why[:500]} for n in ns
        )

    todo = list(names)
    hangs = 0
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(len(names)):
            limit = timeout_s if budget is None else budget.child_timeout(timeout_s)
            if limit < 1.0:
                failures.append(
                    f"{label}: out of time before verifying {len(todo)} instance(s); not benchmarked"
                )
                broken(todo, "not verified: out of time")
                break
            out = Path(tmp) / f"verify{attempt}.jsonl"
            log.append(
                f"verifying {len(todo)} {label} instance(s) (child process, {limit:.0f} s)\n"
            )
            try:
                proc = subprocess.run(
                    [*cmd, "--verify-kernels", ",".join(todo), "--verify-out", str(out)],
                    cwd=ROOT,
                    timeout=limit,
                    capture_output=True,
                    text=True,
                )
                log.append(proc.stdout)
                why = (
                    None
                    if proc.returncode == 0
                    else f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"
                )
            except subprocess.TimeoutExpired as e:
                log.append(_text(e.stdout))
                why = f"timed out after {limit:.0f} s"
                hangs += 1
            got, fails, done, current = read_progress(out)
            checks += got
            failures += fails
            if current is not None:
                failures.append(
                    f"{current}: its verification child failed on it ({why}); marked broken"
                )
                broken([current], why or "")
            rest = [n for n in todo if n not in done and n != current]
            if not rest:
                break
            if why is None or (not done and current is None) or hangs >= MAX_HANGS:  # do not retry
                why = why or "exit 0 without reporting them"
                failures.append(
                    f"{label}: verification child failed ({why}); "
                    f"{len(rest)} instance(s) marked broken"
                )
                broken(rest, why)
                break
            todo = rest
    return checks, failures, "".join(log)


def verify_in_children(
    kernels: list[TWKernel] | tuple[TWKernel, ...],
    failures: list[str],
    timeout_s: float = CHILD_TIMEOUT_S,
    child_cmd: list[str] | None = None,
    built: list[str] | None = None,
    budget: Budget | None = None,
) -> list[dict[str, Any]]:
    """Verify the instances in child processes, one (main loop, dtype) group per child, the
    groups concurrently: a kernel that faults (illegal address, trap) poisons only its child's
    CUDA context, and a hang or fault costs only the instance it hit (see
    :func:`_verify_group`). Each child's timeout is ``min(timeout_s, budget left)``.

    ``child_cmd`` (default: this module) gets ``--verify-kernels a,b --verify-out FILE``
    (plus ``--built x,y``, the parent's built instances in build order, when given) and
    appends :func:`child_loop`'s JSON lines there. Returns the check rows (``ok`` False for
    every instance not verified); failures are appended to ``failures``."""
    from concurrent.futures import ThreadPoolExecutor

    cmd = [*(child_cmd or CHILD_CMD), *(["--built", ",".join(built)] if built else [])]
    groups: dict[str, list[str]] = {}
    for k in kernels:
        groups.setdefault(f"{k.mainloop.value}/{k.dtype.value}", []).append(k.name)
    if not groups:
        return []
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        futures = {
            label: pool.submit(_verify_group, label, ns, cmd, timeout_s, budget)
            for label, ns in groups.items()
        }
        checks: list[dict[str, Any]] = []
        for label, fut in futures.items():
            got, fails, log = fut.result()
            print(log, end="", flush=True)
            print(f"{label}: {sum(c['ok'] for c in got)}/{len(got)} checks ok", flush=True)
            checks += got
            failures += fails
    return checks
