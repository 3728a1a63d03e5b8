"""Workload presets: the four EMBark workloads (copied from their published table specs) and
``tiny`` for tests and laptop runs.

>>> w = get_workload("dlrm_dcnv2").scaled(1000)   # rows ÷ 1000, at least ``min_rows``
>>> len(w.tables), w.tables[0].dim
(26, 128)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from typing import Any

from embark.types import TableConfig

PRESETS = ("dlrm_dcnv2", "t180", "t200", "t510", "tiny")


def _positive_int(value: Any, what: str) -> None:
    # bool is an int subclass and a float like 13.9 would be truncated: reject both by name.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


def _widths(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{what} must be a non-empty list of positive integers, got {value!r}")
    for i, w in enumerate(value):
        _positive_int(w, f"{what}[{i}]")
    return tuple(value)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__} {value!r:.80}")
    return value


def _check_keys(d: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}")


@dataclass(frozen=True)
class Interaction:
    """Feature interaction of the DLRM: ``dot`` (pairwise dot products) or ``dcnv2``
    (``num_layers`` low-rank cross layers of rank ``low_rank``).

    Raises:
        ValueError: naming the field for an unknown type or a count that is not a positive
            integer.
    """

    type: str = "dot"
    num_layers: int = 3
    low_rank: int = 512

    def __post_init__(self) -> None:
        if self.type not in ("dot", "dcnv2"):
            raise ValueError(f"interaction.type must be 'dot' or 'dcnv2', got {self.type!r}")
        _positive_int(self.num_layers, "interaction.num_layers")
        _positive_int(self.low_rank, "interaction.low_rank")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "num_layers": self.num_layers, "low_rank": self.low_rank}

    @classmethod
    def from_dict(cls, d: Any) -> Interaction:
        """Build from :meth:`to_dict`'s form; every field optional, unknown fields rejected.

        Raises:
            ValueError: for a non-mapping, an unknown field or a bad value.
        """
        d = _mapping(d, "interaction")
        _check_keys(d, {"type", "num_layers", "low_rank"}, "interaction")
        return cls(**d)


@dataclass(frozen=True)
class Workload:
    """A DLRM workload: the tables and the dense part's shape.

    Args:
        name: preset name.
        tables: the embedding tables.
        dense_features: number of dense (continuous) inputs.
        bottom_mlp: bottom MLP widths. Its last width need not equal the tables'
            dims: a table of another dim gets a projection to that width (see :class:`~embark.models.dlrm.DLRM`).
        top_mlp: top MLP widths, ending in 1 (the logit).
        interaction: see :class:`Interaction`.
        optimizer: ``adagrad`` or ``sgd``.
        zipf_alpha: exponent of the id distribution used by the synthetic generator.
        source: where the figures come from.

    Raises:
        ValueError: naming the workload and the field for a value of the wrong type or out of
            range (counts and widths are positive integers, never bools or floats;
            ``zipf_alpha`` is a finite number > 0).
    """

    name: str
    tables: tuple[TableConfig, ...]
    dense_features: int = 13
    bottom_mlp: tuple[int, ...] = (512, 256, 128)
    top_mlp: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    interaction: Interaction = field(default_factory=Interaction)
    optimizer: str = "adagrad"
    zipf_alpha: float = 1.1
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"workload name must be a non-empty string, got {self.name!r}")
        what = f"workload {self.name!r}"
        if not isinstance(self.tables, (list, tuple)) or not self.tables:
            raise ValueError(
                f"{what}: tables must be a non-empty list of tables, got {self.tables!r:.80}"
            )
        object.__setattr__(self, "tables", tuple(self.tables))
        for t in self.tables:
            if not isinstance(t, TableConfig):
                raise ValueError(f"{what}: tables must hold TableConfig, got {type(t).__name__}")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{what}: duplicate table names {dup}")
        _positive_int(self.dense_features, f"{what}: dense_features")
        object.__setattr__(self, "bottom_mlp", _widths(self.bottom_mlp, f"{what}: bottom_mlp"))
        object.__setattr__(self, "top_mlp", _widths(self.top_mlp, f"{what}: top_mlp"))
        if self.top_mlp[-1] != 1:
            raise ValueError(f"{what}: top_mlp must end in 1 (the logit), got {self.top_mlp}")
        if not isinstance(self.interaction, Interaction):
            raise ValueError(
                f"{what}: interaction must be an Interaction, got {self.interaction!r}"
            )
        if self.optimizer not in ("adagrad", "sgd"):
            raise ValueError(
                f"{what}: optimizer must be 'adagrad' or 'sgd', got {self.optimizer!r}"
            )
        alpha = self.zipf_alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, (int, float))
            or not (math.isfinite(alpha) and alpha > 0)
        ):
            raise ValueError(f"{what}: zipf_alpha must be a finite number > 0, got {alpha!r}")
        object.__setattr__(self, "zipf_alpha", float(alpha))
        if not isinstance(self.source, str):
            raise ValueError(f"{what}: source must be a string, got {self.source!r}")

    def scaled(self, factor: float, min_rows: int = 16) -> Workload:
        """Return a copy with every table's ``num_rows`` divided by ``factor`` (at least
        ``min_rows``, never more than the original). ``factor`` must be ≥ 1."""
        if factor < 1:
            raise ValueError(f"scale factor must be >= 1, got {factor}")
        tables = tuple(
            replace(t, num_rows=min(t.num_rows, max(min_rows, int(t.num_rows // factor))))
            for t in self.tables
        )
        return replace(self, tables=tables)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "dense_features": self.dense_features,
            "bottom_mlp": list(self.bottom_mlp),
            "top_mlp": list(self.top_mlp),
            "zipf_alpha": self.zipf_alpha,
            "interaction": self.interaction.to_dict(),
            "optimizer": self.optimizer,
            "tables": [t.to_dict() for t in self.tables],
        }

    @classmethod
    def from_dict(cls, d: Any) -> Workload:
        """Build from :meth:`to_dict`'s form. ``name`` and ``tables`` are required; the other
        fields default as in the class; unknown fields (a misspelt ``botom_mlp``) are rejected.

        Raises:
            ValueError: naming the field for a missing or unknown field or a bad value.
        """
        d = _mapping(d, "workload")
        _check_keys(d, {f.name for f in fields(cls)}, f"workload {d.get('name', '?')!r}")
        for required in ("name", "tables"):
            if required not in d:
                raise ValueError(f"workload: missing field {required!r}")
        what = f"workload {d['name']!r}"
        raw_tables = d["tables"]
        if not isinstance(raw_tables, list):
            raise ValueError(f"{what}: tables must be a list of tables, got {raw_tables!r:.80}")
        tables = tuple(
            TableConfig.from_dict(_mapping(t, f"{what}: tables[{i}]"))
            for i, t in enumerate(raw_tables)
        )
        kwargs = {k: v for k, v in d.items() if k not in ("tables", "interaction")}
        if "interaction" in d:
            kwargs["interaction"] = Interaction.from_dict(d["interaction"])
        return cls(tables=tables, **kwargs)


def _tiny() -> Workload:
    # Small enough to train in well under a minute on 2 cores, shaped like DLRM-DCNv2.
    rows = (1000, 500, 200, 2000, 100, 50, 800, 300)
    hot = (1, 2, 1, 3, 1, 1, 2, 1)
    tables = tuple(
        TableConfig(name=f"t{i}", num_rows=r, dim=16, hotness=h)
        for i, (r, h) in enumerate(zip(rows, hot))
    )
    return Workload(
        name="tiny",
        tables=tables,
        dense_features=13,
        bottom_mlp=(64, 32, 16),
        top_mlp=(128, 64, 1),
        interaction=Interaction(type="dcnv2", num_layers=2, low_rank=32),
        optimizer="adagrad",
        zipf_alpha=1.1,
        source="tilerec tiny preset (synthetic)",
    )


def get_workload(name: str) -> Workload:
    """Load a preset by name (one of :data:`PRESETS`).

    Raises:
        ValueError: for an unknown name.
    """
    if name == "tiny":
        return _tiny()
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; expected one of {list(PRESETS)}")
    text = resources.files("embark.models.presets").joinpath(f"{name}.json").read_text()
    return Workload.from_dict(json.loads(text))
