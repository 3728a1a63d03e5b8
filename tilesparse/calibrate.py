"""Calibration: the pruned layers' input statistics on representative inputs, and the
least-squares reconstruction of each layer's kept weights (SparseGPT-style, layer by layer).

Statistics are gathered with forward hooks, never by storing activations: for a layer of
``K`` inputs, the hook adds ``Xᵀ·X`` of each call's ``(rows, K)`` inputs into one ``(K, K)``
float64 Gram matrix ``H``. From it:

- activation-aware importance (Wanda, Sun et al. 2023): input ``k``'s norm ``‖x_k‖₂ =
  sqrt(H[k, k])`` (:func:`input_norms`);
- reconstruction: with ``W`` the dense ``(K, N)`` weight and ``R`` the kept rows of a group of
  output columns ``C`` sharing one row set (a TW tile; one column for EW / N:M), the kept
  weights minimise ``‖X·W[:, C] - X[:, R]·Ŵ‖²`` (the dense layer's outputs, on the same
  inputs) plus a damping ``λ‖Ŵ‖²``::

      Ŵ = (H[R, R] + λ·I)⁻¹ · H[R, :] · W[:, C]        λ = damping · mean(diag H)

  each group a small dense solve of ``|R|`` unknowns per column, on its own rows only, so the
  mask (which rows each tile keeps) never changes.

A calibration is a callable ``fn(model)`` that runs the model on representative inputs
(``lambda m: m.encode(sentences)``), or an iterable of positional-argument tuples, each run as
``model(*args)`` (materialised once: the layers are calibrated in several passes).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilesparse.format import tile_groups

log = logging.getLogger(__name__)

__all__ = [
    "Calibration",
    "CalibrationError",
    "InputStats",
    "LayerReconstruction",
    "ReconstructionTarget",
    "as_runner",
    "collect_inputs",
    "input_norms",
    "reconstruct",
    "reconstruct_layers",
    "reconstruction_error",
]

Calibration = Callable[[nn.Module], Any] | Iterable[tuple[Any, ...]]


class CalibrationError(ValueError):
    """A calibration that cannot be used: it raised, ran no pruned layer, or fed a layer
    non-finite inputs. The message names the layer."""


@dataclass
class InputStats:
    """One layer's inputs seen during calibration.

    Attributes:
        gram: ``(K, K) float64``, ``Σ Xᵀ·X`` over every call's ``(rows, K)`` inputs.
        rows: input rows seen (tokens × sentences, batch rows).
    """

    gram: torch.Tensor
    rows: int = 0


@dataclass(frozen=True)
class LayerReconstruction:
    """How well one layer's kept weights reproduce its dense outputs on the calibration
    inputs, as relative squared errors ``‖X·(W - Ŵ)‖² / ‖X·W‖²``.

    Attributes:
        fqn: the layer.
        masked_error: with the kept weights as they were (``W * mask``).
        reconstructed_error: after the least-squares reconstruction.
        rows: calibration input rows the layer saw.
    """

    fqn: str
    masked_error: float
    reconstructed_error: float
    rows: int


def as_runner(calibration: Calibration) -> Callable[[nn.Module], None]:
    """A function that runs ``model`` once over the calibration inputs.

    Raises:
        CalibrationError: for something neither callable nor an iterable of tuples, or an
            empty iterable.
    """
    if callable(calibration):
        fn = calibration

        def run_callable(model: nn.Module) -> None:
            fn(model)

        return run_callable
    if isinstance(calibration, str | bytes) or not isinstance(calibration, Iterable):
        raise CalibrationError(
            f"calibration must be a callable fn(model) or an iterable of argument tuples, got "
            f"{type(calibration).__name__}"
        )
    batches = list(calibration)
    if not batches:
        raise CalibrationError("calibration is an empty iterable: no inputs to run")
    for i, b in enumerate(batches):
        if not isinstance(b, tuple):
            raise CalibrationError(
                f"calibration[{i}] must be a tuple of positional arguments for model(*args), "
                f"got {type(b).__name__}"
            )

    def run_batches(model: nn.Module) -> None:
        for args in batches:
            model(*args)

    return run_batches


def _run_quietly(model: nn.Module, run: Callable[[nn.Module], None]) -> None:
    """``run(model)`` in eval mode without gradients, every module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            run(model)
    finally:
        for m, mode in modes:
            m.training = mode


