"""What ``Backend.AUTO`` runs on a CPU tensor: the TW kernel or a dense GEMM, whichever is faster.

The TW kernel (:mod:`tilesparse.kernels.cpu`) skips the pruned weights, but pays per call for
gathering and packing what it keeps; a dense GEMM (``torch.addmm`` on the layer's dense weight,
pruned entries zero) pays for every weight but runs on the vendor library (MKL, oneDNN with
AMX or AVX512-BF16). Which wins depends on the layer's shape and density, the dtype, the batch
and the CPU: on an AMX Xeon the bf16 TW kernel ran at 0.51–0.79× of dense on layers of
512–1024 features (``docs/benchmarks.md``), on a Zen 4 at 1.45–11× everywhere. AUTO therefore
**measures** the crossover once per layer signature and batch range, on the machine itself::

    AutoKey   K, N, dtype, kept columns, tiles, nnz     the layer's structure
              threads, batch range [2^(b-1), 2^b)       how it is called
       │
       ├─ in the table (this process, or the machine's file)  → its Route
       └─ not yet: the call itself is the calibration run: TW and dense alternate on the
          real input, up to MAX_ROUNDS rounds or CALIBRATION_BUDGET_S (at least 2 rounds);
          TW is chosen when its fastest call is MARGIN times faster than dense's, else dense.

Both routes compute the same ``Y = X·W + b`` (the dense weight holds exactly the kept values),
so the choice changes speed only, and rounding within the ``tw_gemm`` tolerances.

The table of a machine is kept in one JSON file::

    $XDG_CACHE_HOME/tilerec/tilesparse_auto/<hash of CPU flags, torch, kernel build>.json

(``~/.cache`` by default; ``TILESPARSE_AUTO_CACHE`` names another folder, ``0`` keeps the table
in memory only). ``TILESPARSE_AUTO_ROUTE=tw|dense`` forces one route (reproducible numerics,
benchmarks of one route). The dense weight is built once per set of layout tensors and dtype
(:class:`~tilesparse.kernels.cache.LayoutCache`), again after a tensor is replaced or edited in
place; it costs ``K·N`` elements more memory, and is kept only for layers that chose dense.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import torch

from extbuild import cpu_identity
from tilesparse.kernels.cache import LayoutCache
from tilesparse.kernels.cpu import build_dir, cpu_kernel_available, tw_linear_cpu
from tilesparse.kernels.schema import op_layout

__all__ = [
    "AUTO_CACHE_ENV",
    "AUTO_ROUTE_ENV",
    "CALIBRATION_BUDGET_S",
    "MARGIN",
    "MAX_ROUNDS",
    "AutoDecision",
    "AutoKey",
    "CrossoverTable",
    "Route",
    "auto_key",
    "auto_linear_cpu",
    "batch_range",
    "calibrate",
    "crossover_table",
    "dense_weight_cpu",
    "forced_route",
]

log = logging.getLogger(__name__)

AUTO_CACHE_ENV = "TILESPARSE_AUTO_CACHE"
AUTO_ROUTE_ENV = "TILESPARSE_AUTO_ROUTE"
# TW must measure this much faster than dense to be chosen, so that a tie blurred by timing
# noise falls on the dense side (AUTO then runs at ~1.0x of dense); the price is at most 10 % of
# the gain where TW wins narrowly.
MARGIN = 1.10
# The calibration call runs at most this many (TW, dense) rounds, and stops after 2 once it has
# spent CALIBRATION_BUDGET_S: a 4096-row 4096×4096 fp32 layer (~1 s dense on 2 cores) pays two
# rounds once, a 4096-row 512×256 layer (a few ms) up to five.
MAX_ROUNDS = 5
CALIBRATION_BUDGET_S = 0.05
_TABLE_VERSION = 1


class Route(StrEnum):
    """What an AUTO call runs on a CPU tensor."""

    TW = "tw"
    DENSE = "dense"


def batch_range(m: int) -> tuple[int, int]:
    """The batch range ``[lo, hi)`` of ``m`` rows that shares one decision: powers of two
    (``m = 4096`` → ``[4096, 8192)``, ``m = 1`` → ``[1, 2)``, ``m = 0`` → ``[0, 1)``)."""
    if m < 0:
        raise ValueError(f"a batch has >= 0 rows, got {m}")
    if m == 0:
        return 0, 1
    lo = 1 << (m.bit_length() - 1)
    return lo, 2 * lo


@dataclass(frozen=True)
class AutoKey:
    """The signature one decision is measured for (see the module docstring).

    Attributes:
        in_features, out_features: ``K``, ``N``.
        dtype: ``x``'s dtype name (``"float32"``, ``"bfloat16"``, ...).
        kept_columns, tiles, nnz: the layout's ``len(col_idx)``, ``T``, ``len(values)``.
        threads: ``torch.get_num_threads()`` at the call.
        batch_lo: the lower end of the call's :func:`batch_range`.
    """

    in_features: int
    out_features: int
    dtype: str
    kept_columns: int
    tiles: int
    nnz: int
    threads: int
    batch_lo: int

    def text(self) -> str:
        """The key as one line (the table file's keys)."""
        return (
            f"K={self.in_features} N={self.out_features} {self.dtype} cols={self.kept_columns} "
            f"tiles={self.tiles} nnz={self.nnz} threads={self.threads} batch>={self.batch_lo}"
        )


@dataclass(frozen=True)
class AutoDecision:
    """One measured choice.

    Attributes:
        route: what AUTO runs for the key.
        tw_s, dense_s: the fastest calibration call of each route, seconds.
        rounds: the (TW, dense) rounds timed.
    """

    route: Route
    tw_s: float
    dense_s: float
    rounds: int

    @property
    def tw_speedup(self) -> float:
        """``dense_s / tw_s``: what TW measured against dense (> MARGIN where TW is chosen)."""
        return self.dense_s / self.tw_s if self.tw_s > 0 else float("inf")


def forced_route() -> Route | None:
    """The route ``TILESPARSE_AUTO_ROUTE`` forces, or ``None`` (unset or empty).

    Raises:
        ValueError: naming the bad value and the accepted ones.
    """
    v = os.environ.get(AUTO_ROUTE_ENV, "").strip().lower()
    if not v:
        return None
    try:
        return Route(v)
    except ValueError:
        raise ValueError(
            f"{AUTO_ROUTE_ENV}={v!r}; expected 'tw', 'dense' or empty (measure)"
        ) from None


@functools.lru_cache(maxsize=1)
def _machine_hash() -> str:
    """What makes one machine's measurements another's: the CPU's flags, torch, the kernel's
    build (its sources and flags; a constant of the process, hence cached)."""
    h = hashlib.sha256()
    for part in (cpu_identity(), torch.__version__, build_dir().name):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _machine_file() -> Path | None:
    """The table file of this machine, or ``None`` when ``TILESPARSE_AUTO_CACHE=0`` (read on
    every lookup, so a changed setting takes effect at once)."""
    return _table_path(
        os.environ.get(AUTO_CACHE_ENV, "").strip(), os.environ.get("XDG_CACHE_HOME", "")
    )


@functools.lru_cache(maxsize=8)
def _table_path(setting: str, xdg_cache_home: str) -> Path | None:
    if setting == "0":
        return None
    if setting:
        base = Path(setting)
    else:
        base = Path(xdg_cache_home or Path.home() / ".cache") / "tilerec" / "tilesparse_auto"
    return base / f"{_machine_hash()}.json"


class CrossoverTable:
    """The decisions of this machine, by :class:`AutoKey`: in memory, and in the machine's
    file (read once, when the first key is looked up; rewritten whole after each measurement,
    through a temporary file, so a reader never sees half a table)."""

    def __init__(self) -> None:
        self._decisions: dict[AutoKey, AutoDecision] = {}
        self._loaded_from: Path | None = None
        self._loaded = False

    def _load(self) -> None:
        path = _machine_file()
        if self._loaded and path == self._loaded_from:
            return
        self._loaded, self._loaded_from = True, path
        if path is None or not path.exists():
            return
        try:
            doc = json.loads(path.read_text())
            if doc.get("version") != _TABLE_VERSION:
                log.warning("tilesparse: AUTO table %s has another version; ignored", path)
                return
            for row in doc["decisions"]:
                key = AutoKey(**row["key"])
                d = row["decision"]
                self._decisions.setdefault(
                    key, AutoDecision(Route(d["route"]), d["tw_s"], d["dense_s"], d["rounds"])
                )
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("tilesparse: AUTO table %s unreadable (%s); measuring again", path, e)

    def get(self, key: AutoKey) -> AutoDecision | None:
        """The decision of ``key``, or ``None`` when it is not measured yet."""
        self._load()
        return self._decisions.get(key)

    def put(self, key: AutoKey, decision: AutoDecision) -> None:
        """Record ``decision`` (in memory; in the machine's file unless it is off)."""
        self._load()
        self._decisions[key] = decision
        path = self._loaded_from
        if path is None:
            return
        rows = [
            {"key": asdict(k), "text": k.text(), "decision": asdict(d)}
            for k, d in self._decisions.items()
        ]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": _TABLE_VERSION, "decisions": rows}, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("tilesparse: AUTO table %s not written (%s); kept in memory", path, e)

    def clear(self) -> None:
        """Forget every decision held in memory (the file is read again on the next lookup)."""
        self._decisions.clear()
        self._loaded = False
        self._loaded_from = None

    def __len__(self) -> int:
        return len(self._decisions)


def calibrate(
    run_tw: Callable[[], torch.Tensor],
    run_dense: Callable[[], torch.Tensor],
    budget_s: float = CALIBRATION_BUDGET_S,
    max_rounds: int = MAX_ROUNDS,
) -> tuple[torch.Tensor, AutoDecision]:
    """Time the two routes alternately on the same input and choose.

    Args:
        run_tw, run_dense: compute the call's result by each route.
        budget_s: stop after the round in which this much time is spent (at least 2 rounds).
        max_rounds: the most rounds.

    Returns:
        the last result computed (either route's: they agree within the ``tw_gemm``
        tolerances) and the decision (TW when its fastest call is :data:`MARGIN` times faster).
    """
    tw_s, dense_s = float("inf"), float("inf")
    start = time.perf_counter()
    y = run_tw()
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        t0 = time.perf_counter()
        y = run_tw()
        t1 = time.perf_counter()
        y = run_dense()
        t2 = time.perf_counter()
        tw_s, dense_s = min(tw_s, t1 - t0), min(dense_s, t2 - t1)
        if rounds >= 2 and t2 - start >= budget_s:
            break
    route = Route.TW if tw_s * MARGIN <= dense_s else Route.DENSE
    return y, AutoDecision(route, tw_s, dense_s, rounds)


# The dense (K, N) weight of a layout, anchored on ``values``; keyed by dtype.
_DENSE: LayoutCache[torch.Tensor] = LayoutCache()


def dense_weight_cpu(
    tensors: tuple[torch.Tensor, ...], in_features: int, out_features: int, keep: bool = True
) -> torch.Tensor:
    """``(in_features, out_features)`` dense weight of the op's CPU layout tensors
    (``col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr``) in ``values``' dtype, pruned
    entries zero, contiguous.

    Args:
        tensors: the layout tensors (CPU).
        in_features, out_features: ``K``, ``N``.
        keep: record it for the next calls of this set of tensors (until one is replaced or
            edited in place); ``False`` builds it without recording (a calibration whose
            layer may choose TW, which then never holds the copy).

    Returns:
        ``(K, N)`` in ``values.dtype``.
    """
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = tensors

    def build() -> torch.Tensor:
        with torch.no_grad():
            return op_layout(in_features, out_features, tensors).to_dense().contiguous()

    if not keep:
        return build()
    return _DENSE.get(
        (values, col_idx, tile_ptr, row_idx, row_ptr, val_ptr),
        (in_features, out_features),
        str(values.dtype),
        build,
    )


def remember_dense_weight(
    tensors: tuple[torch.Tensor, ...], in_features: int, out_features: int, w: torch.Tensor
) -> torch.Tensor:
    """Record ``w`` (built by :func:`dense_weight_cpu` with ``keep=False``) as the dense
    weight of ``tensors``; returns the recorded weight."""
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = tensors
    return _DENSE.get(
        (values, col_idx, tile_ptr, row_idx, row_ptr, val_ptr),
        (in_features, out_features),
        str(values.dtype),
        lambda: w,
    )


# This process's view of the machine's table (the file is the shared copy).
_TABLE = CrossoverTable()


def crossover_table() -> CrossoverTable:
    """The table AUTO reads and fills (one per process, backed by the machine's file)."""
    return _TABLE


def auto_key(
    tensors: tuple[torch.Tensor, ...],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    batch: int,
    threads: int | None = None,
) -> AutoKey:
    """The :class:`AutoKey` of a call of ``batch`` rows in ``dtype`` on the layout tensors
    (``col_idx .. val_ptr``), at ``threads`` (default: ``torch.get_num_threads()``). Reads
    sizes only, never tensor data."""
    col_idx, tile_ptr, _, _, values, _ = tensors
    return AutoKey(
        in_features=in_features,
        out_features=out_features,
        dtype=str(dtype).removeprefix("torch."),
        kept_columns=int(col_idx.numel()),
        tiles=int(tile_ptr.numel()) - 1,
        nnz=int(values.numel()),
        threads=torch.get_num_threads() if threads is None else threads,
        batch_lo=batch_range(batch)[0],
    )


def _dense_call(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ w if bias is None else torch.addmm(bias, x, w)


def _fixed_route(m: int, cacheable: bool) -> Route | None:
    """The route that needs no measurement: forced by the environment, dense without the
    compiled kernel, TW for an empty batch or uncacheable tensors; ``None`` otherwise."""
    forced = forced_route()
    if not cpu_kernel_available():
        return Route.DENSE
    if forced is None and (m == 0 or not cacheable):
        return Route.TW
    return forced


def auto_linear_cpu(
    x: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``Y = X · W + b`` by the route the machine's table chooses (module docstring).

    Args:
        x: ``(M, K)`` contiguous CPU activations; ``tensors`` (``col_idx, tile_ptr, row_idx,
            row_ptr, values, val_ptr``), ``bias`` and ``out_features`` as in the op schema,
            already checked by ``check_op_inputs``.

    Returns:
        ``(M, N)`` in ``x.dtype``.

    Without the compiled kernel the route is dense (it is always faster than the reference).
    Layout tensors made under ``torch.inference_mode`` have no version counter, so a dense
    weight could not be cached for them: they take the TW kernel without measuring.
    """
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = tensors
    K, M = x.shape[1], x.shape[0]
    cacheable = not values.is_inference()

    def run_tw() -> torch.Tensor:
        y = tw_linear_cpu(
            x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features
        )
        if y is None:  # cpu_kernel_available() said it loaded, and a load is kept
            raise RuntimeError("tilesparse: the compiled CPU kernel is not loaded")
        return y

    route = _fixed_route(M, cacheable)
    if route is None:
        key = auto_key(tensors, K, out_features, x.dtype, M)
        known = _TABLE.get(key)
        if known is None:
            w = dense_weight_cpu(tensors, K, out_features, keep=False)
            y, decision = calibrate(run_tw, functools.partial(_dense_call, x, w, bias))
            _TABLE.put(key, decision)
            if decision.route is Route.DENSE:
                remember_dense_weight(tensors, K, out_features, w)
            log.info(
                "tilesparse AUTO: %s -> %s (TW %.3g ms, dense %.3g ms, %d rounds)",
                key.text(),
                decision.route.value,
                1e3 * decision.tw_s,
                1e3 * decision.dense_s,
                decision.rounds,
            )
            return y
        route = known.route
    if route is Route.TW:
        return run_tw()
    return _dense_call(x, dense_weight_cpu(tensors, K, out_features, keep=cacheable), bias)
