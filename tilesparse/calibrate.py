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
  inputs) plus a damping ``λ‖Ŵ - W[R, C]‖²`` that pulls them toward the kept weights as they
  were::

      Ŵ = (H[R, R] + λ·I)⁻¹ · (H[R, :] · W[:, C] + λ·W[R, C])      λ = damping · mean(diag H)

  each group a small dense solve of ``|R|`` unknowns per column, on its own rows only, so the
  mask (which rows each tile keeps) never changes. The ridge toward the kept weights rather
  than toward zero matters when the calibration spans few directions (a few dozen similar
  sentences: fewer token vectors than inputs, or nearly so): along the directions its inputs
  never take the weights stay as they were instead of shrinking to zero, so text unlike the
  calibration's meets the plain masked layer there. On MiniLM with 64 templated sentences
  (2:4, cosine to dense on news text) a ridge toward zero gave 0.733, below the uncalibrated
  prune's 0.768, and this one 0.834 (docs/benchmarks.md).

A calibration is a callable ``fn(model)`` that runs the model on representative inputs
(``lambda m: m.encode(sentences)``), or an iterable of positional-argument tuples, each run as
``model(*args)`` (materialised once: the layers are calibrated in several passes).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilesparse.config import Importance
from tilesparse.format import tile_groups

log = logging.getLogger(__name__)

__all__ = [
    "Calibration",
    "CalibrationError",
    "HOLD_OUT",
    "InputStats",
    "LayerReconstruction",
    "OutputCheck",
    "as_runner",
    "collect_inputs",
    "held_out_outputs",
    "output_error",
    "input_norms",
    "reconstruct",
    "reconstruction_error",
]

Calibration = Callable[[nn.Module], Any] | Iterable[tuple[Any, ...]]


class CalibrationError(ValueError):
    """A calibration that cannot be used: it raised, ran no pruned layer, or fed a layer
    non-finite inputs. The message names the layer."""


# Every HOLD_OUT-th calibration sample is held out of the fit: the reconstruction and the
# per-layer choices are judged on those samples only (1 in 4: enough held-out rows to rank a
# few candidates, three quarters left to fit).
HOLD_OUT = 4


@dataclass
class InputStats:
    """One layer's inputs seen during calibration, split into fit and held-out samples.

    A *sample* is one entry along the input's first dimension when the input has three or
    more dimensions (a sentence of ``(batch, tokens, K)``), else one row of ``(rows, K)``;
    samples are numbered across the calibration's calls and every :data:`HOLD_OUT`-th one
    goes to ``held``.

    Attributes:
        gram: ``(K, K) float64``, ``Σ Xᵀ·X`` over the fit samples' ``(rows, K)`` inputs.
        rows: input rows (token vectors, batch rows) in ``gram``.
        held: ``(K, K) float64``, the same over the held-out samples.
        held_rows: input rows in ``held``.
        sums: ``(K,) float64``, ``Σ X`` over the fit rows (the bias refit's constant input).
        held_sums: the same over the held-out rows.
    """

    gram: torch.Tensor
    rows: int = 0
    held: torch.Tensor | None = None
    held_rows: int = 0
    samples: int = 0
    sums: torch.Tensor | None = None
    held_sums: torch.Tensor | None = None

    @property
    def sum_vector(self) -> torch.Tensor:
        """``(K,)`` ``Σ X`` over the fit rows."""
        return self.sums if self.sums is not None else torch.zeros(self.gram.shape[0]).double()

    @property
    def held_sum_vector(self) -> torch.Tensor:
        """``(K,)`` ``Σ X`` over the held-out rows (the fit rows' when none was held out)."""
        if self.held_sums is not None and self.held_rows > 0:
            return self.held_sums
        return self.sum_vector

    @property
    def held_count(self) -> int:
        """Rows behind :attr:`held_gram`."""
        return self.held_rows if self.held_rows > 0 else self.rows

    @property
    def total_sum(self) -> torch.Tensor:
        """``(K,)`` ``Σ X`` over every row."""
        if self.held_sums is None:
            return self.sum_vector
        return self.sum_vector + self.held_sums

    @property
    def held_gram(self) -> torch.Tensor:
        """``held`` (the fit ``gram`` when no sample was held out)."""
        return self.held if self.held is not None and self.held_rows > 0 else self.gram

    @property
    def total(self) -> torch.Tensor:
        """``(K, K)`` the Gram of every sample, fit and held out."""
        return self.gram if self.held is None else self.gram + self.held

    def add(self, x: torch.Tensor) -> None:
        """Accumulate one call's inputs ``x: (..., K)`` (any float dtype, any device)."""
        k = self.gram.shape[0]
        per = x.reshape(x.shape[0], -1, k) if x.dim() >= 3 else x.reshape(-1, 1, k)
        idx = torch.arange(self.samples, self.samples + per.shape[0])
        self.samples += per.shape[0]
        held = (idx % HOLD_OUT) == HOLD_OUT - 1
        for part, sel in ((False, ~held), (True, held)):
            rows = per[sel.to(per.device)].reshape(-1, k).to(device="cpu", dtype=torch.float64)
            if rows.shape[0] == 0:
                continue
            if part:
                if self.held is None:
                    self.held = torch.zeros_like(self.gram)
                self.held.addmm_(rows.T, rows)
                self.held_rows += rows.shape[0]
                self.held_sums = rows.sum(0) + (0 if self.held_sums is None else self.held_sums)
            else:
                self.gram.addmm_(rows.T, rows)
                self.rows += rows.shape[0]
                self.sums = rows.sum(0) + (0 if self.sums is None else self.sums)