def _in_features(fqn: str, m: nn.Module) -> int:
    k = getattr(m, "in_features", None)
    if not isinstance(k, int):
        raise CalibrationError(f"layer {fqn!r} has no integer in_features: not a linear layer")
    return k


def collect_inputs(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    run: Callable[[nn.Module], None],
) -> tuple[dict[str, InputStats], list[str]]:
    """Run the calibration once with a hook on each of ``layers`` accumulating its Gram.

    Args:
        model: the model the calibration runs.
        layers: fqn → linear layer (``in_features`` ``K``) of ``model``.
        run: from :func:`as_runner`.

    Returns:
        ``(stats, order)``: per layer its :class:`InputStats`; the layers in the order of
        their first call.

    Raises:
        CalibrationError: when the calibration raises (naming the last pruned layer entered),
            a layer never runs, or a layer's input is not finite (naming the layer).
    """
    stats = {
        f: InputStats(torch.zeros(_in_features(f, m), _in_features(f, m), dtype=torch.float64))
        for f, m in layers.items()
    }
    order: list[str] = []

    def hook_for(fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if fqn not in order:
                order.append(fqn)
            x = args[0].detach()
            st = stats[fqn]
            if x.shape[-1] != st.gram.shape[0]:
                raise CalibrationError(
                    f"calibration fed layer {fqn!r} inputs of {x.shape[-1]} features, it takes "
                    f"{st.gram.shape[0]}"
                )
            x2 = x.reshape(-1, x.shape[-1]).to(device="cpu", dtype=torch.float64)
            if not bool(torch.isfinite(x2).all()):
                raise CalibrationError(
                    f"calibration fed layer {fqn!r} a non-finite input (NaN or inf): "
                    f"{int((~torch.isfinite(x2)).sum())} of {x2.numel()} values"
                )
            st.gram.addmm_(x2.T, x2)
            st.rows += x2.shape[0]

        return hook

    handles = [m.register_forward_pre_hook(hook_for(f)) for f, m in layers.items()]
    try:
        _run_quietly(model, run)
    except CalibrationError:
        raise
    except Exception as e:
        last = repr(order[-1]) if order else "none yet"
        raise CalibrationError(
            f"the calibration raised {type(e).__name__}: {e} (last pruned layer entered: {last})"
        ) from e
    finally:
        for h in handles:
            h.remove()
    missing = [f for f in layers if stats[f].rows == 0]
    if missing:
        raise CalibrationError(
            f"the calibration never ran pruned layer(s) {missing}: it must run the model "
            f"through every layer it prunes (or leave those out with filter_fn)"
        )
    for f, st in stats.items():
        if not bool(torch.isfinite(st.gram).all()):
            raise CalibrationError(f"layer {f!r}: its inputs' Gram matrix overflowed (inf)")
    return stats, order


def input_norms(stats: InputStats) -> torch.Tensor:
    """``(K,) float32``: each input's norm ``‖x_k‖₂`` over the calibration rows."""
    return stats.gram.diagonal().clamp_min(0).sqrt().float()


def _damped(gram: torch.Tensor, damping: float) -> tuple[torch.Tensor, float]:
    """``(H, λ)``: ``H`` with a unit diagonal for inputs that were always zero (their weights
    then solve to 0), and ``λ = damping · mean(diag H)``."""
    h = gram.clone()
    diag = h.diagonal()
    dead = diag <= 0
    diag[dead] = 1.0
    return h, damping * float(diag.mean())


def reconstruct(
    weight_kn: torch.Tensor, mask_kn: torch.Tensor, gram: torch.Tensor, damping: float = 0.01
) -> torch.Tensor:
    """The kept weights that best reproduce the dense layer's outputs (module docstring).

    Args:
        weight_kn: ``(K, N)`` the dense weight ``W``.
        mask_kn: ``(K, N) bool``, the kept entries; columns sharing one row set are solved
            together (a TW tile is one solve).
        gram: ``(K, K)``, ``H = Σ Xᵀ·X``.
        damping: ``λ / mean(diag H)``, >= 0.

    Returns:
        ``(K, N)`` in ``weight_kn.dtype``, zero wherever ``mask_kn`` is False.

    Raises:
        ValueError: for mismatched shapes or a negative damping.
    """
    k, n = weight_kn.shape
    if tuple(mask_kn.shape) != (k, n) or tuple(gram.shape) != (k, k):
        raise ValueError(
            f"reconstruct: weight {tuple(weight_kn.shape)}, mask {tuple(mask_kn.shape)} and "
            f"gram {tuple(gram.shape)} must be (K, N), (K, N) and (K, K)"
        )
    if not (math.isfinite(damping) and damping >= 0):
        raise ValueError(f"reconstruct: damping must be finite and >= 0, got {damping!r}")
    h, lam = _damped(gram.double().cpu(), damping)
    w = weight_kn.detach().double().cpu()
    out = torch.zeros_like(w)
    # tile_groups with tile=N: consecutive columns with one row set, however many
    for cols, rows in tile_groups(mask_kn.cpu(), max(1, n)):
        if rows.numel() == 0:
            continue
        c = torch.tensor(cols)
        a = h[rows][:, rows]
        a.diagonal().add_(lam)
        b = h[rows] @ w[:, c]
        out[rows.unsqueeze(1), c.unsqueeze(0)] = _solve_psd(a, b)
    return out.to(weight_kn.dtype)


def _solve_psd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a⁻¹·b`` for a symmetric positive semi-definite ``a``: Cholesky, or least squares
    when ``a`` is singular (no damping and dependent inputs)."""
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(b, chol)
    return torch.linalg.lstsq(a, b, driver="gelsd").solution


def reconstruction_error(
    weight_kn: torch.Tensor, approx_kn: torch.Tensor, gram: torch.Tensor
) -> float:
    """``‖X·(W - Ŵ)‖² / ‖X·W‖²`` from the Gram: ``tr(Dᵀ H D) / tr(Wᵀ H W)``."""
    h = gram.double()
    w = weight_kn.double()
    d = w - approx_kn.double()
    den = float((w * (h @ w)).sum())
    return float((d * (h @ d)).sum()) / den if den > 0 else 0.0


@dataclass(frozen=True)
class ReconstructionTarget:
    """One pruned layer to reconstruct.

    Attributes:
        fqn: its name in the model.
        module: the layer (the calibration's hook goes on it).
        original: ``(N, K)`` the stored weight the forward pass reads (times ``mask_nk``),
            overwritten in place.
        mask_nk: ``(N, K) bool``, the kept entries.
        dense_nk: ``(N, K)`` the dense weight whose outputs are reproduced.
    """

    fqn: str
    module: nn.Module
    original: torch.Tensor
    mask_nk: torch.Tensor
    dense_nk: torch.Tensor


@torch.no_grad()
def reconstruct_layers(
    model: nn.Module,
    targets: Sequence[ReconstructionTarget],
    first: InputStats,
    run: Callable[[nn.Module], None],
    damping: float,
    progress: bool = False,
) -> list[LayerReconstruction]:
    """Reconstruct ``targets`` one after the other: each layer's inputs are gathered with the
    layers before it already reconstructed (the first one's are ``first``), then its kept
    weights are refitted (:func:`reconstruct`) and written into ``original``.

    Raises:
        CalibrationError: as :func:`collect_inputs`, or when a solve is not finite.
    """
    from tqdm.auto import tqdm

    out = []
    for i, t in enumerate(tqdm(targets, desc="reconstruct", unit="layer", disable=not progress)):
        st = first if i == 0 else collect_inputs(model, {t.fqn: t.module}, run)[0][t.fqn]
        mask_kn = t.mask_nk.T.cpu()
        w_kn = t.dense_nk.T.cpu()
        new_kn = reconstruct(w_kn, mask_kn, st.gram, damping)
        if not bool(torch.isfinite(new_kn).all()):
            raise CalibrationError(f"layer {t.fqn!r}: the reconstruction is not finite")
        rec = LayerReconstruction(
            t.fqn,
            reconstruction_error(w_kn, w_kn * mask_kn, st.gram),
            reconstruction_error(w_kn, new_kn, st.gram),
            st.rows,
        )
        t.original.copy_(new_kn.T.to(t.original.device, t.original.dtype) * t.mask_nk)
        out.append(rec)
        log.info(
            "tilesparse: reconstructed %s: relative output error %.4g -> %.4g",
            t.fqn,
            rec.masked_error,
            rec.reconstructed_error,
        )
    return out
