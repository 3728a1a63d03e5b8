"""The pruner: masks on any model's ``nn.Linear`` layers, updated on a schedule, then
compressed into :class:`~tilesparse.linear.TileSparseLinear`.

Life of a pruned model::

    pruner = TileSparsePruner(TileSparseConfig(pattern="tw", sparsity=0.75, tile=128,
                              schedule=MultiStageSchedule(steps_per_stage=200)))
    pruner.prepare(model)          # a mask parametrization on each selected layer
    trainer.rebuild_optimizer()    # (the weights now live at ...parametrizations.weight.original)
    trainer.add_callback(pruner.callback(step_offset=trainer.step))  # the schedule starts now
    trainer.fit(batches, steps)    # masks follow the schedule; pruned weights stay exactly 0
    pruner.compress()              # each pruned nn.Linear → TileSparseLinear (inference only)

or in one call, pruning to the target now: ``tilesparse.prune_(model, config, filter_fn)``.

Masks are ``torch.nn.utils.parametrize`` parametrizations: ``layer.weight`` is computed as
``original * mask``, so the forward pass sees zeros at pruned positions and gradients reach the
kept weights only (``original.grad = grad · mask``). What holds, with any optimizer (SGD
momentum and weight decay move ``original`` even where the gradient is 0):

- after each mask update and after each :meth:`TileSparsePruner.step` (the callback calls it
  right after ``optimizer.step()``), ``original`` is 0 wherever the mask is 0, so the forward
  pass, the model's ``state_dict`` and a checkpoint hold exact zeros at pruned positions;
- masks are recomputed from the importance scores at each schedule update and need NOT be
  nested: a later stage may re-admit a weight an earlier stage pruned (TW re-tiles the kept
  columns; a zeroed weight can land in a kept row segment). A re-admitted weight restarts
  from 0; between updates, a pruned weight cannot come back.

Resuming: the schedule counts the trainer's optimizer steps.
:class:`~tilesparse.callback.PruningCallback` sets ``step_count`` from the trainer's ``step``,
so a pruner prepared on the model handed to ``Trainer.load_checkpoint`` continues the schedule
where the run stopped (attach it with ``step_offset=0``, the step its schedule started at). The
masks come back with the model's ``state_dict``; at the first step they are recomputed from the
loaded weights at the schedule's sparsity if the pruner's own record disagrees. For an exact resume
(update count, Taylor / movement sums) also save :meth:`TileSparsePruner.state_dict` and
restore it with :meth:`TileSparsePruner.load_state_dict`.

Thresholds are global across the selected layers by default (so layers get different
sparsities), each layer keeping at least ``min_layer_density`` of its weights; a layer named in
``config.overrides`` is pruned alone to its own sparsity (scaled along the schedule), and so is
every layer under ``global_threshold=False``: a layer pruned alone is not floored by
``min_layer_density`` and reaches its sparsity.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from tilesparse.backend import Backend, parse_backend
from tilesparse.calibrate import InputStats, LayerReconstruction, OutputCheck
from tilesparse.callback import PruningCallback
from tilesparse.config import Pattern, TileSparseConfig, fitting_tile
from tilesparse.format import tile_groups
from tilesparse.importance import ActivationScore, ScoreTracker, make_tracker
from tilesparse.linear import TileSparseLinear
from tilesparse.patterns import masks_for_config
from tilesparse.refit import LayerSearch, RefitTarget, refit_layers
from tilesparse.schedule import sparsity_at
from tilesparse.selection import FilterFn, default_filter, select_layers
from tilesparse.weight_mask import WeightMask, masked_weight

__all__ = [
    "FilterFn",
    "WeightMask",
    "LayerStats",
    "TileSparsePruner",
    "default_filter",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerStats:
    """One pruned layer: shape ``K × N``, weights kept, columns kept, tiles of the mask."""

    fqn: str
    in_features: int
    out_features: int
    params: int
    kept: int
    kept_columns: int
    tiles: int

    @property
    def sparsity(self) -> float:
        return 1.0 - self.kept / self.params

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"sparsity": self.sparsity}


class TileSparsePruner:
    """Prunes the ``nn.Linear`` layers of a model that ``filter_fn`` selects.

    Args:
        config: what, how and when to prune.
        filter_fn: ``(module, fqn) -> bool``; default: every ``nn.Linear``.
    """

    def __init__(self, config: TileSparseConfig, filter_fn: FilterFn | None = None) -> None:
        if not isinstance(config, TileSparseConfig):
            raise ValueError(f"config must be a TileSparseConfig, got {type(config).__name__}")
        self.config = config.resolved(calibrated=False)
        self.filter_fn = filter_fn or default_filter
        self.tracker: ScoreTracker = make_tracker(
            self.config.importance_kind, self.config.taylor_steps
        )
        # a selected layer whose weight is another selected layer's tensor → that layer
        self.tied: dict[str, str] = {}
        self.model: nn.Module | None = None
        self.layers: dict[str, nn.Linear] = {}
        self.step_count = 0
        self.current_sparsity = 0.0
        self.updates = 0
        self.compressed = False
        self.reconstructions: list[LayerReconstruction] = []
        # a calibrated prune's last check on held-out samples (tilesparse.oneshot)
        self.output_check: OutputCheck | None = None

    # -- setup -----------------------------------------------------------------------------
    def select(self, model: nn.Module) -> dict[str, nn.Linear]:
        """The layers of ``model`` this pruner would prune, by name, in module order.

        Raises:
            ValueError: as :meth:`prepare` (no layer selected, an empty or already
                parametrized layer, an override naming an unselected layer).
        """
        layers, tied = select_layers(model, self.filter_fn, self.config.overrides)
        for fqn, owner in tied.items():
            log.warning(
                "tilesparse: layer %r shares its weight tensor with %r: the tensor is pruned "
                "once, with %r's mask",
                fqn,
                owner,
                owner,
            )
        self.tied = tied
        if self.config.tile is None:
            self.config = replace(
                self.config, tile=fitting_tile(m.out_features for m in layers.values())
            )
        return layers

    def prepare(self, model: nn.Module) -> nn.Module:
        """Attach an all-ones mask to each selected layer, then apply the schedule's step 0.

        With an importance that needs gradients (Taylor, movement) a step-0 update is
        deferred to the first :meth:`step` (after one observed backward pass); with
        ``activation`` importance, until input norms are set (:func:`prune_` with
        ``calibration`` sets them first).

        Returns:
            ``model``, modified in place.

        Raises:
            ValueError: when the pruner is already prepared, no layer is selected, a selected
                layer has no weights (``in_features`` or ``out_features`` 0), or an override
                names a layer that is not selected.
        """
        if self.model is not None:
            raise ValueError("this pruner is already prepared on a model; make a new one")
        layers = self.select(model)
        try:
            for m in layers.values():
                n, k = m.weight.shape
                parametrize.register_parametrization(
                    m, "weight", WeightMask(n, k, device=m.weight.device)
                )
            self.model, self.layers = model, layers
            log.info("tilesparse: prepared %d layers (%d weights)", len(layers), self.total_params)
            s0 = sparsity_at(self.config.schedule, 0, self.config.target_sparsity)
            waits = self.tracker.needs_gradients or (
                isinstance(self.tracker, ActivationScore)
                and set(layers) - set(self.tracker.input_norms)
            )
            if s0 > 0 and not waits:
                self.update_masks(s0)  # changes no weight unless every mask was computed
        except BaseException:
            self.unprepare(layers)
            raise
        return model

    def unprepare(self, layers: dict[str, nn.Linear] | None = None) -> None:
        """Take the masks off again (each weight back to its ``original`` tensor, as it is)
        and forget the model: undoes :meth:`prepare` when nothing was pruned yet."""
        for m in (self.layers if layers is None else layers).values():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
        self.model, self.layers = None, {}
        self.current_sparsity, self.updates = 0.0, 0

    def _check_prepared(self) -> None:
        if self.model is None:
            raise ValueError("call prepare(model) first")
        if self.compressed:
            raise ValueError("the model was compressed; masks can no longer change")

    # -- training hooks --------------------------------------------------------------------
    def observe(self) -> None:
        """Feed the current gradients to the importance score (after ``backward()``)."""
        self._check_prepared()
        if not self.tracker.needs_gradients:
            return
        weights, grads = {}, {}
        for fqn, m in self.layers.items():
            g = masked_weight(m)[0].grad
            if g is not None:
                grads[fqn] = g.detach().T  # grad of the masked weight, restricted to kept ones
                weights[fqn] = m.weight.detach().T
        self.tracker.observe(weights, grads)

    def step(self) -> bool:
        """Advance the schedule by one training step (after ``optimizer.step()``).

        First zeroes ``original`` wherever the mask is 0 (an optimizer with momentum or weight
        decay moves pruned entries although their gradient is 0), then moves ``step_count`` on
        by one and updates the masks when the schedule's sparsity changed.

        Returns:
            whether the masks were updated.
        """
        self._check_prepared()
        self._zero_pruned()
        self.step_count += 1
        s = sparsity_at(self.config.schedule, self.step_count, self.config.target_sparsity)
        if s != self.current_sparsity:
            self.update_masks(s)
            return True
        return False

    @torch.no_grad()
    def _zero_pruned(self) -> None:
        for m in self.layers.values():
            original, wm = masked_weight(m)
            original.mul_(wm.mask)

    def callback(self, step_offset: int | None = None) -> PruningCallback:
        """A trainer callback driving :meth:`observe` and :meth:`step`, with the schedule at
        step ``trainer.step - step_offset`` (``None``: from the first step; see
        :class:`PruningCallback`)."""
        return PruningCallback(self, step_offset)

    # -- saving and resuming ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The pruner's progress: what an exact resume needs besides the model's own
        ``state_dict`` (which holds the masks and the weights).

        Returns:
            ``{"step_count": int, "current_sparsity": float, "updates": int, "layers":
            [fqn, ...], "tracker_steps": int, "tracker_sums": {fqn: (K, N) float32 tensor}}``;
            every value but ``tracker_sums`` is JSON-serializable, ``tracker_sums`` (the
            Taylor / movement accumulators, empty for magnitude) is a flat name → CPU tensor
            dict that ``safetensors`` or ``torch.save`` store as is.
        """
        steps, sums = self.tracker.state()
        return {
            "step_count": self.step_count,
            "current_sparsity": self.current_sparsity,
            "updates": self.updates,
            "layers": list(self.layers),
            "tracker_steps": steps,
            "tracker_sums": sums,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into this pruner, prepared on the same architecture.
        The masks are not touched: they come back with the model's ``state_dict`` (e.g.
        ``Trainer.load_checkpoint(path, model=<the prepared model>)``).

        Raises:
            ValueError: naming the field, for a missing or mistyped field, other layers than
                this pruner's, a sparsity outside [0, 1) or a tracker sum of the wrong shape;
                the pruner is unchanged then.
        """
        self._check_prepared()
        if not isinstance(state, dict):
            raise ValueError(f"pruner state must be a dict, got {type(state).__name__}")
        need = (
            "step_count",
            "current_sparsity",
            "updates",
            "layers",
            "tracker_steps",
            "tracker_sums",
        )
        missing = [k for k in need if k not in state]
        if missing:
            raise ValueError(f"pruner state lacks {missing}")
        for k in ("step_count", "updates", "tracker_steps"):
            v = state[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"pruner state {k} must be an integer >= 0, got {v!r}")
        s = state["current_sparsity"]
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0.0 <= s < 1.0:
            raise ValueError(f"pruner state current_sparsity must be in [0, 1), got {s!r}")
        if list(state["layers"]) != list(self.layers):
            raise ValueError(
                f"pruner state is for layers {list(state['layers'])}, this pruner prunes {list(self.layers)}"
            )
        sums = state["tracker_sums"]
        if not isinstance(sums, dict):
            raise ValueError(f"pruner state tracker_sums must be a dict, got {type(sums).__name__}")
        for k, v in sums.items():
            lin = self.layers.get(k)
            want = None if lin is None else (lin.in_features, lin.out_features)
            if not isinstance(v, torch.Tensor) or want is None or tuple(v.shape) != want:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"pruner state tracker_sums[{k!r}] is {got}, expected a (K, N) = {want} tensor"
                )
        try:  # the last check, and the first change: nothing is changed when it raises
            self.tracker.load_state(state["tracker_steps"], sums)
        except ValueError:
            raise ValueError(
                f"pruner state has importance sums, but importance={self.config.importance_kind.value!r} keeps none"
            ) from None
        self.step_count = state["step_count"]
        self.current_sparsity = float(s)
        self.updates = state["updates"]

    # -- masks -----------------------------------------------------------------------------
    def _layer_sparsity(self, fqn: str, sparsity: float) -> float:
        override = self.config.override_for(fqn)
        target = self.config.target_sparsity
        if override is None:
            return sparsity
        return override * (sparsity / target) if target > 0 else override

    @torch.no_grad()
    def update_masks(self, sparsity: float) -> None:
        """Recompute every mask for an overall ``sparsity`` in [0, 1) (override layers: their
        own, scaled by ``sparsity / target``) from the current importance scores.

        Layers sharing the global threshold keep at least ``config.min_layer_density`` each;
        a layer pruned alone (an override, ``global_threshold=False``, a lone shared layer)
        gets its sparsity exactly (up to one selection unit), with no floor."""
        self._check_prepared()
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
        weights = {fqn: m.weight.detach().T for fqn, m in self.layers.items()}
        new = self.masks_from(self.tracker.scores(weights), sparsity)
        for f, mask_kn in new.items():
            self.set_mask(f, mask_kn)
        if self.tracker.reset_on_mask_update:  # Taylor: scores since the last update
            self.tracker.reset()
        self.current_sparsity = sparsity
        self.updates += 1
        log.info(
            "tilesparse: step %d, masks at sparsity %.3f (achieved %.4f over %d layers)",
            self.step_count,
            sparsity,
            self.overall_sparsity(),
            len(self.layers),
        )

    def masks_from(
        self, scores: dict[str, torch.Tensor], sparsity: float
    ) -> dict[str, torch.Tensor]:
        """Every layer's ``(K, N) bool`` mask for an overall ``sparsity`` from ``scores``
        (``(K, N)`` per layer), as :meth:`update_masks` sets them; nothing is changed.

        Raises:
            ValueError: naming the layer, for non-finite scores.
        """
        cfg = self.config
        groups: list[tuple[list[str], float]] = []
        shared = [f for f in self.layers if cfg.override_for(f) is None]
        if cfg.global_threshold and cfg.pattern is not Pattern.NM:
            if shared:
                groups.append((shared, sparsity))
        else:
            groups.extend(([f], sparsity) for f in shared)
        groups.extend(
            ([f], self._layer_sparsity(f, sparsity)) for f in self.layers if f not in shared
        )
        for f, sc in scores.items():
            if sc.numel() and not bool(torch.isfinite(sc).all()):
                raise ValueError(
                    f"layer {f!r}: {int((~torch.isfinite(sc)).sum())} of its {sc.numel()} "
                    f"importance scores are NaN or inf (a non-finite weight, gradient or "
                    f"calibration input); expected finite scores"
                )
        new: dict[str, torch.Tensor] = {}
        for names, s in groups:  # every mask first: a failure changes no weight
            # min_density=None: the config's floor for a shared group, none for a lone layer
            masks = masks_for_config(cfg, [scores[f] for f in names], s, min_density=None)
            new.update(zip(names, masks))
        return new

    @torch.no_grad()
    def set_mask(self, fqn: str, mask_kn: torch.Tensor) -> None:
        """Set layer ``fqn``'s ``(K, N) bool`` mask and zero its pruned weights."""
        original, wm = masked_weight(self.layers[fqn])
        mask_nk = mask_kn.T.to(wm.mask.device)
        wm.mask.copy_(mask_nk)
        original.mul_(mask_nk)

    def mask(self, fqn: str) -> torch.Tensor:
        """``(K, N) bool`` mask of layer ``fqn`` (a copy, on the CPU)."""
        if fqn not in self.layers:
            raise ValueError(
                f"layer {fqn!r} is not pruned by this pruner; pruned: {sorted(self.layers)}"
            )
        m = self.layers[fqn]
        if isinstance(m, TileSparseLinear):
            return m.mask_kn()
        return masked_weight(m)[1].mask.T.cpu().clone()

    def masks(self) -> dict[str, torch.Tensor]:
        """Every layer's ``(K, N) bool`` mask."""
        return {f: self.mask(f) for f in self.layers}

    @torch.no_grad()
    def apply_masks_to(self, other: nn.Module) -> nn.Module:
        """Multiply this pruner's masks into the same-named ``nn.Linear`` weights of ``other`` (a
        dense model of the same architecture, e.g. a fresh same-seed build): the masked dense
        reference that a compressed model must reproduce. Returns ``other``, changed in place.

        Raises:
            ValueError: when ``other`` lacks a pruned layer or its weight has another shape.
        """
        for fqn in self.layers:
            try:
                layer = other.get_submodule(fqn)
            except AttributeError:
                raise ValueError(f"apply_masks_to: the model has no layer {fqn!r}") from None
            mask_nk = self.mask(fqn).T
            weight = getattr(layer, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.shape != mask_nk.shape:
                got = None if weight is None else tuple(weight.shape)
                raise ValueError(
                    f"apply_masks_to: {fqn!r} weight is {got}, the mask is {tuple(mask_nk.shape)}"
                )
            weight.mul_(mask_nk.to(weight.device))
        return other

    @property
    def total_params(self) -> int:
        return sum(m.in_features * m.out_features for m in self.layers.values())

    def overall_sparsity(self) -> float:
        """Fraction of the selected layers' weights that are pruned."""
        kept = sum(int(self.mask(f).sum()) for f in self.layers)
        return 1.0 - kept / max(1, self.total_params)

    def stats(self) -> list[LayerStats]:
        """Per-layer shape, kept weights, kept columns and tiles (of width ``config.tile``)."""
        out = []
        for f, m in self.layers.items():
            mask = self.mask(f)
            out.append(
                LayerStats(
                    fqn=f,
                    in_features=m.in_features,
                    out_features=m.out_features,
                    params=m.in_features * m.out_features,
                    kept=int(mask.sum()),
                    kept_columns=int(mask.any(dim=0).sum()),
                    tiles=len(tile_groups(mask, self.config.tile_width)),
                )
            )
        return out

    # -- calibration -----------------------------------------------------------------------
    def refit(
        self,
        order: list[str],
        dense: dict[str, torch.Tensor],
        first: InputStats,
        run: Callable[[nn.Module], None],
        search: LayerSearch,
        progress: bool = False,
    ) -> list[LayerReconstruction]:
        """Choose each layer's mask and kept weights on the calibration, layer by layer in
        ``order`` (see :func:`prune_` and :mod:`tilesparse.refit`).

        Args:
            order: the pruned layers to refit, in calibration call order.
            dense: per layer the dense ``(N, K)`` weight to reproduce.
            first: the first layer's input statistics (no pruned layer precedes it).
            run: the calibration runner (:func:`tilesparse.calibrate.as_runner`).
            search: what may be chosen per layer.
            progress: a tqdm bar over the layers.

        Returns:
            per layer what was chosen and its errors (also kept in ``self.reconstructions``).
        """
        self._check_prepared()
        assert self.model is not None
        targets = [
            RefitTarget(
                fqn,
                self.layers[fqn],
                dense[fqn],
                functools.partial(self.store, fqn),
                functools.partial(self.mask, fqn),
                refit=fqn not in self.tied.values(),
                bias=self.layers[fqn].bias,
            )
            for fqn in order
        ]
        self.reconstructions = refit_layers(self.model, targets, first, run, search, progress)
        return self.reconstructions

    @torch.no_grad()
    def store(self, fqn: str, mask_kn: torch.Tensor, weight_kn: torch.Tensor) -> None:
        """Set layer ``fqn``'s mask and its kept weights ``(K, N)``."""
        original, wm = masked_weight(self.layers[fqn])
        mask_nk = mask_kn.T.to(wm.mask.device)
        wm.mask.copy_(mask_nk)
        original.copy_(weight_kn.T.to(original.device, original.dtype) * mask_nk)

    # -- finishing -------------------------------------------------------------------------
    def _replace(self, fqn: str, new: nn.Module) -> None:
        assert self.model is not None
        parent_name, _, child = fqn.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, new)

    @torch.no_grad()
    def compress(self, backend: Backend | str = "auto") -> nn.Module:
        """Replace every pruned ``nn.Linear`` by an equivalent
        :class:`~tilesparse.linear.TileSparseLinear` (tile ``config.tile``).

        The mask of any pattern is accepted; only TW-family masks give few wide tiles (an EW
        mask gives about one tile per column: correct, not fast). A module whose parent reads
        ``.weight`` directly (``nn.MultiheadAttention.out_proj``) must not be compressed.

        The parametrized layers are replaced, not un-parametrized: a ``copy.deepcopy`` of the
        pruned model taken earlier shares each layer's generated ``Parametrized*`` class, which
        ``parametrize.remove_parametrizations`` would mutate (the copy would lose ``.weight``).

        Args:
            backend: the :func:`tilesparse.ops.tw_linear` backend of the new layers.

        The compressed model is for inference: a ``TileSparseLinear`` keeps its weights in
        buffers (``values``), not parameters, so an optimizer (rebuilt or not) trains only the
        biases. Fine-tune before compressing, while the masks are parametrizations.

        Returns:
            the model, modified in place.

        Raises:
            ValueError: for an unknown backend (before any layer is replaced).
        """
        self._check_prepared()
        backend = parse_backend(backend)
        for fqn, m in list(self.layers.items()):
            mask_kn = self.mask(fqn)
            new = TileSparseLinear.from_dense(
                m, mask_kn=mask_kn, tile=self.config.tile_width, backend=backend
            )
            self._replace(fqn, new)
            # the pruned layers, compressed: TileSparseLinear stands in for the nn.Linear
            self.layers[fqn] = new  # type: ignore[assignment]  # same fqn, condensed layer
        self.compressed = True
        assert self.model is not None
        return self.model

    @torch.no_grad()
    def remove(self) -> nn.Module:
        """Bake the masks into plain ``nn.Linear`` weights (pruned entries zero) and drop the
        parametrizations; the pruner is done afterwards. In place: a ``copy.deepcopy`` of the
        pruned model taken before this call shares the layers' generated classes and loses
        their ``.weight`` (a ``torch.nn.utils.parametrize`` limitation); copy after it."""
        self._check_prepared()
        for m in self.layers.values():
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
        self.compressed = True
        assert self.model is not None
        return self.model