@dataclass(frozen=True)
class LayerReconstruction:
    """What a calibrated prune did to one layer, and how well its weights reproduce the dense
    layer's outputs, as relative squared errors ``‖X·(W - Ŵ)‖² / ‖X·W‖²`` on the fit
    samples' inputs ``X`` and on the held-out samples' (see :mod:`tilesparse.refit`).

    Attributes:
        fqn: the layer.
        masked_error: fit samples, the chosen mask's kept weights as they were (``W * mask``).
        reconstructed_error: fit samples, after the least-squares reconstruction.
        rows: fit input rows the layer saw.
        held_out_rows: held-out input rows.
        held_out_masked_error: held-out samples, ``W * mask``.
        held_out_reconstructed_error: held-out samples, reconstructed.
        held_out_magnitude_error: held-out samples, the uncalibrated (magnitude) mask at the
            same sparsity, not reconstructed: what the layer would have been without
            calibration.
        accepted: whether the reconstruction was kept (it lowered the held-out error).
        damping: the reconstruction's ridge, ``λ / mean(diag H)``.
        importance: the score the chosen mask came from; ``None`` for SparseGPT's
            (:mod:`tilesparse.obs`: mask and weights chosen together, ``damping`` its ridge).
        column_share: the chosen mask's TW column share (``None`` for other patterns).
        neurons_with: the other layer of a neuron pair (:mod:`tilesparse.neurons`): the
            layer's errors are then its own outputs', the pair is judged at the second's.
    """

    fqn: str
    masked_error: float
    reconstructed_error: float
    rows: int
    held_out_rows: int = 0
    held_out_masked_error: float = float("nan")
    held_out_reconstructed_error: float = float("nan")
    held_out_magnitude_error: float = float("nan")
    accepted: bool = True
    damping: float = 0.0
    importance: Importance | None = None
    column_share: float | None = None
    neurons_with: str | None = None

    @property
    def held_out_error(self) -> float:
        """The held-out error of the weights the layer was left with."""
        if self.accepted:
            return self.held_out_reconstructed_error
        return self.held_out_masked_error


