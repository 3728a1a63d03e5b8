"""Pruning configuration: what to prune (:class:`TileSparseConfig`) and when (the schedule
configs). Frozen, validated dataclasses that round-trip through JSON and load from a YAML or
JSON recipe file, so a pruning recipe can be versioned beside the code::

    # recipe.yaml
    pattern: tw
    sparsity: 0.75
    tile: 128
    importance: taylor
    schedule: {kind: multistage, stages: [0.25, 0.5, 0.75], steps_per_stage: 200}

>>> cfg = TileSparseConfig(pattern="tw", sparsity=0.75, tile=64)
>>> TileSparseConfig.from_json(cfg.to_json()) == cfg
True
>>> TileSparseConfig(sparsity=1.0)
Traceback (most recent call last):
...
ValueError: TileSparseConfig.sparsity must be in [0, 1), got 1.0
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from tilesparse.recipe_file import read_recipe

__all__ = [
    "Pattern",
    "Importance",
    "ScheduleKind",
    "OneShotSchedule",
    "MultiStageSchedule",
    "CubicSchedule",
    "ScheduleConfig",
    "TileSparseConfig",
    "PAPER_STAGES",
    "fitting_tile",
    "schedule_from_dict",
]

# The paper's tile width: a tensor-core threadblock's N-tile (Guo et al., SC20).
MAX_TILE = 128
# The narrowest automatic tile: below it a tile's GEMM is too small to beat a dense one.
MIN_TILE = 8
# A layer narrower than this many outputs (a logit head) does not limit the automatic tile.
NARROW_LAYER = 32


def fitting_tile(out_features: Iterable[int]) -> int:
    """The automatic TW tile width for layers of these output widths: the largest power of
    two ``<= width / 2`` of the narrowest layer (so it has at least two tiles), between
    :data:`MIN_TILE` and :data:`MAX_TILE`; layers under :data:`NARROW_LAYER` outputs are not
    counted.

    >>> fitting_tile([1536, 384]), fitting_tile([512, 256, 64, 1]), fitting_tile([1])
    (128, 32, 8)
    """
    widths = [w for w in out_features if w >= NARROW_LAYER]
    if not widths:
        return MIN_TILE
    half = min(widths) // 2
    return max(MIN_TILE, min(MAX_TILE, 1 << (half.bit_length() - 1)))


# The paper's stages of rising sparsity with fine-tuning between them (Guo et al., SC20, §5).
PAPER_STAGES = (0.25, 0.40, 0.50, 0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90)


class Pattern(StrEnum):
    """Sparsity pattern of a pruned weight (see :mod:`tilesparse.patterns`)."""

    TW = "tw"  # tile-wise: global column pruning, then per-tile row pruning
    TW_ROWS = "tw_rows"  # tile-wise, row pruning only (every column kept)
    TEW = "tew"  # tile-wise plus the top delta of single elements restored
    EW = "ew"  # element-wise (unstructured)
    NM = "nm"  # N:M along K (vector-wise, e.g. 2:4)
    BW = "bw"  # block-wise


class Importance(StrEnum):
    """Weight importance score (see :mod:`tilesparse.importance`)."""

    MAGNITUDE = "magnitude"  # |w|
    TAYLOR = "taylor"  # first-order Taylor (g·w)², accumulated over steps
    MOVEMENT = "movement"  # -Σ g·w (Sanh et al., 2020)
    ACTIVATION = "activation"  # |w|·‖x‖ on calibration inputs (Wanda, Sun et al., 2023)


class ScheduleKind(StrEnum):
    ONESHOT = "oneshot"
    MULTISTAGE = "multistage"
    CUBIC = "cubic"


def _check_int(owner: str, name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{owner}.{name} must be an integer >= {lo}, got {value!r}")


def _check_unit(owner: str, name: str, value: Any, *, closed_right: bool) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and 0.0 <= value and (value <= 1.0 if closed_right else value < 1.0)
    if not ok:
        rng = "[0, 1]" if closed_right else "[0, 1)"
        raise ValueError(f"{owner}.{name} must be in {rng}, got {value!r}")


def _reject_unknown(cls: type, d: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> None:
    allowed = {f.name for f in fields(cls)} | set(ignore)
    unknown = sorted(set(d) - allowed, key=str)  # a file's keys need not all be strings
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; allowed {sorted(allowed)}")


@dataclass(frozen=True)
class OneShotSchedule:
    """Prune to the target sparsity once, at ``step``.

    Args:
        step: the training step at which the masks are set (>= 0).
    """

    step: int = 0
    kind: ScheduleKind = field(default=ScheduleKind.ONESHOT, init=False)

    def __post_init__(self) -> None:
        _check_int("OneShotSchedule", "step", self.step, 0)


@dataclass(frozen=True)
class MultiStageSchedule:
    """Stages of rising sparsity with ``steps_per_stage`` fine-tuning steps after each.

    Stage ``i`` is applied at step ``start + i * steps_per_stage``. Stages above the target
    sparsity are dropped and the target is appended when missing, so ``stages=None`` (the
    paper's 25, 40, 50, 60, 65, 70, 75, 80, 85, 90%) fits any target.

    Args:
        stages: ascending sparsities in (0, 1), or ``None`` for :data:`PAPER_STAGES`.
        steps_per_stage: fine-tuning steps between stages (>= 1).
        start: step of the first stage (>= 0).
    """

    stages: tuple[float, ...] | None = None
    steps_per_stage: int = 100
    start: int = 0
    kind: ScheduleKind = field(default=ScheduleKind.MULTISTAGE, init=False)

    def __post_init__(self) -> None:
        if self.stages is not None:
            if isinstance(self.stages, str | bytes | Mapping) or not isinstance(
                self.stages, Iterable
            ):
                raise ValueError(
                    f"MultiStageSchedule.stages must be a list of sparsities in [0, 1) or None, got {self.stages!r}"
                )
            stages = tuple(self.stages)
            for i, s in enumerate(stages):  # numbers.Real: NumPy scalars too, not "0.5" or True
                ok = isinstance(s, numbers.Real) and not isinstance(s, bool)
                _check_unit(
                    "MultiStageSchedule", f"stages[{i}]", float(s) if ok else s, closed_right=False
                )
            stages = tuple(float(s) for s in stages)
            object.__setattr__(self, "stages", stages)
            if not stages:
                raise ValueError(
                    "MultiStageSchedule.stages must not be empty (use None for the paper's)"
                )
            if any(b <= a for a, b in zip(stages, stages[1:])):
                raise ValueError(
                    f"MultiStageSchedule.stages must be strictly ascending, got {list(stages)}"
                )
        _check_int("MultiStageSchedule", "steps_per_stage", self.steps_per_stage, 1)
        _check_int("MultiStageSchedule", "start", self.start, 0)


@dataclass(frozen=True)
class CubicSchedule:
    """Gradual pruning of Zhu & Gupta (2017, "To prune, or not to prune"):
    ``s_t = s_f + (s_i - s_f) · (1 - (t - begin) / (end - begin))³`` for ``begin <= t <= end``,
    updated every ``frequency`` steps.

    Args:
        begin_step: first update (>= 0).
        end_step: last update (> begin_step); the target holds from here on.
        frequency: steps between mask updates (>= 1).
        initial_sparsity: ``s_i`` in [0, 1).
    """

    begin_step: int = 0
    end_step: int = 1000
    frequency: int = 100
    initial_sparsity: float = 0.0
    kind: ScheduleKind = field(default=ScheduleKind.CUBIC, init=False)

    def __post_init__(self) -> None:
        _check_int("CubicSchedule", "begin_step", self.begin_step, 0)
        _check_int("CubicSchedule", "end_step", self.end_step, self.begin_step + 1)
        _check_int("CubicSchedule", "frequency", self.frequency, 1)
        _check_unit("CubicSchedule", "initial_sparsity", self.initial_sparsity, closed_right=False)


ScheduleConfig = OneShotSchedule | MultiStageSchedule | CubicSchedule
_SCHEDULES: dict[ScheduleKind, type] = {
    ScheduleKind.ONESHOT: OneShotSchedule,
    ScheduleKind.MULTISTAGE: MultiStageSchedule,
    ScheduleKind.CUBIC: CubicSchedule,
}


def _schedule_to_dict(s: ScheduleConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": s.kind.value}
    for f in fields(s):
        if f.name != "kind":
            v = getattr(s, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
    return d


def schedule_from_dict(d: Mapping[str, Any]) -> ScheduleConfig:
    """Build a schedule config from ``{"kind": "oneshot"|"multistage"|"cubic", ...}``.

    Raises:
        ValueError: for a missing/unknown kind or an unknown key.
    """
    if not isinstance(d, Mapping):
        raise ValueError(
            f"schedule must be a schedule config or a mapping with a 'kind', got {d!r}"
        )
    try:
        kind = ScheduleKind(str(d.get("kind")))
    except ValueError:
        raise ValueError(
            f"schedule.kind must be one of {[k.value for k in ScheduleKind]}, got {d.get('kind')!r}"
        ) from None
    cls = _SCHEDULES[kind]
    _reject_unknown(cls, d)
    kwargs = {k: v for k, v in d.items() if k != "kind"}
    if isinstance(kwargs.get("stages"), list):
        kwargs["stages"] = tuple(kwargs["stages"])
    return cls(**kwargs)


def _overrides_dict(owner: str, overrides: Any) -> dict[Any, Any]:
    """``overrides`` (a mapping, or ``(name, sparsity)`` pairs) as a dict, else ``ValueError``."""
    if isinstance(overrides, Mapping):
        return dict(overrides.items())
    if isinstance(overrides, Iterable) and not isinstance(overrides, str | bytes):
        pairs = list(overrides)
        if all(isinstance(p, list | tuple) and len(p) == 2 for p in pairs):
            return dict(pairs)
    raise ValueError(
        f"{owner}.overrides must be a mapping of module name to sparsity (in a recipe file: "
        f"'overrides: {{top_mlp.0: 0.5}}'), got {overrides!r}"
    )


E = TypeVar("E", Pattern, Importance)


def _enum_field(owner: str, name: str, enum: type[E], value: Any) -> E:
    """``enum(value)``, else ``ValueError`` naming the field and the accepted values."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(
            f"{owner}.{name} must be one of {[e.value for e in enum]}, got {value!r}"
        ) from None


