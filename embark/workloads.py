"""Workload presets: the four EMBark workloads (copied from their published table specs) and
``tiny`` for tests and laptop runs.

>>> w = get_workload("dlrm_dcnv2").scaled(1000)   # rows ÷ 1000, at least ``min_rows``
>>> len(w.tables), w.tables[0].dim
(26, 128)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from embark.types import TableConfig

PRESETS = ("dlrm_dcnv2", "t180", "t200", "t510", "tiny")


@dataclass(frozen=True)
class Interaction:
    """Feature interaction of the DLRM: ``dot`` (pairwise dot products) or ``dcnv2``
    (``num_layers`` low-rank cross layers of rank ``low_rank``)."""

    type: str = "dot"
    num_layers: int = 3
    low_rank: int = 512

    def __post_init__(self) -> None:
        if self.type not in ("dot", "dcnv2"):
            raise ValueError(f"interaction.type must be 'dot' or 'dcnv2', got {self.type!r}")
        if self.num_layers <= 0 or self.low_rank <= 0:
            raise ValueError(
                f"interaction num_layers and low_rank must be > 0, got {self.num_layers}, {self.low_rank}"
            )


@dataclass(frozen=True)
class Workload:
    """A DLRM workload: the tables and the dense part's shape.

    Args:
        name: preset name.
        tables: the embedding tables.
        dense_features: number of dense (continuous) inputs.
        bottom_mlp: bottom MLP widths; the last must equal every table's dim for ``dot``.
        top_mlp: top MLP widths, ending in 1 (the logit).
        interaction: see :class:`Interaction`.
        optimizer: ``adagrad`` or ``sgd``.
        zipf_alpha: exponent of the id distribution used by the synthetic generator.
        source: where the figures come from.
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
        if not self.tables:
            raise ValueError(f"workload {self.name!r}: tables must not be empty")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"workload {self.name!r}: duplicate table names")
        if self.dense_features <= 0:
            raise ValueError(f"workload {self.name!r}: dense_features must be > 0, got {self.dense_features}")
        if not self.bottom_mlp or any(w <= 0 for w in self.bottom_mlp):
            raise ValueError(f"workload {self.name!r}: bottom_mlp widths must be > 0, got {self.bottom_mlp}")
        if not self.top_mlp or any(w <= 0 for w in self.top_mlp) or self.top_mlp[-1] != 1:
            raise ValueError(f"workload {self.name!r}: top_mlp must be positive widths ending in 1, got {self.top_mlp}")
        if self.optimizer not in ("adagrad", "sgd"):
            raise ValueError(f"workload {self.name!r}: optimizer must be 'adagrad' or 'sgd', got {self.optimizer!r}")
        if self.zipf_alpha <= 0:
            raise ValueError(f"workload {self.name!r}: zipf_alpha must be > 0, got {self.zipf_alpha}")

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
            "interaction": {
                "type": self.interaction.type,
                "num_layers": self.interaction.num_layers,
                "low_rank": self.interaction.low_rank,
            },
            "optimizer": self.optimizer,
            "tables": [t.to_dict() for t in self.tables],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        d = dict(d)
        try:
            tables = tuple(TableConfig.from_dict(t) for t in d.pop("tables"))
        except KeyError:
            raise ValueError("workload: missing field 'tables'") from None
        inter = Interaction(**d.pop("interaction", {}))
        return cls(
            name=d.pop("name"),
            tables=tables,
            interaction=inter,
            dense_features=int(d.pop("dense_features", 13)),
            bottom_mlp=tuple(d.pop("bottom_mlp", (512, 256, 128))),
            top_mlp=tuple(d.pop("top_mlp", (1024, 1024, 512, 256, 1))),
            optimizer=d.pop("optimizer", "adagrad"),
            zipf_alpha=float(d.pop("zipf_alpha", 1.1)),
            source=d.pop("source", ""),
        )


def _tiny() -> Workload:
    # Small enough to train in well under a minute on 2 cores, shaped like DLRM-DCNv2.
    rows = (1000, 500, 200, 2000, 100, 50, 800, 300)
    hot = (1, 2, 1, 3, 1, 1, 2, 1)
    tables = tuple(
        TableConfig(name=f"t{i}", num_rows=r, dim=16, hotness=h) for i, (r, h) in enumerate(zip(rows, hot))
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
    text = resources.files("embark.presets").joinpath(f"{name}.json").read_text()
    return Workload.from_dict(json.loads(text))