@dataclass(frozen=True)
class OutputCheck:
    """A calibrated prune's last check: the relative squared error ``‖Y - Y_dense‖² /
    ‖Y_dense‖²`` of the last pruned layer's outputs on the held-out samples (everything
    before it pruned), calibrated and uncalibrated; the calibrated weights are kept only when
    they are not worse.

    Attributes:
        layer: the layer whose outputs are compared.
        calibrated_error: with the calibrated masks and weights.
        uncalibrated_error: with the uncalibrated prune's (magnitude masks, dense weights).
        calibrated_kept: whether the model keeps the calibrated prune.
    """

    layer: str
    calibrated_error: float
    uncalibrated_error: float
    calibrated_kept: bool


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
            if not bool(torch.isfinite(x).all()):
                raise CalibrationError(
                    f"calibration fed layer {fqn!r} a non-finite input (NaN or inf): "
                    f"{int((~torch.isfinite(x)).sum())} of {x.numel()} values"
                )
            st.add(x)

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
    missing = [f for f in layers if stats[f].rows + stats[f].held_rows == 0]
    if missing:
        raise CalibrationError(
            f"the calibration never ran pruned layer(s) {missing}: it must run the model "
            f"through every layer it prunes (or leave those out with filter_fn)"
        )
    for f, st in stats.items():
        if not bool(torch.isfinite(st.total).all()):
            raise CalibrationError(f"layer {f!r}: its inputs' Gram matrix overflowed (inf)")
    return stats, order


def input_norms(stats: InputStats) -> torch.Tensor:
    """``(K,) float32``: each input's norm ``‖x_k‖₂`` over every calibration row."""
    return stats.total.diagonal().clamp_min(0).sqrt().float()


def _damped(gram: torch.Tensor, damping: float) -> tuple[torch.Tensor, float]:
    """``(H, λ)``: ``H`` with a unit diagonal for inputs that were always zero (their kept
    weights then solve to themselves: no evidence moves them), and ``λ = damping · mean(diag
    H)``."""
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
        kept = w[rows.unsqueeze(1), c.unsqueeze(0)]
        # solved for the change from the kept weights: the same Ŵ for λ > 0, and with no
        # damping and dependent inputs the least-norm change, never a move along directions
        # the inputs do not take
        rhs = h[rows] @ w[:, c] + lam * kept - a @ kept
        out[rows.unsqueeze(1), c.unsqueeze(0)] = kept + _solve_psd(a, rhs)
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


def held_out_outputs(
    model: nn.Module, fqn: str, module: nn.Module, run: Callable[[nn.Module], None]
) -> torch.Tensor:
    """``(rows, N) float64``: layer ``fqn`` (``module``)'s outputs on the held-out samples (numbered as
    :class:`InputStats` numbers them) of one calibration run."""
    parts: list[torch.Tensor] = []
    count = [0]

    def hook(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        y = out.detach()
        if not bool(torch.isfinite(y).all()):
            raise CalibrationError(
                f"layer {fqn!r} gave non-finite outputs (NaN or inf) during the calibration"
            )
        per = (
            y.reshape(y.shape[0], -1, y.shape[-1])
            if y.dim() >= 3
            else y.reshape(-1, 1, y.shape[-1])
        )
        idx = torch.arange(count[0], count[0] + per.shape[0])
        count[0] += per.shape[0]
        held = ((idx % HOLD_OUT) == HOLD_OUT - 1).to(per.device)
        if count[0] < HOLD_OUT:  # too few samples to hold any out: all of them
            held = torch.ones_like(held)
        parts.append(per[held].reshape(-1, y.shape[-1]).to("cpu", torch.float64))

    handle = module.register_forward_hook(hook)
    try:
        _run_quietly(model, run)
    finally:
        handle.remove()
    return torch.cat(parts) if parts else torch.zeros(0, 0, dtype=torch.float64)


def output_error(outputs: torch.Tensor, reference: torch.Tensor) -> float:
    """``‖outputs - reference‖² / ‖reference‖²`` (0 for an empty or zero reference)."""
    den = float(reference.pow(2).sum())
    if outputs.shape != reference.shape:
        raise CalibrationError(
            f"the calibration ran differently twice: outputs {tuple(outputs.shape)} against "
            f"{tuple(reference.shape)}; it must run the same inputs every time"
        )
    return float((outputs - reference).pow(2).sum()) / den if den > 0 else 0.0