def _block_field(owner: str, block: Any) -> tuple[int, int]:
    """``(bk, bn)`` from a pair or one integer ``b`` (a square block), each >= 1."""
    if isinstance(block, int) and not isinstance(block, bool):
        pair = (block, block)
    elif isinstance(block, list | tuple) and len(block) == 2:
        pair = (block[0], block[1])
    else:
        raise ValueError(
            f"{owner}.block must be (bk, bn) or one integer b for (b, b), got {block!r}"
        )
    for i, v in enumerate(pair):
        _check_int(owner, f"block[{i}]", v, 1)
    return pair


def _schedule_field(owner: str, schedule: Any) -> ScheduleConfig:
    """A schedule config as is, or one built from its mapping (errors name the field)."""
    if isinstance(schedule, OneShotSchedule | MultiStageSchedule | CubicSchedule):
        return schedule
    try:
        return schedule_from_dict(schedule)
    except ValueError as e:  # name the field: "...schedule.kind must be", "...schedule: ..."
        msg = str(e)
        raise ValueError(
            f"{owner}.{msg}" if msg.startswith("schedule") else f"{owner}.schedule: {msg}"
        ) from None


@dataclass(frozen=True)
class TileSparseConfig:
    """What to prune, how, and when.

    Args:
        pattern: one of :class:`Pattern` (``tw``, ``tw_rows``, ``tew``, ``ew``, ``nm``, ``bw``).
        sparsity: target fraction of pruned weights in [0, 1). ``None`` means 0.75, or
            ``1 - n/m`` for ``nm`` (the only sparsity an N:M pattern has).
        tile: ``G``, columns per tile for the TW family (> 0). 128 matches a tensor-core
            threadblock N-tile (the paper's choice). ``None`` (default): what fits the
            selected layers (:func:`fitting_tile`: 128 when every layer has 256 or more
            outputs, down to 8 for narrow ones, so a small layer is never one tile by accident).
        importance: one of :class:`Importance`. ``None`` (default): ``magnitude`` without a
            calibration; with one (:func:`tilesparse.prune_` ``calibration=``) each layer takes
            ``activation`` or ``magnitude``, whichever its held-out calibration data prefers.
        column_share: how the TW budget is split between column pruning and per-tile row
            pruning, as the exponent of the kept fraction: columns keep ``(1-s)**column_share``,
            rows ``(1-s)**(1-column_share)``. 0.5 is the paper's even split
            ``s' = 100 - sqrt(10000 - 100·s)`` (75% → 50% columns, 50% rows); 0 prunes rows only.
            ``None`` (default): 0.5 without a calibration; with one, 0.5 or 0 per layer, chosen
            by the held-out calibration error (rows only where removing output columns cannot
            be reconstructed, such as a layer writing a residual stream).
        n, m: the N:M pattern (keep ``n`` of every ``m`` consecutive K entries), ``1 <= n <= m``.
        block: ``(bk, bn)`` block shape for ``bw``; one integer ``b`` means ``(b, b)``.
        tew_delta: fraction of all weights restored as single elements by ``tew``;
            ``sparsity + tew_delta`` (and each override's sparsity ``+ tew_delta``) must stay < 1.
        global_threshold: one threshold over all pruned layers (layers end up with different
            sparsities) rather than the target in each layer. With a calibration and automatic
            ``importance`` or ``column_share``, the threshold only allocates the layers'
            sparsities: each layer's mask is then chosen at its sparsity
            (:mod:`tilesparse.refit`).
        min_layer_density: floor on the fraction of weights each layer keeps when two or more
            layers share a global threshold, so no layer is pruned away (their overall sparsity
            then stays <= ``1 - min_layer_density``); in (0, 1]. A layer pruned alone (every
            layer under ``global_threshold=False``, an override, a lone selected layer) is not
            floored: it reaches its own sparsity.
        overrides: fully-qualified module name → its own sparsity (pruned alone, outside the
            global threshold). Not allowed with ``nm``.
        taylor_steps: most backward passes accumulated into the Taylor score between two
            mask updates (>= 1; the paper sums ~100).
        damping: the ridge of the calibration's least-squares reconstruction, as a fraction
            of the mean diagonal of the layer's input Gram matrix (>= 0; SparseGPT's is 0.01).
            ``None`` (default): chosen per layer by the held-out calibration error
            (:data:`tilesparse.refit.DAMPINGS`).
        schedule: a :class:`OneShotSchedule`, :class:`MultiStageSchedule` or
            :class:`CubicSchedule`.

    Raises:
        ValueError: naming the field and the allowed range.
    """

    pattern: Pattern = Pattern.TW
    sparsity: float | None = None
    tile: int | None = None
    importance: Importance | None = None
    column_share: float | None = None
    n: int = 2
    m: int = 4
    block: tuple[int, int] = (32, 32)
    tew_delta: float = 0.05
    global_threshold: bool = True
    min_layer_density: float = 0.02
    overrides: tuple[tuple[str, float], ...] = ()
    taylor_steps: int = 100
    damping: float | None = None
    schedule: ScheduleConfig = field(default_factory=OneShotSchedule)

    def __post_init__(self) -> None:
        owner = "TileSparseConfig"
        set_ = object.__setattr__
        set_(self, "pattern", _enum_field(owner, "pattern", Pattern, self.pattern))
        if self.importance is not None:
            set_(self, "importance", _enum_field(owner, "importance", Importance, self.importance))
        _check_int(owner, "n", self.n, 1)
        _check_int(owner, "m", self.m, 1)
        if self.n > self.m:
            raise ValueError(f"{owner}.n must be <= m={self.m}, got {self.n}")
        sparsity = self._checked_sparsity(owner)
        set_(self, "sparsity", sparsity)
        if self.tile is not None:
            _check_int(owner, "tile", self.tile, 1)
        if self.column_share is not None:
            _check_unit(owner, "column_share", self.column_share, closed_right=True)
        set_(self, "block", _block_field(owner, self.block))
        _check_unit(owner, "tew_delta", self.tew_delta, closed_right=False)
        if self.pattern is Pattern.TEW and sparsity + self.tew_delta >= 1.0:
            raise ValueError(
                f"{owner}.tew_delta must be < 1 - sparsity = {1 - sparsity:g} for 'tew', got {self.tew_delta}"
            )
        if not isinstance(self.global_threshold, bool):
            raise ValueError(
                f"{owner}.global_threshold must be a bool, got {self.global_threshold!r}"
            )
        d = self.min_layer_density
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0.0 < d <= 1.0:
            raise ValueError(f"{owner}.min_layer_density must be in (0, 1], got {d!r}")
        set_(self, "overrides", self._checked_overrides(owner))
        _check_int(owner, "taylor_steps", self.taylor_steps, 1)
        dmp = self.damping
        if dmp is not None and (
            isinstance(dmp, bool) or not isinstance(dmp, int | float) or not 0 <= dmp < math.inf
        ):
            raise ValueError(f"{owner}.damping must be a finite number >= 0 or None, got {dmp!r}")
        set_(self, "schedule", _schedule_field(owner, self.schedule))

    def _checked_sparsity(self, owner: str) -> float:
        """``sparsity`` as a float in [0, 1) (its default when None), ``1 - n/m`` for ``nm``."""
        if self.sparsity is None:
            return 1.0 - self.n / self.m if self.pattern is Pattern.NM else 0.75
        _check_unit(owner, "sparsity", self.sparsity, closed_right=False)
        sparsity = float(self.sparsity)
        if self.pattern is Pattern.NM and not math.isclose(sparsity, 1.0 - self.n / self.m):
            raise ValueError(
                f"{owner}.sparsity must be 1 - n/m = {1.0 - self.n / self.m:g} for pattern 'nm' "
                f"({self.n}:{self.m}), got {sparsity}"
            )
        return sparsity

    def _checked_overrides(self, owner: str) -> tuple[tuple[str, float], ...]:
        """``overrides`` as sorted ``(name, sparsity)`` pairs, each sparsity in [0, 1) (and
        under ``1 - tew_delta`` for ``tew``); none allowed for ``nm``."""
        ov = _overrides_dict(owner, self.overrides)
        for fqn, s in ov.items():
            if not isinstance(fqn, str) or not fqn:
                raise ValueError(f"{owner}.overrides keys must be module names, got {fqn!r}")
            _check_unit(owner, f"overrides[{fqn!r}]", s, closed_right=False)
        if ov and self.pattern is Pattern.NM:
            raise ValueError(
                f"{owner}.overrides are not allowed with pattern 'nm' (its sparsity is fixed)"
            )
        if self.pattern is Pattern.TEW:
            for fqn, s in ov.items():
                if s + self.tew_delta >= 1.0:
                    raise ValueError(
                        f"{owner}.overrides[{fqn!r}] = {s} plus tew_delta = {self.tew_delta} must be < 1 "
                        f"for 'tew' (the restored elements come out of the kept ones)"
                    )
        return tuple(sorted((k, float(v)) for k, v in ov.items()))

    def resolved(self, calibrated: bool) -> TileSparseConfig:
        """This config with the automatic knobs (``None``) set as the pruner uses them:
        ``importance`` magnitude (activation when ``calibrated``), ``column_share`` 0.5.
        ``tile`` is left to the layers (:func:`fitting_tile`); explicit values are kept."""
        return replace(
            self,
            importance=self.importance
            if self.importance is not None
            else (Importance.ACTIVATION if calibrated else Importance.MAGNITUDE),
            column_share=self.column_share if self.column_share is not None else 0.5,
        )

    @property
    def tile_width(self) -> int:
        """``tile``, once set (:meth:`TileSparsePruner.select` sets it from the layers).

        Raises:
            ValueError: while it is still ``None`` (automatic).
        """
        if self.tile is None:
            raise ValueError("TileSparseConfig.tile is automatic (None): select layers first")
        return self.tile

    @property
    def share(self) -> float:
        """``column_share`` (0.5 while automatic)."""
        return 0.5 if self.column_share is None else self.column_share

    @property
    def importance_kind(self) -> Importance:
        """``importance`` (magnitude while automatic)."""
        return Importance.MAGNITUDE if self.importance is None else self.importance

    @property
    def target_sparsity(self) -> float:
        """The final sparsity (never ``None`` after construction)."""
        assert self.sparsity is not None  # set in __post_init__
        return self.sparsity

    def override_for(self, fqn: str) -> float | None:
        """The per-module sparsity override of ``fqn``, if any."""
        return dict(self.overrides).get(fqn)

    # -- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (enums as their values, tuples as lists)."""
        return {
            "pattern": self.pattern.value,
            "sparsity": self.sparsity,
            "tile": self.tile,
            "importance": None if self.importance is None else self.importance.value,
            "column_share": self.column_share,
            "n": self.n,
            "m": self.m,
            "block": list(self.block),
            "tew_delta": self.tew_delta,
            "global_threshold": self.global_threshold,
            "min_layer_density": self.min_layer_density,
            "overrides": dict(self.overrides),
            "taylor_steps": self.taylor_steps,
            "damping": self.damping,
            "schedule": _schedule_to_dict(self.schedule),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TileSparseConfig:
        """Inverse of :meth:`to_dict`; missing keys take their defaults.

        Raises:
            ValueError: for an unknown key (naming it and the allowed keys) or a bad value.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"TileSparseConfig: expected a mapping, got {type(d).__name__}")
        _reject_unknown(cls, d)
        return cls(**dict(d))  # __post_init__ builds the schedule from its mapping

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TileSparseConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> TileSparseConfig:
        """Load a recipe file: ``.yaml``/``.yml`` or ``.json``.

        Raises:
            ValueError: one line naming the file, for another suffix, text that does not parse
                (with its line and column), a key given twice in one mapping (naming it and the
                lines of both), a file that is not a mapping, or a bad key/value
                (naming the field, e.g. ``TileSparseConfig.schedule: MultiStageSchedule.stages``).
            OSError: when the file cannot be read.
        """
        p = Path(path)
        data = read_recipe(p)
        try:
            return cls.from_dict(data if data is not None else {})
        except (ValueError, TypeError) as e:  # TypeError: a safety net; checks raise ValueError
            raise ValueError(f"recipe file {p}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write the config as JSON or YAML (by suffix)."""
        p = Path(path)
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            p.write_text(yaml.safe_dump(self.to_dict(), sort_keys=True))
        else:
            p.write_text(self.to_json() + "\n")
